"""The KV pool on transparent huge pages: zeroed as before, and mapped with 2-MiB pages where the
kernel offers them (checked in /proc/self/smaps, not assumed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from servelm.model.huge_pages import (GATHER_ALIGN, HUGE_PAGE_BYTES, ON_HUGE_PAGES_MIN_BYTES, advise_huge_pages,
                                      gather_on_huge_pages, on_huge_pages)
from servelm.model.kv_cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (bytes)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    return 0


def _kernel_gives_huge_pages_now() -> bool:
    """Whether a fresh 8-MiB mapping advised with MADV_HUGEPAGE and touched gets a huge page now: with
    THP on ``madvise`` the kernel may find no free 2-MiB run (fragmented memory under a full test run's
    servers), which is not the code's doing."""
    import ctypes
    import mmap
    region = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # shared: shmem, not THP
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, len(region), 4096):
            region[offset] = 1
        buffer = ctypes.c_char.from_buffer(region)
        try:
            return _huge_bytes_at(ctypes.addressof(buffer) + (4 << 20)) >= HUGE_PAGE_BYTES
        finally:
            del buffer
    finally:
        region.close()


def _assert_on_huge_pages(address: int) -> None:
    """The mapping at ``address`` holds huge pages, or the kernel gives none to anyone now (skip)."""
    if _huge_bytes_at(address) >= HUGE_PAGE_BYTES:
        return
    if not _kernel_gives_huge_pages_now():
        pytest.skip("the kernel gives no huge page now (no free 2-MiB run): cannot tell")
    raise AssertionError(f"no huge page at {address:#x}, while a fresh advised mapping gets them")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_pool_is_zeroed_on_huge_pages() -> None:
    cache = KVCache(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=1, head_dim=256,
                    dtype=torch.bfloat16, device=torch.device("cpu"))
    for pool in (*cache.k_caches, *cache.v_caches):
        assert not pool.any()
        _assert_on_huge_pages(pool.data_ptr() + pool.nbytes // 2)


def test_small_or_foreign_tensors_are_left_alone() -> None:
    assert not advise_huge_pages(torch.zeros(1000))
    fp8 = KVCache(num_layers=1, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float8_e4m3fn, device=torch.device("cpu"))
    assert not fp8.k_caches[0].view(torch.uint8).any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_a_large_weight_copy_moves_onto_huge_pages_with_its_values() -> None:
    weight = torch.randint(0, 256, (ON_HUGE_PAGES_MIN_BYTES + (4 << 20),), dtype=torch.uint8).view(-1, 64)
    moved = on_huge_pages(weight)
    assert moved.data_ptr() != weight.data_ptr() and torch.equal(moved, weight)
    assert moved.shape == weight.shape and moved.dtype == weight.dtype
    # fresh memory of its own on a huge-page boundary, never a heap chunk (whose pages may be touched already:
    # glibc serves a request above its mmap threshold from a large enough free heap chunk)
    assert moved.data_ptr() % HUGE_PAGE_BYTES == 0 and not moved.is_inference()
    _assert_on_huge_pages(moved.data_ptr() + moved.nbytes // 2)
    # smaller ones, and views that are not contiguous, stay where they are
    small = weight[:1000]
    assert on_huge_pages(small) is small
    strided = weight[:, ::2]
    assert on_huge_pages(strided) is strided


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_small_weight_copies_are_gathered_in_order_with_their_values() -> None:
    """Each tensor object is re-pointed into one huge-paged run in the given order, its values, shape
    and dtype unchanged; repeats, views of a larger storage, non-contiguous tensors and tensors
    gathered before stay where they are."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 128, (640, 1000 + 37 * index), dtype=torch.int8, generator=generator)
               for index in range(4)]
    tensors.append(torch.randn(640, 40, generator=generator).half())
    values = [tensor.clone() for tensor in tensors]
    base = torch.zeros(3 << 20, dtype=torch.uint8)
    view = base[:1 << 20]                  # a view: its storage would stay, so it stays
    strided = torch.zeros(1024, 1024)[:, ::2]
    before = view.data_ptr(), strided.data_ptr()
    moved, moved_bytes = gather_on_huge_pages([*tensors, tensors[0], view, strided])
    assert moved == len(tensors)
    assert moved_bytes == sum(-(-t.nbytes // GATHER_ALIGN) * GATHER_ALIGN for t in tensors) >= HUGE_PAGE_BYTES
    assert (view.data_ptr(), strided.data_ptr()) == before
    for tensor, value in zip(tensors, values):
        assert torch.equal(tensor, value) and tensor.dtype == value.dtype and tensor.is_contiguous()
    starts = [tensor.data_ptr() for tensor in tensors]
    assert starts[0] % HUGE_PAGE_BYTES == 0
    assert all(later == earlier + -(-t.nbytes // GATHER_ALIGN) * GATHER_ALIGN
               for earlier, later, t in zip(starts, starts[1:], tensors))   # one run, in the given order
    _assert_on_huge_pages(starts[0] + moved_bytes // 2)
    assert gather_on_huge_pages(tensors) == (0, 0)   # gathered once
