"""Per-token overhead of constrained decoding: decode tokens/s with and without a JSON schema.

Runs an in-process LLMEngine (no HTTP, no process hop) at batch 1 and batch 16. Every request
generates exactly ``--tokens`` tokens (checked): ``ignore_eos`` for free text, and for the grammar
a JSON array of records whose ``minItems`` makes it longer than ``--tokens``, so the grammar cannot
terminate first. (An array that may close early is the trap: a model that answers ``[]`` ends its
request after three tokens, the batch shrinks while the step count stays that of the longest
request, and tokens/s drops for reasons that have nothing to do with the grammar's cost.)
Jump-forward is off, so both runs do the same model steps; the difference is the cost of filling
and applying the bitmasks and advancing the matchers. "grammar work/step" times exactly that code,
which is the robust number on a loaded machine. Free and JSON runs alternate, so a change in the
machine's load hits both; the load average is printed with the results.

    .venv/bin/python benchmarks/structured_overhead.py --model smollm2-135m --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from servelm.config import (CacheConfig, EngineConfig, ModelConfig, RuntimeConfig,
                            StructuredOutputConfig)
from servelm.constrained.compiler import GrammarCompiler
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams, StructuredSpec


def schema(num_tokens: int) -> dict[str, object]:
    """Records of at least 8 tokens each, and at least ``num_tokens`` of them: never done early."""
    return {"type": "array", "minItems": num_tokens, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}}


class GrammarTimer:
    """Wall time spent in the grammar work itself: bitmask fill + apply, and matcher advances."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self.steps = 0
        for owner, name in ((engine.executor, "_apply_grammars"), (engine.scheduler, "_grammar_ends")):
            setattr(owner, name, self._timed(getattr(owner, name), count=name == "_apply_grammars"))

    def _timed(self, method, count: bool):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += count
        return wrapper


def run(engine: LLMEngine, batch: int, tokens: int, structured: StructuredSpec | None) -> tuple[float, int]:
    prompt = engine.tokenizer.encode("List some records as JSON:")
    for i in range(batch):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                                structured=structured)
        assert engine.add_request(f"b{batch}-{i}-{structured is not None}-{time.time()}", prompt, params) is None
    # Prefill first, so the timing below is decode only.
    engine.step()
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for output in engine.step():
            generated += len(output.new_token_ids)
            assert output.error is None, output.error
    elapsed = time.perf_counter() - start
    assert generated == batch * (tokens - 1), f"{generated} tokens, expected {batch * (tokens - 1)}"
    return elapsed, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads (1 is far steadier on a shared, loaded machine)")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model),
                                    cache=CacheConfig(max_total_tokens=32768),
                                    runtime=RuntimeConfig(num_threads=args.num_threads),
                                    structured=StructuredOutputConfig(disable_jump_forward=True)))
    spec = StructuredSpec("json", json.dumps(schema(args.tokens)))
    assert engine._grammars is not None
    job = engine._grammars.submit(spec.kind, spec.spec)  # compile outside the timing
    job.done.wait()
    timer = GrammarTimer(engine)
    run(engine, 1, 8, None)  # warm up
    print(f"model {args.model}, {args.tokens} tokens per request, best of {args.repeats}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'step time difference':>22} "
          f"{'grammar work/step':>18}")
    for batch in args.batches:
        best: dict[str, float] = {}  # label -> seconds per decode step
        timer.seconds, timer.steps = 0.0, 0
        for _ in range(args.repeats):
            for label, structured in (("free", None), ("json", spec)):
                seconds, generated = run(engine, batch, args.tokens, structured)
                best[label] = min(best.get(label, float("inf")), seconds / (generated / batch))
        rates = {label: batch / step_s for label, step_s in best.items()}
        per_token = best
        overhead_ms = (per_token["json"] - per_token["free"]) * 1000
        grammar_ms = timer.seconds / max(timer.steps, 1) * 1000
        print(f"{batch:>5} {rates['free']:>11.1f} {rates['json']:>11.1f} "
              f"{overhead_ms:>+9.2f} ms ({(rates['free'] / rates['json'] - 1) * 100:+.1f}%) "
              f"{grammar_ms:>12.3f} ms")
    cache = engine._grammars
    assert isinstance(cache, GrammarCompiler)
    print(f"grammar cache: {cache.num_misses} compiles, {cache.num_hits} hits; "
          f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
