"""Per-token overhead of constrained decoding: decode tokens/s with and without a JSON schema.

Runs an in-process LLMEngine (no HTTP, no process hop) at batch 1 and batch 16. Every request
generates exactly ``--tokens`` tokens: ``ignore_eos`` for free text, and for the grammar a JSON
array of small integers with no upper bound on its length, so it never terminates before
max_tokens. Jump-forward is off, so both runs do the same model steps; the difference is the cost
of filling and applying the bitmasks and advancing the matchers. "grammar work/step" times exactly
that code, which is the robust number on a loaded machine.

    .venv/bin/python benchmarks/structured_overhead.py --model smollm2-135m --tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

from servelm.config import CacheConfig, EngineConfig, ModelConfig, StructuredOutputConfig
from servelm.constrained.grammar import GrammarCache
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams, StructuredSpec

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
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
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model),
                                    cache=CacheConfig(max_total_tokens=32768),
                                    structured=StructuredOutputConfig(disable_jump_forward=True)))
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    engine._grammar_cache().matcher(spec.kind, spec.spec)  # compile outside the timing
    timer = GrammarTimer(engine)
    run(engine, 1, 8, None)  # warm up
    print(f"model {args.model}, {args.tokens} decode tokens per request, best of {args.repeats}")
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'step time difference':>22} "
          f"{'grammar work/step':>18}")
    for batch in args.batches:
        rates = {}
        per_token = {}
        for label, structured in (("free", None), ("json", spec)):
            best = None
            timer.seconds, timer.steps = 0.0, 0
            for _ in range(args.repeats):
                seconds, generated = run(engine, batch, args.tokens, structured)
                if best is None or seconds / generated < best[0] / best[1]:
                    best = (seconds, generated)
            assert best is not None
            rates[label] = best[1] / best[0]
            per_token[label] = best[0] / (best[1] / batch)  # seconds per decode step
        overhead_ms = (per_token["json"] - per_token["free"]) * 1000
        grammar_ms = timer.seconds / max(timer.steps, 1) * 1000
        print(f"{batch:>5} {rates['free']:>11.1f} {rates['json']:>11.1f} "
              f"{overhead_ms:>+9.2f} ms ({(rates['free'] / rates['json'] - 1) * 100:+.1f}%) "
              f"{grammar_ms:>12.3f} ms")
    cache = engine._grammars
    assert isinstance(cache, GrammarCache)
    print(f"grammar cache: {cache.num_misses} compiles, {cache.num_hits} hits")


if __name__ == "__main__":
    main()
