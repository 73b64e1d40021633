"""Beam search vs greedy on one prompt, through LLMEngine in-process, in one run.

Greedy decodes ``--max-tokens`` tokens (ignore_eos); beam search of width W decodes the same
number of steps with W beams (ignore_eos, so every beam runs to max_tokens). The table gives the
wall time, the decode steps, the tokens computed (W per step for the beams) and the time per step;
the ratio column is beam time / greedy time. Repeats alternate greedy and beams; the best of each
is kept (the machine may be shared).

    .venv/bin/python benchmarks/beam_search.py                      # smollm2-135m, width 4
    .venv/bin/python benchmarks/beam_search.py --model qwen2.5-coder-0.5b --widths 2 4 8
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import BeamParams, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(engine: LLMEngine, prompt: list[int], width: int, max_tokens: int, tag: str) -> tuple[float, int]:
    """(wall seconds, engine steps) for one request: greedy when width is 1, else one search."""
    steps = engine.num_steps
    start = time.perf_counter()
    if width == 1:
        engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True))
    else:
        for rank in range(width):
            beam = BeamParams(width=width, num_returns=width, rank=rank)
            engine.add_request(f"{tag}-{rank}", prompt, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, beam=beam), group=tag)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, engine.num_steps - steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--widths", type=int, nargs="+", default=[4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                    cache=CacheConfig(max_total_tokens=8192, disable_radix_cache=True),
                                    runtime=RuntimeConfig(num_threads=args.num_threads)))
    prompt = engine.tokenizer.encode(PROMPT)
    run(engine, prompt, 1, 8, "warm")
    best: dict[int, tuple[float, int]] = {}
    for repeat in range(args.repeats):
        for width in [1, *args.widths]:
            seconds, steps = run(engine, prompt, width, args.max_tokens, f"w{width}r{repeat}")
            if width not in best or seconds < best[width][0]:
                best[width] = (seconds, steps)
    print(f"{args.model} {args.dtype}, prompt {len(prompt)} tokens, {args.max_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    print("| decoding | wall s | steps | tokens computed | ms / step | time vs greedy |")
    print("|---|---|---|---|---|---|")
    greedy_s = best[1][0]
    for width, (seconds, steps) in best.items():
        name = "greedy" if width == 1 else f"beam width {width}"
        print(f"| {name} | {seconds:.2f} | {steps} | {width * args.max_tokens} | "
              f"{1000 * seconds / steps:.1f} | {seconds / greedy_s:.2f}x |")
    print(engine.stats()["num_beam_block_copies"], "partial blocks copied on write,",
          engine.stats()["num_beam_forks"], "forks")
    engine.shutdown()


if __name__ == "__main__":
    main()
