"""Single-stream decode tok/s of several ``--quantization`` modes, measured round-robin.

On a shared machine the load changes during a run; timing every mode once per round, for several
rounds, and taking each mode's median exposes all modes to the same load. Prefill is excluded:
``(n - 1) / (t(n) - t(1))`` for a 16-token prompt and ``n = --output-len`` greedy tokens.

    .venv/bin/python benchmarks/decode_interleaved.py --modes none,w8a8_int8,int8wo,int4wo-128 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402


def run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--modes", default="none,w8a8_int8,int8wo,int4wo-128")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=33)
    args = parser.parse_args()
    engines = {mode: LLMEngine(EngineConfig.from_flat({
        "model": args.model, "quantization": mode, "max_total_tokens": 1024, "disable_radix_cache": True,
        "num_threads": args.threads})) for mode in args.modes.split(",")}
    prompt = list(range(1000, 1016))
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    load_before = os.getloadavg()
    for engine in engines.values():
        run(engine, prompt, 4)   # warm up
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            rates[mode].append((args.output_len - 1) / (run(engine, prompt, args.output_len) - run(engine, prompt, 1)))
            print(mode, f"{rates[mode][-1]:.1f}", file=sys.stderr, flush=True)
    print(f"threads {args.threads or 'default'}; load average before {load_before[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f}")
    print("| mode | 1-stream decode tok/s, median | rounds |")
    print("|---|---|---|")
    for mode, values in rates.items():
        print(f"| {mode} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
