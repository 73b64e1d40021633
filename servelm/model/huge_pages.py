"""Transparent huge pages for big tensors read in scattered pieces (the KV pool), for large weight copies
read whole every step, and for a decode step's many small weight copies gathered in step order.

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
import mmap
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
"""Tensors at least this large are copied by ``on_huge_pages`` (smaller ones: ``gather_on_huge_pages``)."""


def fresh_huge_bytes(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` bytes (uint8) of fresh private anonymous memory starting on a huge-page boundary, asked for
    huge pages before anything touches them, or None where the advice is refused. Not the heap's: glibc
    serves even a request above its mmap threshold from a free heap chunk large enough (after a run of
    frees), whose pages were touched already and keep 4 KiB; nor a shared mapping (shmem, without huge pages
    by default). A plain tensor (not an inference tensor) that keeps the mapping alive."""
    pages = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    with torch.inference_mode(False):
        raw = torch.frombuffer(mmap.mmap(-1, pages + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                               dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    if not advise_huge_pages(raw[start:start + pages]):
        return None
    return raw[start:start + nbytes]


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in memory asked for huge pages before first touched (``fresh_huge_bytes``),
    for a large weight copy that a step streams whole (the LM-head screen's copies, the int8 GEMM's): a
    4-KiB page each is a TLB miss, and the hardware prefetchers stop at page edges. The tensor itself where
    it is smaller than ON_HUGE_PAGES_MIN_BYTES, not a contiguous CPU tensor, or the advice is refused."""
    if (not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() < ON_HUGE_PAGES_MIN_BYTES):
        return tensor
    memory = fresh_huge_bytes(tensor.numel() * tensor.element_size())
    if memory is None:
        return tensor
    return memory.view(tensor.dtype).view(tensor.shape).copy_(tensor)


GATHER_ALIGN = 64
"""Each gathered tensor starts on a cache line (the kernels' vector loads)."""

GATHER_MIN_BYTES = HUGE_PAGE_BYTES
"""Fewer bytes than this are not gathered (less than a huge page: nothing to gain)."""
GATHER_TRIM_BYTES = 64 << 20
"""The heap is trimmed after every this many bytes moved: the moved tensors' old memory goes back as the
copy proceeds, so a large model's gather holds at most this much twice, not all of it."""


def gather_on_huge_pages(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Move ``tensors``' values into one buffer asked for huge pages, in the given order (a cache line
    apart at most), each tensor re-pointed there in place (``Tensor.set_``: every holder of the tensor
    object reads the new memory; values, shape and dtype unchanged). For the many small weight copies a
    decode step streams in a fixed order (each a few hundred KiB to 2 MiB, on 4-KiB pages where they were
    made: a TLB miss a page, the hardware prefetchers stopping at each page edge): on one huge-paged run in
    step order they are read as one stream. Skipped: tensors not contiguous on the CPU, already on huge
    pages (``ON_HUGE_PAGES_MIN_BYTES`` and larger), views into a larger storage (the storage would stay;
    a tensor moved before is one, of its run), repeated ones. Returns (tensors moved, bytes moved);
    (0, 0) where the advice is refused (nothing moves). Call only while nothing else writes the tensors
    (read-only weights), and make any native object that keeps their addresses afterwards."""
    if not sys.platform.startswith("linux"):   # transparent huge pages are Linux's
        return 0, 0
    chosen: list[torch.Tensor] = []
    seen: set[int] = set()
    for tensor in tensors:
        pointer = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.device.type != "cpu" or not tensor.is_contiguous() or pointer in seen
                or nbytes == 0 or nbytes >= ON_HUGE_PAGES_MIN_BYTES or tensor.requires_grad
                or tensor.untyped_storage().nbytes() != nbytes):
            continue
        seen.add(pointer)
        chosen.append(tensor)
    sizes = [-(-t.numel() * t.element_size() // GATHER_ALIGN) * GATHER_ALIGN for t in chosen]
    total = sum(sizes)
    if not chosen or total < GATHER_MIN_BYTES:
        return 0, 0
    arena = fresh_huge_bytes(total)   # a plain tensor: the weights may be inference tensors or not
    if arena is None:
        return 0, 0
    moved = moved_bytes = offset = untrimmed = 0
    for tensor, size in zip(chosen, sizes):
        nbytes = tensor.numel() * tensor.element_size()
        piece = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        offset += size
        piece.copy_(tensor)
        try:
            tensor.set_(piece)
        except RuntimeError:   # a tensor that may not be re-pointed here keeps its memory
            continue
        moved, moved_bytes, untrimmed = moved + 1, moved_bytes + size, untrimmed + size
        if untrimmed >= GATHER_TRIM_BYTES:
            _trim_heap()
            untrimmed = 0
    _trim_heap()
    return moved, moved_bytes


def _trim_heap() -> None:
    """Give the heap's free pages back (glibc ``malloc_trim``): the moved tensors' old memory, freed
    into the heap, otherwise stays resident (Gemma 3 270M: +161 MiB of RSS without it)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
