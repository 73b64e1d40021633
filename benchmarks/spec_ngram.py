"""N-gram speculative decoding on an "edit this file" workload: decode speed with and without
speculation, in one run, through LLMEngine in-process (greedy; outputs checked identical).

Each request asks the chat model to return a Python file with one identifier renamed, so the
answer copies most of the prompt: the n-gram proposer's case. (Qwen2.5-Coder-0.5B answers this
phrasing with a sentence, the renamed file and often a method of its own; asked "Rename X to Y
everywhere", it returned the file unchanged, a pure copy.) The table's last column says how many
answers contain the new name. Plain decoding and one n-gram engine per ``--lengths`` policy
(``--ngram-draft-length``: adaptive, fixed) run in one process. Batch size B runs B such requests
(a different identifier each) at once; the table gives output tokens per second over the whole
generation (prefill included: it is ~10% of the time), the speed-up, and the accept length
(tokens emitted per verify pass of one request) and acceptance rate.

    .venv/bin/python benchmarks/spec_ngram.py                          # qwen2.5-coder-0.5b, B=1,2,4,8
    .venv/bin/python benchmarks/spec_ngram.py --batch-sizes 1 --num-threads 1 --prompt copy
    .venv/bin/python benchmarks/spec_ngram.py --lengths fixed --num-speculative-tokens 8
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import torch

from servelm.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, RuntimeConfig,
                            SchedulerConfig, SpeculativeConfig)
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

SOURCE = '''import json
from dataclasses import dataclass, field


@dataclass
class Inventory:
    """Items in stock, by name."""

    items: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, count: int) -> None:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name: str, count: int) -> bool:
        available = self.items.get(name, 0)
        if count > available:
            return False
        self.items[name] = available - count
        if self.items[name] == 0:
            del self.items[name]
        return True

    def total(self) -> int:
        return sum(self.items.values())

    def save(self, path: str) -> None:
        with open(path, "w") as handle:
            json.dump(self.items, handle, indent=2, sort_keys=True)
'''
RENAMES = [("count", "quantity"), ("items", "stock"), ("name", "label"), ("available", "on_hand"),
           ("handle", "stream"), ("total", "size"), ("path", "filename"), ("add", "put")]


PROMPTS = {
    "refactor": "Refactor: `{old}` must be called `{new}`. Show the full refactored code.",
    "copy": "Rename `{old}` to `{new}` everywhere in this file. Reply with the whole new file.",
}
"""``--prompt``: refactor (the model writes a sentence, the renamed file and often code of its own:
~60% of the output copied) or copy (the 0.5B model returns the file unchanged: a pure copy)."""


def prompts(tokenizer: Any, batch_size: int, prompt: str = "refactor") -> list[list[int]]:
    result = []
    for index in range(batch_size):
        old, new = RENAMES[index % len(RENAMES)]
        messages = [{"role": "user", "content": (
            PROMPTS[prompt].format(old=old, new=new) + f"\n\n```python\n{SOURCE}```")}]
        result.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    return result


def make_engine(model: str, algorithm: str | None, num_tokens: int | None, threads: int | None,
                dtype: str = "auto", length: str = "adaptive") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(max_total_tokens=16384, disable_radix_cache=True),
        scheduler=SchedulerConfig(max_prefill_tokens=4096, chunked_prefill_size=4096),
        runtime=RuntimeConfig(num_threads=threads),
        speculative=SpeculativeConfig(speculative_algorithm=algorithm,
                                      num_speculative_tokens=num_tokens,
                                      ngram_draft_length=length),
    )
    return LLMEngine(config)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
"""``--clock``: wall time, or the calling thread's CPU time (with --num-threads 1 the work itself,
unmoved by other processes on a shared machine)."""


def run(engine: LLMEngine, token_lists: list[list[int]], max_tokens: int,
        clock: Any = time.perf_counter) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for index, tokens in enumerate(token_lists):
        assert engine.add_request(f"{time.monotonic_ns()}-{index}", tokens, params) is None
    order = []
    outputs: dict[str, list[int]] = {}
    start_s = clock()
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id not in outputs:
                order.append(output.request_id)
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    elapsed_s = clock() - start_s
    return elapsed_s, [outputs[r] for r in sorted(outputs, key=lambda r: int(r.split("-")[1]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="most drafts per step (unset: each length policy's default, "
                        "adaptive 24, fixed 5)")
    parser.add_argument("--lengths", default="adaptive,fixed",
                        help="n-gram engines to run beside plain decoding (--ngram-draft-length)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompt", choices=sorted(PROMPTS), default="refactor")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="thread: the engine thread's CPU time (use with --num-threads 1)")
    parser.add_argument("--dtype", default="auto",
                        help="auto is bfloat16 on CPUs with AVX512-BF16/AMX: there greedy tokens "
                        "depend on the step's shape (as with batching); float32 makes them exact")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    lengths = args.lengths.split(",")
    load_before = os.getloadavg()[0]
    engines = {"plain": make_engine(args.model, None, None, args.num_threads, args.dtype)}
    for length in lengths:
        engines[length] = make_engine(args.model, "NGRAM", args.num_speculative_tokens,
                                      args.num_threads, args.dtype, length)
    tokenizer = engines["plain"].tokenizer
    warm = prompts(tokenizer, 1, args.prompt)
    for engine in engines.values():
        run(engine, warm, 8)
    rows = []
    for batch_size in batch_sizes:
        token_lists = prompts(tokenizer, batch_size, args.prompt)
        results: dict[str, Any] = {}
        for name, engine in engines.items():
            before = engine.stats()
            elapsed_s, outputs = run(engine, token_lists, args.max_tokens, CLOCKS[args.clock])
            after = engine.stats()

            def delta(key: str) -> int:
                return after.get(key, 0) - before.get(key, 0)  # noqa: B023

            results[name] = (sum(len(o) for o in outputs) / elapsed_s, outputs,
                             sum(len(o) for o in outputs), delta("spec_num_draft_tokens"),
                             delta("spec_num_accepted_tokens"), delta("spec_num_verify_passes"))
        plain_speed, plain_outputs, num_tokens = results["plain"][:3]
        for length in lengths:
            speed, outputs, _, drafted, accepted, passes = results[length]
            renamed = sum(RENAMES[i % len(RENAMES)][1] in tokenizer.decode(o)
                          for i, o in enumerate(outputs))
            rows.append((batch_size, length, engines[length].config.speculative.max_draft_tokens,
                         num_tokens, plain_speed, speed, speed / plain_speed,
                         (accepted + passes) / max(1, passes), accepted / max(1, drafted),
                         drafted / max(1, passes), outputs == plain_outputs, renamed))
        print(f"B={batch_size}: plain {plain_speed:.1f} tok/s, "
              + ", ".join(f"{length} {results[length][0]:.1f}" for length in lengths), flush=True)
    load_after = os.getloadavg()[0]
    print(f"\n`benchmarks/spec_ngram.py --prompt {args.prompt} --batch-sizes {args.batch_sizes} "
          f"--max-tokens {args.max_tokens} --num-speculative-tokens {args.num_speculative_tokens} "
          f"--lengths {args.lengths} --dtype {args.dtype} --clock {args.clock}` on "
          f"{args.model} ({engines['plain'].model_info.get('dtype', args.dtype)}), "
          f"{platform.machine()} ({_cpu_name()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average before {load_before:.2f}, "
          f"after {load_after:.2f}\n")
    print("| batch | draft length (max) | output tokens | plain tok/s | n-gram tok/s | speed-up | "
          "accept length | acceptance rate | drafts per pass | identical outputs | answers with the rename |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, length, k, n, plain, spec, ratio, accept, rate, drafts, same, renamed in rows:
        print(f"| {b} | {length} ({k}) | {n} | {plain:.1f} | {spec:.1f} | {ratio:.2f}x | {accept:.2f} | "
              f"{100 * rate:.0f}% | {drafts:.1f} | {'yes' if same else 'NO'} | {renamed}/{b} |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
