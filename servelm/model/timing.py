"""Timing a few candidate computations against each other, fairly, within a time budget.

Candidates are timed interleaved (one call of each per round, after one warm-up call each), so a
noisy neighbour or a frequency change hits them alike; each candidate's figure is its median. Each
round takes them in an order of its own (a seeded shuffle): in one fixed order a candidate always runs
after the same one, and pays for what that one leaves (a kernel timed right after torch's SDPA path
read 0.81x against an identical build after it, `benchmarks/paged_decode_avx2.py`, one stream at 128
columns, AMD Zen 3).
"""

from __future__ import annotations

import random
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
    order = list(candidates.items())
    shuffle = random.Random(len(order)).shuffle
    start = time.perf_counter()
    for round_index in range(max_rounds):
        if round_index >= min_rounds and time.perf_counter() - start > budget_s:
            break
        shuffle(order)
        for name, run in order:
            began = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - began) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
