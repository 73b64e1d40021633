"""Shared by the benchmark modes (servelm.bench, servelm.bench_serving): seeded random prompts,
percentiles, result tables, per-request timings and their summary, and the streaming HTTP client.

Invariants: the same arguments always give the same prompts; a failed request is recorded in its
RequestTiming, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FALLBACK_VOCAB_SIZE = 10000
"""Token ids are drawn below this when the server does not report its vocabulary size."""


# --- pure helpers --------------------------------------------------------------------------------

def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` lists of ``input_len`` token ids in [0, vocab_size); the same arguments
    always give the same prompts."""
    if num_prompts < 0 or input_len <= 0 or vocab_size <= 0:
        raise ValueError(f"need num_prompts >= 0, input_len > 0, vocab_size > 0; got "
                         f"{num_prompts}, {input_len}, {vocab_size}")
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default.
    NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    return statistics.fmean(values) if values else math.nan


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: floats to 2 decimals, columns right-aligned to their widest cell."""
    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# --- results -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OfflineResult:
    """Timings of one batch size: a prefill-only run and a full-length run of the same shape."""

    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    """Wall time of the run with max_tokens=1: prefill of every prompt plus one sampled token."""
    total_s: float
    """Wall time of the run with max_tokens=output_len."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.input_len / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the prefill run's; NaN when output_len is 1
        or noise makes the full run no slower than the prefill run."""
        decode_s = self.total_s - self.prefill_s
        if self.output_len <= 1 or decode_s <= 0:
            return math.nan
        return self.batch_size * (self.output_len - 1) / decode_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch_size * self.output_len / self.total_s

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s}


OFFLINE_HEADERS = ("batch", "input", "output", "prefill_s", "total_s", "prefill_tok/s",
                   "decode_tok/s", "output_tok/s")


def format_offline(results: Sequence[OfflineResult], startup_s: float) -> str:
    rows = [(r.batch_size, r.input_len, r.output_len, r.prefill_s, r.total_s,
             r.prefill_tokens_per_s, r.decode_tokens_per_s, r.output_tokens_per_s) for r in results]
    return f"start-up time: {startup_s:.2f} s\n" + format_table(OFFLINE_HEADERS, rows)


@dataclass
class RequestTiming:
    """One streamed request as the client saw it."""

    latency_s: float = 0.0
    ttft_s: float | None = None
    """Time from sending the request to the first chunk carrying text."""
    chunk_gaps_s: list[float] = field(default_factory=list)
    """Time between successive text chunks (a chunk may hold several tokens)."""
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class ServeSummary:
    """Aggregate of a serve run; latencies in milliseconds."""

    num_requests: int
    num_errors: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    """Per request: (latency - ttft) / (output tokens - 1), then aggregated."""


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    return {"mean": 1000 * mean(values_s), "median": 1000 * percentile(values_s, 50),
            "p99": 1000 * percentile(values_s, 99)}


def summarize(timings: Sequence[RequestTiming], duration_s: float) -> ServeSummary:
    ok = [t for t in timings if t.error is None]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    gaps = [gap for t in ok for gap in t.chunk_gaps_s]
    tpots = [(t.latency_s - t.ttft_s) / (t.num_output_tokens - 1) for t in ok
             if t.ttft_s is not None and t.num_output_tokens > 1]
    return ServeSummary(
        num_requests=len(timings), num_errors=len(timings) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / duration_s if duration_s > 0 else math.nan,
        output_tokens_per_s=(sum(t.num_output_tokens for t in ok) / duration_s
                             if duration_s > 0 else math.nan),
        ttft_ms=distribution_ms(ttfts), itl_ms=distribution_ms(gaps),
        tpot_ms=distribution_ms(tpots))


def format_serve(summary: ServeSummary) -> str:
    lines = [f"requests: {summary.num_requests}  errors: {summary.num_errors}  "
             f"duration: {summary.duration_s:.2f} s",
             f"request throughput: {summary.request_throughput:.2f} req/s",
             f"output throughput: {summary.output_tokens_per_s:.2f} tok/s"]
    rows = [(name, d["mean"], d["median"], d["p99"]) for name, d in
            (("TTFT", summary.ttft_ms), ("ITL", summary.itl_ms), ("TPOT", summary.tpot_ms))]
    return "\n".join(lines) + "\n" + format_table(("ms", "mean", "median", "p99"), rows)


_SPEC_COUNTS = ("spec_num_verify_passes", "spec_num_draft_tokens", "spec_num_accepted_tokens")
"""The speculative-decoding counters /get_server_info reports (summed over replicas)."""


def speculative_summary(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures of the requests between two server-info snapshots (``before``
    None: since start), for whichever proposer runs: its name and the three counters are all
    this reads. Empty when the server does not speculate."""
    if not after.get("speculative_algorithm") or any(key not in after for key in _SPEC_COUNTS):
        return {}
    counts = {key: int(after[key]) - int((before or {}).get(key, 0)) for key in _SPEC_COUNTS}
    from servelm.engine.monitor import acceptance_figures

    return {"speculative_algorithm": after["speculative_algorithm"], **counts,
            **acceptance_figures(*(counts[key] for key in _SPEC_COUNTS))}


def format_speculative(summary: dict[str, Any]) -> str | None:
    """The one-line report of ``speculative_summary`` (None when it is empty)."""
    if not summary:
        return None
    return (f"speculative decoding ({summary['speculative_algorithm']}): accept length "
            f"{summary['spec_accept_length']:.2f} tokens per verify pass, acceptance rate "
            f"{100 * summary['spec_acceptance_rate']:.1f}% of "
            f"{summary['spec_num_draft_tokens']} drafted tokens")


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as file:
        json.dump(payload, file, indent=2, allow_nan=True)
        file.write("\n")


# --- the streaming client ------------------------------------------------------------------------

async def one_request(client: Any, url: str, body: dict[str, Any]) -> RequestTiming:
    timing = RequestTiming()
    start_s = time.perf_counter()
    last_s = start_s
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    timing.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not any(choice.get("text") for choice in chunk.get("choices") or []):
                    continue
                now_s = time.perf_counter()
                if timing.ttft_s is None:
                    timing.ttft_s = now_s - start_s
                else:
                    timing.chunk_gaps_s.append(now_s - last_s)
                last_s = now_s
    except Exception as error:  # one failed request is counted, not fatal
        timing.error = f"{type(error).__name__}: {error}"
    timing.latency_s = time.perf_counter() - start_s
    return timing


async def server_facts(client: Any, base_url: str) -> tuple[str, int]:
    models = (await client.get(f"{base_url}/v1/models")).json()
    name = models["data"][0]["id"]
    try:
        info = (await client.get(f"{base_url}/get_model_info")).json()
        vocab_size = int(info.get("vocab_size") or FALLBACK_VOCAB_SIZE)
    except Exception:  # not a servelm/SGLang server
        vocab_size = FALLBACK_VOCAB_SIZE
    return name, vocab_size


async def server_info(client: Any, base_url: str) -> dict[str, Any]:
    """/get_server_info, or {} from a server without it (not servelm/SGLang)."""
    try:
        response = await client.get(f"{base_url}/get_server_info")
        info = response.json() if response.status_code == 200 else {}
    except Exception:  # not a servelm/SGLang server, or not JSON
        return {}
    return info if isinstance(info, dict) else {}
