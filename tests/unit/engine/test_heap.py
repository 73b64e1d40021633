"""The engine gives freed heap pages back when it goes idle (issue 19: memory back to baseline)."""

from __future__ import annotations

import sys

import psutil
import pytest

from servelm.engine.heap import release_free_memory


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
