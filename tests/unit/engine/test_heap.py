"""The engine gives freed heap pages back once idle a while (issue 19: memory back to baseline)."""

from __future__ import annotations

import sys

import psutil
import pytest

from servelm.engine.heap import IdleTrim, release_free_memory


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
