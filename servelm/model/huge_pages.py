"""Transparent huge pages for big tensors read in scattered pieces (the KV pool).

A decode step reads each sequence's K and V rows block by block from anywhere in the pool: at 32
streams of Gemma 3 270M, ~1,300 4-KiB pages per layer, each a TLB miss whose page walk itself
misses the caches once the layer's GEMMs have evicted them. With the kernel's transparent huge
pages in ``madvise`` mode (the common default) an allocation gets 2-MiB pages only when asked
before its pages are first touched; ``advise_huge_pages`` asks (``madvise(MADV_HUGEPAGE)``) for
the whole 2-MiB-aligned part of a tensor's memory. 18 layers' decode attention over such pools:
9.7 -> 7.8 ms (32 streams, 64-264 tokens, 1 thread, noisy, shared machine; benchmarks/RESULTS.md).

Best effort by design: nothing changes where the call fails (not Linux, THP ``never``, memory
already touched keeps its pages until khugepaged merges them), and the tensor's values never
depend on it.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14   # linux/mman.h

_libc: ctypes.CDLL | None = None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under ``tensor``'s 2-MiB-aligned bytes (call before first touching them);
    True where the kernel accepted the advice."""
    global _libc
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return int(_libc.madvise(first, last - first, MADV_HUGEPAGE)) == 0
    except (OSError, AttributeError):
        return False


ON_HUGE_PAGES_MIN_BYTES = 32 << 20
"""Tensors at least this large are copied by ``on_huge_pages``: glibc serves them with fresh mmap'd
memory (its mmap threshold grows to at most 32 MiB), untouched until the copy, so the advice holds."""


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in memory asked for huge pages before first touched (``advise_huge_pages``),
    for a large weight copy that a step streams whole (the LM-head screen's copies): a 4-KiB page each
    is a TLB miss, and the hardware prefetchers stop at page edges. The tensor itself where it is
    smaller than ON_HUGE_PAGES_MIN_BYTES, not a contiguous CPU tensor, or the advice is refused."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() < ON_HUGE_PAGES_MIN_BYTES):
        return tensor
    copy = torch.empty_like(tensor)
    if not advise_huge_pages(copy):
        return tensor
    return copy.copy_(tensor)
