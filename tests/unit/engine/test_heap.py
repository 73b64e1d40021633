"""The engine gives freed heap pages back once idle a while (issue 19: memory back to baseline)."""

from __future__ import annotations

import resource
import sys

import psutil
import pytest
import torch

from servelm.engine.heap import MMAP_THRESHOLD_BYTES, IdleTrim, keep_large_buffers, release_free_memory

import servelm.engine.engine  # noqa: F401,E402  the engine process's imports, as `import servelm` gave before it
# became lazy: the faults counted depend on the heap earlier imports leave (with torch alone, glibc
# was seen to map each 40 MiB buffer afresh; in the engine process it reuses it)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_pages_below_a_live_allocation_go_back_to_the_os():
    process = psutil.Process()
    chunks = [bytearray(2000) for _ in range(100_000)]  # ~200 MB of small (heap, not mmap) blocks
    pin = bytearray(2000)  # allocated last: glibc cannot shrink the heap's top past it by itself
    del chunks
    freed_rss = process.memory_info().rss
    assert release_free_memory()
    assert freed_rss - process.memory_info().rss > 100 << 20
    del pin


def test_idle_trim_waits_for_a_quiet_spell_and_trims_once_per_idle_period():
    trim = IdleTrim(delay_s=2.0)
    assert not trim.update(False, 0.0) and not trim.update(False, 5.0)   # start-up: kept warm
    assert not trim.update(True, 0.0)
    assert not trim.update(False, 1.0)      # just went idle: a request may follow at once
    assert not trim.update(False, 2.5)
    assert not trim.update(True, 2.6)       # it did: no trim between back-to-back requests
    assert not trim.update(False, 3.0)
    assert trim.update(False, 5.0)          # idle for 2 s: trimmed
    assert not trim.update(False, 9.0)      # once per idle period
    assert not trim.update(True, 10.0) and not trim.update(False, 10.5)
    assert trim.update(False, 12.5)
    assert trim.num_trims == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    """A 40 MiB buffer (above glibc's 32 MiB adaptive mmap ceiling, like a 32-row step's float32
    logits over a 262k vocabulary) freed and allocated again: without ``keep_large_buffers`` it is
    unmapped and its 12k pages fault in again every time."""
    assert keep_large_buffers()
    size = 40 << 20
    assert size < MMAP_THRESHOLD_BYTES
    for _ in range(2):   # the heap grows to hold it once
        torch.empty(size, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(size, dtype=torch.uint8).fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # 5 x 10,240 pages when each buffer is mapped afresh; one refault of a buffer (exactly 10,240:
    # the heap's top trimmed once by another allocation in between) was seen now and then
    assert faults < 2 * (size >> 12), faults
