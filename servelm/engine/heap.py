"""Handing freed heap memory back to the OS when the engine goes idle.

A busy step allocates and frees many short-lived buffers (logits, activations, sampling tensors,
per-request lists) whose sizes follow the batch. glibc keeps freed memory in its arenas for reuse
and returns it to the OS only from the top of the heap, so after a burst of large batches the
process keeps that burst's high-water mark in RSS although nothing uses it. ``malloc_trim(0)``
walks the arenas and releases every free page. It costs milliseconds, and the next request pays
again for every page it touches, so it runs only once the engine has been idle for
``IDLE_TRIM_DELAY_S`` (``IdleTrim``), never between the steps of a busy batch or between requests
that come back to back.
"""

from __future__ import annotations

import ctypes
import sys

_libc: ctypes.CDLL | None = None


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS (glibc); False where there is no malloc_trim."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):
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
