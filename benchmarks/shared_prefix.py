"""Shared-prefix workload (like SGLang's generated-shared-prefix): throughput and mean TTFT with the
prefix cache on and off, in one run, through LLMEngine in-process.

G groups x R requests; each group shares a system prompt of S random tokens, each request adds a
question of Q tokens and generates O tokens (greedy, ignore_eos). All requests arrive at once.

    .venv/bin/python benchmarks/shared_prefix.py                       # 8x8, 1024/64/64, qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/shared_prefix.py --model smollm2-135m --groups 4 --per-group 4 \\
        --system-tokens 512
"""

from __future__ import annotations

import argparse
import json
import random
import time

from servelm.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def workload(vocab_size: int, groups: int, per_group: int, system_tokens: int,
             question_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(100, vocab_size - 100) for _ in range(system_tokens)]
        for _ in range(per_group):
            prompts.append(system + [rng.randrange(100, vocab_size - 100) for _ in range(question_tokens)])
    rng.shuffle(prompts)  # interleave the groups, as concurrent clients would
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    start_s = time.perf_counter()
    first_token_s: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        assert engine.add_request(f"q{index}", prompt, params) is None
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids and output.request_id not in first_token_s:
                first_token_s[output.request_id] = time.perf_counter() - start_s
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    elapsed_s = time.perf_counter() - start_s
    num_output = sum(len(tokens) for tokens in outputs.values())
    stats = engine.stats()
    return {
        "elapsed_s": round(elapsed_s, 2),
        "output_throughput_tok_s": round(num_output / elapsed_s, 2),
        "request_throughput_req_s": round(len(prompts) / elapsed_s, 3),
        "mean_ttft_s": round(sum(first_token_s.values()) / len(first_token_s), 3),
        "cache_hit_rate": stats["cache_hit_rate"],
        "num_preemptions": stats["num_preemptions"],
        "outputs": [outputs[f"q{i}"] for i in range(len(prompts))],  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size; default: enough for every request at once")
    args = parser.parse_args()

    per_request = args.system_tokens + args.question_tokens + args.output_tokens
    num_requests = args.groups * args.per_group
    pool = args.max_total_tokens or per_request * num_requests + 1024
    results = {}
    for cache in (True, False):
        config = EngineConfig(
            model=ModelConfig(model=args.model),
            cache=CacheConfig(max_total_tokens=pool, disable_radix_cache=not cache),
            scheduler=SchedulerConfig(max_running_requests=num_requests))
        engine = LLMEngine(config)
        prompts = workload(engine.runner.vocab_size, args.groups, args.per_group,
                           args.system_tokens, args.question_tokens)
        run(engine, prompts[:1], 2)  # warm up (kernels, allocator); then start from a cold cache
        engine.flush_cache()
        results["cache_on" if cache else "cache_off"] = run(engine, prompts, args.output_tokens)
        del engine
    on, off = results["cache_on"], results["cache_off"]
    assert on.pop("outputs") == off.pop("outputs"), "greedy outputs differ with the cache on and off"
    summary = {
        "model": args.model, "groups": args.groups, "per_group": args.per_group,
        "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
        "output_tokens": args.output_tokens, "kv_pool_tokens": pool, **results,
        "throughput_ratio_on_vs_off": round(on["output_throughput_tok_s"] / off["output_throughput_tok_s"], 2),
        "ttft_ratio_off_vs_on": round(off["mean_ttft_s"] / on["mean_ttft_s"], 2),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
