"""Timing a few candidate computations against each other, fairly, within a time budget.

Candidates are timed interleaved (one call of each per round, after one warm-up call each), so a
noisy neighbour or a frequency change hits them alike; each candidate's figure is its median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def time_candidates(candidates: Mapping[str, Callable[[], object]], *, min_rounds: int = 3,
                    max_rounds: int = 15, budget_s: float = 0.2) -> dict[str, float]:
    """Median microseconds per call of each candidate: ``min_rounds`` rounds at least, then more while
    ``budget_s`` lasts (at most ``max_rounds``)."""
    for run in candidates.values():   # warm-up: caches, oneDNN primitives, page faults
        run()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    for round_index in range(max_rounds):
        if round_index >= min_rounds and time.perf_counter() - start > budget_s:
            break
        for name, run in candidates.items():
            began = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - began) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
