"""Handing freed heap memory back to the OS when the engine goes idle.

A busy step allocates and frees many short-lived buffers (logits, activations, sampling tensors,
per-request lists) whose sizes follow the batch. glibc keeps freed memory in its arenas for reuse
and returns it to the OS only from the top of the heap, so after a burst of large batches the
process keeps that burst's high-water mark in RSS although nothing uses it. ``malloc_trim(0)``
walks the arenas and releases every free page (it costs milliseconds, so it runs only when the
engine has just gone idle, never between the steps of a busy batch).
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
