"""What --enable-deterministic-inference costs on the default model: one request's prefill and
decode, and four concurrent requests, with and without the mode (in-process engine, greedy).

    python benchmarks/deterministic_cost.py [--model qwen2.5-coder-0.5b] [--prompt-tokens 128]
"""

from __future__ import annotations

import argparse
import random
import time

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(seconds to every request's first token, seconds to the end)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        assert engine.add_request(f"r{index}-{start}", prompt, params) is None
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - start
    return max(first.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_tokens)] for _ in range(4)]
    for deterministic in (False, True):
        engine = LLMEngine(EngineConfig.from_flat({
            "model": args.model, "disable_radix_cache": True,
            "enable_deterministic_inference": deterministic}))
        try:
            timed(engine, prompts[:1], 2)  # warm-up
            ttft, total = timed(engine, prompts[:1], args.max_tokens)
            ttft4, total4 = timed(engine, prompts, args.max_tokens)
        finally:
            engine.shutdown()
        decode_s = (total - ttft) / max(1, args.max_tokens - 1)
        print(f"deterministic={deterministic}: 1 request: prefill {ttft:.2f} s "
              f"({args.prompt_tokens} tokens), decode {1000 * decode_s:.1f} ms/token; "
              f"4 requests: all first tokens {ttft4:.2f} s, all done {total4:.2f} s")


if __name__ == "__main__":
    main()
