"""Hierarchical cache benchmark (issue 18), in-process through LLMEngine, two parts:

1. Working set larger than the KV pool: G groups share G system prompts of S tokens; the
   groups come in turn (each group's R requests at once), for several rounds, with a pool that
   holds about a quarter of the prompts. Tiers off (the pool's LRU drops every prompt before
   it comes back), on with an exact host tier, and on with the int8 host tier: prefix hit rate,
   output throughput, and whether the greedy tokens equal the tiers-off run.
2. Restart: a server computes a long system prompt with the file storage tier, shuts down; a new
   engine on the same directory answers its first request (wait_complete) vs a cold engine:
   time to first token and identical tokens.

    .venv/bin/python benchmarks/hicache_bench.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared_prefix import run, workload  # noqa: E402

from servelm.config import CacheConfig, EngineConfig, HiCacheConfig, ModelConfig, RuntimeConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402


def make(args: argparse.Namespace, pool: int, **hicache: object) -> LLMEngine:
    tiers = HiCacheConfig(enable_hierarchical_cache=True, **hicache) if hicache else HiCacheConfig()  # type: ignore[arg-type]
    return LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                  cache=CacheConfig(max_total_tokens=pool), hicache=tiers,
                                  runtime=RuntimeConfig(num_threads=args.threads)))


def working_set(args: argparse.Namespace) -> dict[str, object]:
    per_request = args.system_tokens + args.question_tokens + args.output_tokens
    pool = args.pool_tokens or max(per_request * args.per_group + 64,
                                   args.groups * args.system_tokens // 4)
    results: dict[str, dict[str, object]] = {}
    reference = None
    for name, hicache in (("tiers_off", {}),
                          ("tiers_on_exact_host", {"hicache_host_dtype": "auto", "hicache_ratio": 8.0}),
                          ("tiers_on_int8_host", {"hicache_host_dtype": "int8", "hicache_ratio": 8.0})):
        engine = make(args, pool, **hicache)
        prompts = workload(engine.runner.vocab_size, args.groups, args.per_group,
                           args.system_tokens, args.question_tokens)
        prompts.sort(key=lambda p: p[:8])  # grouped: one group's requests come together
        run(engine, [prompts[0][:32]], 2)  # warm up
        engine.flush_cache()
        waves = [prompts[g * args.per_group:(g + 1) * args.per_group] for g in range(args.groups)]
        outputs: list[list[int]] = []
        start_s = time.perf_counter()
        for _ in range(args.rounds):
            for wave in waves:
                outputs += run(engine, wave, args.output_tokens)["outputs"]  # type: ignore[operator]
        elapsed_s = time.perf_counter() - start_s
        stats = engine.stats()
        if reference is None:
            reference = outputs
        same = sum(a == b for x, y in zip(outputs, reference) for a, b in zip(x, y))
        results[name] = {
            "elapsed_s": round(elapsed_s, 2),
            "output_throughput_tok_s": round(sum(map(len, outputs)) / elapsed_s, 2),
            "cache_hit_rate": stats["cache_hit_rate"],
            "host_hit_tokens": stats.get("hicache_host_hit_tokens", 0),
            "host_bytes_moved": stats.get("hicache_host_write_bytes", 0) + stats.get("hicache_host_read_bytes", 0),
            "tokens_equal_to_tiers_off": f"{same}/{sum(map(len, reference))}",
        }
        engine.shutdown()
    return {"kv_pool_tokens": pool, "working_set_tokens": args.groups * args.system_tokens,
            "rounds": args.rounds, **results}


def restart(args: argparse.Namespace) -> dict[str, object]:
    directory = Path(tempfile.mkdtemp(prefix="servelm-hicache-bench-"))
    storage = {"hicache_host_dtype": "auto", "hicache_storage_backend": "file",
               "hicache_storage_prefetch_policy": "wait_complete",
               "hicache_storage_backend_extra_config": json.dumps({"file_path": str(directory)})}
    pool = 4 * (args.restart_system_tokens + 64)
    prompt_engine = make(args, pool)
    prompt = workload(prompt_engine.runner.vocab_size, 1, 1, args.restart_system_tokens, 16)[0]
    prompt_engine.shutdown()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)

    def first_request(engine: LLMEngine) -> tuple[float, list[int]]:
        start_s = time.perf_counter()
        engine.add_request("first", prompt, params)
        ttft_s, tokens = None, []
        while engine.has_unfinished():
            for output in engine.step():
                if output.new_token_ids and ttft_s is None:
                    ttft_s = time.perf_counter() - start_s
                tokens += output.new_token_ids
        assert ttft_s is not None
        return ttft_s, tokens

    writer = make(args, pool, **storage)
    first_request(writer)  # computes the prompt, writes its blocks (write_through)
    writer.shutdown()
    result: dict[str, object] = {"system_tokens": args.restart_system_tokens}
    for name, options in (("cold", {}), ("warm_disk", storage)):
        engine = make(args, pool, **options)
        run(engine, [[7, 8, 9] * 11], 2)  # warm up kernels on an unrelated prompt
        ttft_s, tokens = first_request(engine)
        result[name] = {"ttft_s": round(ttft_s, 3),
                        "storage_hit_tokens": engine.stats().get("hicache_storage_hit_tokens", 0)}
        result[f"{name}_tokens"] = tokens
        engine.shutdown()
    assert result.pop("cold_tokens") == result.pop("warm_disk_tokens"), "tokens differ after restart"
    cold, warm = result["cold"], result["warm_disk"]
    result["ttft_ratio_cold_vs_warm"] = round(cold["ttft_s"] / warm["ttft_s"], 2)  # type: ignore[index]
    shutil.rmtree(directory, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--pool-tokens", type=int, default=None)
    parser.add_argument("--restart-system-tokens", type=int, default=2048)
    parser.add_argument("--skip", choices=["working-set", "restart"], default=None)
    args = parser.parse_args()
    summary: dict[str, object] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    if args.skip != "working-set":
        summary["working_set"] = working_set(args)
    if args.skip != "restart":
        summary["restart"] = restart(args)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
