"""Single-stream decode tok/s for several ``--num-threads`` values, in one run (README, Threads).

Each thread count gets its own LLMEngine (the setting is applied when the runner is built) and the
same random prompt; decode tok/s is ``(output_len - 1) / (t(output_len) - t(1))``. Run it once on
a quiet machine and once with the other cores busy (e.g. ``taskset -c 1 yes > /dev/null &``) to
see which thread count to choose when the engine does not own the machine.

    .venv/bin/python benchmarks/threads_decode.py [--model gemma3-270m] [--threads 1,2] [--quantization w8a8_int8]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_vs_transformers import servelm_run  # noqa: E402

from servelm.bench_common import random_prompts  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--quantization", default="w8a8_int8")
    parser.add_argument("--threads", default="1,2", help="comma-separated --num-threads values")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per thread count (best kept)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    engines = {threads: LLMEngine(EngineConfig.from_flat({
        "model": args.model, "quantization": args.quantization, "num_threads": threads,
        "max_total_tokens": 4096})) for threads in map(int, args.threads.split(","))}
    vocab_size = min(50000, next(iter(engines.values())).runner.vocab_size)
    best: dict[int, list[float]] = {threads: [] for threads in engines}
    for repeat in range(args.repeats):           # interleaved, so load changes hit every setting
        for threads, engine in engines.items():
            torch.set_num_threads(threads)       # the engines share this process's thread pool
            seed = 2 * (repeat * len(engines) + threads)   # fresh prompts: no prefix-cache hit
            first = servelm_run(engine, random_prompts(1, args.input_len, vocab_size, seed), 1,
                                f"t{threads}-{repeat}-a")
            full = servelm_run(engine, random_prompts(1, args.input_len, vocab_size, seed + 1),
                               args.output_len, f"t{threads}-{repeat}-b")
            best[threads].append((args.output_len - 1) / (full - first))
    load_after = os.getloadavg()[0]
    print(f"{args.model} {args.quantization}, load {load_before:.2f} -> {load_after:.2f}")
    for threads, values in best.items():
        print(f"  --num-threads {threads}: decode {max(values):.1f} tok/s best, "
              f"{sorted(values)[len(values) // 2]:.1f} median of {len(values)}")


if __name__ == "__main__":
    main()
