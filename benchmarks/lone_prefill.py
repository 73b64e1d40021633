"""A lone long prompt in one step or in chunks, in-process and A/B within one run: the same
engine computes new prompts (``--input-len`` tokens, 1 output token) alternately under the default
``--chunked-prefill-size`` (a lone prompt is not chunked: SchedulerConfig.is_lone_prompt_chunked) and
under ``--chunk`` (a chosen size, applied always: 511 is the old behaviour's 512 to a token), each
round in the other order. Prints the wall and main-thread CPU medians per arm (with ``--threads 1``
the main thread's CPU is the whole step's, and moves little with other processes' load).

    .venv/bin/python benchmarks/lone_prefill.py --threads 1 --rounds 8
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_peers as cp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=cp.PREFILL_TOKENS)
    parser.add_argument("--chunk", type=int, default=511)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    engine = LLMEngine(EngineConfig.from_flat({"model": args.model, "num_threads": args.threads,
                                               "max_total_tokens": 4 * args.input_len}))
    default = engine.scheduler.config
    arms = {"default (lone: one step)": default,
            f"--chunked-prefill-size {args.chunk}": dataclasses.replace(default, chunked_prefill_size=args.chunk)}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = iter(cp._prompts(2 * args.rounds + 2, args.input_len, 11))
    wall: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    steps: dict[str, int] = {}
    for name, config in arms.items():   # warm both shapes
        engine.scheduler.config = config
        engine.add_request(f"warm {name}", next(prompts), params)
        while engine.has_unfinished():
            engine.step()
    for index in range(args.rounds):
        order = list(arms.items()) if index % 2 == 0 else list(arms.items())[::-1]
        for name, config in order:
            engine.scheduler.config = config   # the scheduler reads its config per step
            engine.add_request(f"{name} {index}", next(prompts), params)
            start_s, start_cpu_s, count = time.perf_counter(), time.thread_time(), 0
            while engine.has_unfinished():
                engine.step()
                count += 1
            wall[name].append(time.perf_counter() - start_s)
            cpu[name].append(time.thread_time() - start_cpu_s)
            steps[name] = count
    for name in arms:
        print(f"{name}: {steps[name]} steps, wall median {statistics.median(wall[name]) * 1e3:.1f} ms "
              f"(min {min(wall[name]) * 1e3:.1f}), main-thread CPU median {statistics.median(cpu[name]) * 1e3:.1f} ms")
    first, second = arms
    print(f"ratio {first} / {second}: wall {statistics.median(wall[first]) / statistics.median(wall[second]):.3f}, "
          f"CPU {statistics.median(cpu[first]) / statistics.median(cpu[second]):.3f} (noisy, shared machine)")


if __name__ == "__main__":
    main()
