"""Draft-model speculative decoding: Qwen2.5-Coder-1.5B with Qwen2.5-Coder-0.5B drafting, against
plain decoding of the 1.5B, in one run, through LLMEngine in-process (greedy).

Each request asks the chat model to write a short Python function (code prompts: the small model
of the same family guesses most tokens of such answers). Batch size B runs B different prompts at
once; the table gives output tokens per second over the whole generation (prefill included), the
speed-up, the accept length (tokens emitted per verify pass of one request, the model's own token
included) and the acceptance rate (drafted tokens kept), and whether the outputs equal plain
decoding's (bf16 steps of other shapes round differently, so a near-tie can flip; float32 is exact).

    .venv/bin/python benchmarks/spec_draft.py                          # B=1,2,4, k=4
    .venv/bin/python benchmarks/spec_draft.py --batch-sizes 1 --num-speculative-tokens 3,5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_ngram import CLOCKS, _cpu_name, run  # noqa: E402

from servelm.config import (CacheConfig, EngineConfig, ModelConfig, RuntimeConfig,  # noqa: E402
                            SchedulerConfig, SpeculativeConfig)
from servelm.engine.engine import LLMEngine  # noqa: E402

TASKS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime. Only the code.",
    "Write a Python function `fibonacci(n)` returning the first n Fibonacci numbers as a list. "
    "Only the code.",
    "Write a Python function `merge_sorted(a, b)` that merges two sorted lists. Only the code.",
    "Write a Python function `word_count(text)` returning a dict of word frequencies. Only the code.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods. Only the code.",
    "Write a Python function `binary_search(items, target)` returning the index or -1. Only the code.",
    "Write a Python function `flatten(nested)` that flattens nested lists. Only the code.",
    "Write a Python function `parse_csv_line(line)` that splits a CSV line with quotes. Only the code.",
]


def prompts(tokenizer: Any, batch_size: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": TASKS[i % len(TASKS)]}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            for i in range(batch_size)]


def make_engine(model: str, draft: str | None, num_tokens: int, threads: int | None,
                dtype: str) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(max_total_tokens=4096, disable_radix_cache=True),
        scheduler=SchedulerConfig(max_prefill_tokens=4096, chunked_prefill_size=4096),
        runtime=RuntimeConfig(num_threads=threads),
        speculative=SpeculativeConfig(speculative_draft_model_path=draft,
                                      num_speculative_tokens=num_tokens),
    )
    return LLMEngine(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--num-speculative-tokens", default="4",
                        help="comma-separated k values, each its own engine")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="thread: the engine thread's CPU time (use with --num-threads 1)")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    load_before = os.getloadavg()[0]
    # One engine per k; its "plain" runs switch the proposer off (one 1.5B copy in memory less:
    # the machine is shared). The model, pool and step code are the same either way.
    engines = {k: make_engine(args.model, args.draft_model, k, args.num_threads, args.dtype)
               for k in ks}
    first = engines[ks[0]]
    proposer = first.speculation.proposer
    tokenizer = first.tokenizer
    warm = prompts(tokenizer, 1)
    for engine in engines.values():
        run(engine, warm, 8)
    runs = [("plain", first, None)] + [(f"draft k={k}", engine, engine.speculation.proposer)
                                         for k, engine in engines.items()]
    rows = []
    for batch_size in batch_sizes:
        token_lists = prompts(tokenizer, batch_size)
        plain_speed = 0.0
        plain_outputs: list[list[int]] = []
        for name, engine, engine_proposer in runs:
            engine.speculation.proposer = engine_proposer
            before = engine.stats()
            elapsed_s, outputs = run(engine, token_lists, args.max_tokens, CLOCKS[args.clock])
            after = engine.stats()
            num_tokens = sum(len(o) for o in outputs)
            speed = num_tokens / elapsed_s

            def delta(key: str) -> int:
                return int(after.get(key, 0) - before.get(key, 0))

            drafted, accepted = delta("spec_num_draft_tokens"), delta("spec_num_accepted_tokens")
            passes = delta("spec_num_verify_passes")
            if name == "plain":
                plain_speed, plain_outputs = speed, outputs
                rows.append((batch_size, name, num_tokens, speed, 1.0, None, None, None))
            else:
                rows.append((batch_size, name, num_tokens, speed, speed / plain_speed,
                             (accepted + passes) / max(1, passes), accepted / max(1, drafted),
                             sum(o == p for o, p in zip(outputs, plain_outputs))))
            print(f"B={batch_size} {name}: {speed:.2f} tok/s", flush=True)
    first.speculation.proposer = proposer
    load_after = os.getloadavg()[0]
    plain = first
    print(f"\n`benchmarks/spec_draft.py --batch-sizes {args.batch_sizes} --max-tokens "
          f"{args.max_tokens} --num-speculative-tokens {args.num_speculative_tokens} --dtype "
          f"{args.dtype}`: {args.model} drafted by {args.draft_model} "
          f"({plain.model_info.get('dtype', args.dtype)}), {platform.machine()} ({_cpu_name()}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average before "
          f"{load_before:.2f}, after {load_after:.2f}\n")
    print("| batch | engine | output tokens | tok/s | speed-up | accept length | acceptance rate "
          "| outputs equal to plain |")
    print("|---|---|---|---|---|---|---|---|")
    for b, name, n, speed, ratio, length, rate, same in rows:
        extra = ("| - | - | - |" if length is None else
                 f"| {length:.2f} | {100 * rate:.0f}% | {same}/{b} |")
        print(f"| {b} | {name} | {n} | {speed:.2f} | {ratio:.2f}x {extra}")


if __name__ == "__main__":
    main()
