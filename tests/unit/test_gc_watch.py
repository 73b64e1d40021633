"""--gc-warning-threshold-secs: slow garbage collections are logged, fast ones are not."""

from __future__ import annotations

import gc
import logging

import pytest

from servelm.logging_utils import unwatch_gc, watch_gc


def collect_with(threshold_s: float, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    garbage = [[i] for i in range(100_000)]  # something for the collector to walk
    logger = logging.getLogger("servelm.gc")
    logger.addHandler(caplog.handler)  # servelm's loggers may not propagate (configure_logging)
    try:
        with caplog.at_level(logging.WARNING, logger="servelm.gc"):
            watch_gc(threshold_s, "test process")
            try:
                gc.collect()
            finally:
                unwatch_gc()
    finally:
        logger.removeHandler(caplog.handler)
    del garbage
    records = {id(r): r for r in caplog.records}.values()  # once, whichever handler caught it
    return [r.getMessage() for r in records if r.name == "servelm.gc"]


def test_slow_collection_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    (line,) = collect_with(1e-9, caplog)
    assert line.startswith("test process: a garbage collection of generation 2 took ")
    assert "--gc-warning-threshold-secs 1e-09" in line


def test_fast_collection_and_off_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    assert collect_with(60.0, caplog) == []
    before = len(gc.callbacks)
    assert watch_gc(0, "x") is None and len(gc.callbacks) == before
