"""What the observability options cost: the server-side wrapper per request (metrics, tracing,
custom labels), and --enable-nan-detection's check per step.

    python benchmarks/observability_overhead.py [--requests 2000] [--tokens 32]

The wrapper is timed on a stand-in engine that yields ``--tokens`` one-token outputs with no work
of its own, so the figures are the wrapper's own time per request (and per token). Spans go to the
SDK's in-memory exporter (no network): the cost is building and batching them. The NaN check is
a NaN test of each row's sum over a step's float32 logits at the default model's vocabulary
(the exact per-entry test runs only when a sum is NaN), beside the per-entry test.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from servelm.config import EngineConfig, ModelConfig, ObservabilityConfig
from servelm.engine.outputs import RequestOutput
from servelm.sampling.params import SamplingParams
from servelm.server.observe import ObservedEngine, ServerMetrics

VOCAB = 151_936  # Qwen2.5's


class NullEngine:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *args: Any) -> AsyncIterator[RequestOutput]:
        now = time.time()
        for index in range(self.num_tokens):
            last = index == self.num_tokens - 1
            yield RequestOutput(request_id, [index], "x", finish_reason="length" if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=index + 1,
                                timings={"arrival": now, "scheduled": now, "first_token": now,
                                         "finished": now, "detokenize_s": 0.0} if last else None)


def wrapper_us(observability: ObservabilityConfig, requests: int, tokens: int, tracing: bool) -> float:
    config = EngineConfig(model=ModelConfig(model="/models/x", served_model_name=["x"]),
                          observability=observability)
    metrics = ServerMetrics(config) if observability.enable_metrics else None
    tracer = None
    if tracing:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from servelm.server.tracing import RequestTracer
        tracer = RequestTracer(config, exporter=InMemorySpanExporter())
    engine = ObservedEngine(NullEngine(tokens), config, metrics, tracer)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=tokens)
    bare = ObservedEngine(NullEngine(tokens), EngineConfig(), None)  # type: ignore[arg-type]

    async def run(observed: ObservedEngine) -> float:
        start = time.perf_counter()
        for index in range(requests):
            async for _ in observed.generate(f"r{index}", [1, 2, 3], params):
                pass
        return time.perf_counter() - start

    elapsed = min(asyncio.run(run(engine)) for _ in range(3))
    baseline = min(asyncio.run(run(bare)) for _ in range(3))
    if tracer is not None:
        tracer.shutdown()
    return (elapsed - baseline) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    cases = {
        "metrics": (ObservabilityConfig(enable_metrics=True), False),
        "metrics + token histograms + 2 custom labels": (ObservabilityConfig(
            enable_metrics=True, collect_tokens_histogram=True,
            tokenizer_metrics_allowed_custom_labels=["tenant", "tier"]), False),
        "tracing": (ObservabilityConfig(enable_trace=True), True),
        "tracing, detailed": (ObservabilityConfig(enable_trace=True, collect_detailed_traces="all"), True),
    }
    print(f"wrapper cost per request ({args.tokens} outputs each), over the bare wrapper:")
    for name, (observability, tracing) in cases.items():
        print(f"  {name:48} {wrapper_us(observability, args.requests, args.tokens, tracing):8.1f} us")
    print("NaN check per step (float32 logits):")
    for rows in (1, 8, 32):
        logits = torch.randn(rows, VOCAB)
        for name, check in (("row sums (the check)", lambda: bool(torch.isnan(logits.sum(dim=-1)).any())),
                            ("per-entry isnan", lambda: bool(torch.isnan(logits).any()))):
            check()
            start = time.perf_counter()
            for _ in range(200):
                check()
            print(f"  {rows:3} rows x {VOCAB}, {name:22}: "
                  f"{(time.perf_counter() - start) / 200 * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
