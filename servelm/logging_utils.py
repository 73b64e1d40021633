"""Logging set-up shared by the server and the engine process.

Invariant: a warning or error line repeated more than ``burst`` times within ``window_s`` (same logger, level
and format string) is dropped until the window ends, and the next one says how many were
dropped, so a flood of bad clients cannot grow the log without bound.

``watch_gc`` (--gc-warning-threshold-secs) logs each Python garbage collection slower than a bound:
a full collection of a process holding millions of objects can stall it, and in the engine process
that stalls every running request's next token. It hooks ``gc.callbacks`` (start and stop of each
collection), once per process; 0 installs nothing.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def configure_logging(level: str = "info") -> None:
    """Send servelm's logs to stderr at ``level``; safe to call more than once."""
    logger = logging.getLogger("servelm")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_servelm", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._servelm = True  # type: ignore[attr-defined]
        handler.addFilter(RepeatFilter())
        logger.addHandler(handler)
        logger.propagate = False


class RepeatFilter(logging.Filter):
    """Drops a warning or error line (same logger, level and format string) seen over ``burst`` times in
    ``window_s``; the first line after the window notes how many were dropped."""

    def __init__(self, burst: int = 20, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self._seen: dict[tuple[str, int, str], list[float]] = {}
        """key -> [window start (monotonic s), lines in window, lines dropped]."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # floods are warnings and errors; keep info whole
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            dropped = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 10_000:  # forget rather than grow without bound
                self._seen = {key: self._seen[key]}
            if dropped:
                record.msg = f"{record.msg} ({dropped} similar lines dropped in the last " \
                             f"{self.window_s:g} s)"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


_gc_logger = logging.getLogger("servelm.gc")

_installed: list[Any] = []


def watch_gc(threshold_s: float, process: str) -> Any:
    """Log collections longer than ``threshold_s`` in this process (named ``process`` in the
    line); returns the callback (None when ``threshold_s`` is 0). Replaces an earlier watcher."""
    unwatch_gc()
    if threshold_s <= 0:
        return None
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            elapsed_s = time.perf_counter() - started.pop()
            if elapsed_s > threshold_s:
                _gc_logger.warning("%s: a garbage collection of generation %s took %.3f s "
                                   "(--gc-warning-threshold-secs %g; %s objects collected)", process,
                                   info.get("generation"), elapsed_s, threshold_s, info.get("collected"))

    gc.callbacks.append(callback)
    _installed.append(callback)
    return callback


def unwatch_gc() -> None:
    """Remove the watcher ``watch_gc`` installed, if any."""
    while _installed:
        callback = _installed.pop()
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)
