"""Handing freed heap memory back to the OS when the engine goes idle.

A busy step allocates and frees many short-lived buffers (logits, activations, sampling tensors,
per-request lists) whose sizes follow the batch. glibc keeps freed memory in its arenas for reuse
and returns it to the OS only from the top of the heap, so after a burst of large batches the
process keeps that burst's high-water mark in RSS although nothing uses it. ``malloc_trim(0)``
walks the arenas and releases every free page. It costs milliseconds, and the next request pays
again for every page it touches, so it runs only once the engine has been idle for
``IDLE_TRIM_DELAY_S`` (``IdleTrim``), never between the steps of a busy batch or between requests
that come back to back. ``keep_large_buffers`` makes glibc keep big freed buffers for reuse
(a step's logits) instead of unmapping them, so steps do not fault their pages in again.
"""

from __future__ import annotations

import ctypes
import sys

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is Linux's (glibc's malloc knobs), else None."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None)
        except OSError:
            return None
    return _libc


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS (glibc); False where there is no malloc_trim."""
    libc = _glibc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False


MMAP_THRESHOLD_BYTES = 512 << 20
"""Allocations up to this size come from the heap, whose freed memory the next step reuses. glibc
serves larger ones by mmap and unmaps them on free, its adaptive threshold stopping at 32 MiB, so a
buffer the size of a 32-row step's float32 logits over a 262k vocabulary (33.5 MB) was mapped afresh
and page-faulted in every step: ``.float()`` of those logits took 8.4 ms instead of 0.9 (Gemma 3
270M's LM head at 32 rows, 2 threads, AMD EPYC; benchmarks/RESULTS.md)."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap that ``free`` keeps instead of returning it at once (set with
the mmap threshold, which turns glibc's adaptive pair off); ``IdleTrim`` still gives it all back
once the engine is idle."""


def keep_large_buffers() -> bool:
    """Let freed buffers of up to ``MMAP_THRESHOLD_BYTES`` be reused without page faults (glibc's
    ``mallopt``; process-wide, idempotent); False where there is no glibc."""
    libc = _glibc()
    m_trim_threshold, m_mmap_threshold = -1, -3   # malloc.h
    try:
        return (libc is not None and bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES))
                and bool(libc.mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES)))
    except AttributeError:
        return False


IDLE_TRIM_DELAY_S = 2.0
"""How long the engine stays idle before it trims. Trimming at once cost the next request its page
faults: a 1,019-token prefill re-faulted ~11k pages (~27 ms of CPU, Gemma 3 270M, one thread) when a
user's requests came back to back, as a benchmark's or a chat's do; a server idle for seconds
still gives its pages back."""


class IdleTrim:
    """Calls ``release_free_memory`` once per idle period, ``delay_s`` after the engine went idle.

    ``update`` is called on every pass of the engine loop (an idle loop wakes at least once a
    second), so the trim comes between ``delay_s`` and ``delay_s`` plus one wake-up after the last
    step; a request arriving first cancels it. The first idle period (start-up, after the warm-up)
    is not trimmed: the warm-up's freed pages stay mapped for the first requests, which would
    otherwise fault them in again (~11k pages for a 1,019-token prompt)."""

    def __init__(self, delay_s: float = IDLE_TRIM_DELAY_S) -> None:
        self.delay_s = delay_s
        self._idle_since_s: float | None = None
        self._is_trimmed = True   # nothing to give back before the first request
        self.num_trims = 0

    def update(self, is_busy: bool, now_s: float) -> bool:
        """Record the engine's state at ``now_s`` (monotonic); True when this call trimmed."""
        if is_busy:
            self._idle_since_s = None
            self._is_trimmed = False
            return False
        if self._is_trimmed:
            return False
        if self._idle_since_s is None:
            self._idle_since_s = now_s
        if now_s - self._idle_since_s < self.delay_s:
            return False
        release_free_memory()
        self._is_trimmed = True
        self.num_trims += 1
        return True
