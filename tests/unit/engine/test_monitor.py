"""The engine-process watchdog and the periodic stats line."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from servelm.config import ObservabilityConfig
from servelm.engine.monitor import StatsLogger, Watchdog


def test_watchdog_fires_on_a_hung_step_only() -> None:
    fired: list[float] = []
    done = threading.Event()

    def on_timeout(elapsed_s: float, timeout_s: float) -> None:
        fired.append(elapsed_s)
        done.set()

    watchdog = Watchdog(0.1, on_timeout)
    try:
        for _ in range(3):  # fast steps: nothing happens
            watchdog.step_started()
            time.sleep(0.01)
            watchdog.step_finished()
        time.sleep(0.3)  # idle between steps: nothing happens either
        assert not fired
        watchdog.step_started()  # this step "hangs"
        assert done.wait(5)
        assert len(fired) == 1 and fired[0] > 0.1
    finally:
        watchdog.stop()


_STEP_CHILD = """
import os, sys, time
from servelm.engine.monitor import Watchdog
watchdog = Watchdog(2.0, lambda elapsed_s, timeout_s: os._exit(70))
watchdog.step_started()
print("started", flush=True)
if sys.argv[2] == "hang":
    time.sleep(10)
cpu_start = time.thread_time()
while time.thread_time() - cpu_start < float(sys.argv[1]):  # a step of this much CPU work
    pass
watchdog.step_finished()
print("finished", flush=True)
"""


def _run_step(cpu_s: float, stop_s: float, mode: str = "work") -> int:
    """Exit status of a child running one step of ``cpu_s`` CPU seconds under a 2 s watchdog,
    SIGSTOPped for ``stop_s`` seconds right after the step starts (mode "hang": the step
    sleeps 10 s first)."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _STEP_CHILD, str(cpu_s), mode],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "started"
    if stop_s:
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(stop_s)
        os.kill(child.pid, signal.SIGCONT)
    return child.wait(timeout=60)


def test_watchdog_does_not_count_time_stopped() -> None:
    # Stopped for 4 s in a 0.3 s step: the step took 0.3 s of running time, not 4.3 s.
    assert _run_step(0.3, 4.0) == 0
    # A real hang (the process runs, the step does not end) still trips the watchdog.
    assert _run_step(0.0, 0.0, "hang") == 70


class FakeEngine:
    def __init__(self) -> None:
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.busy = True

    def has_unfinished(self) -> bool:
        return self.busy

    def stats(self) -> dict:
        return {"num_running": 2, "num_waiting": 1, "token_usage": 0.25, "prefix_cache_hit_rate": 0.5}


def test_stats_line_by_steps_and_off(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    logger = StatsLogger(engine, ObservabilityConfig(log_stats_interval=0, decode_log_interval=2))
    with caplog.at_level(logging.INFO, logger="servelm.engine.monitor"):
        for _ in range(4):
            engine.num_steps += 1
            engine.num_generated_tokens += 3
            logger.maybe_log()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "running=2 queued=1 kv_usage=25.0% cache_hit_rate=50.0%" in lines[0]
    assert "gen_throughput=" in lines[0]
    caplog.clear()
    silent = StatsLogger(engine, ObservabilityConfig(log_stats_interval=0))
    with caplog.at_level(logging.INFO, logger="servelm.engine.monitor"):
        engine.num_steps += 100
        silent.maybe_log()
    assert not caplog.records


def test_show_time_cost_adds_step_times_to_the_stats_line(caplog: pytest.LogCaptureFixture) -> None:
    """--show-time-cost: each line reports the steps since the previous one, mean and longest."""
    engine = FakeEngine()
    logger = StatsLogger(engine, ObservabilityConfig(log_stats_interval=0, decode_log_interval=2,
                                                     show_time_cost=True))
    plain = StatsLogger(engine, ObservabilityConfig(log_stats_interval=0, decode_log_interval=2))
    with caplog.at_level(logging.INFO, logger="servelm.engine.monitor"):
        for seconds in (0.010, 0.030, 0.002, 0.004):
            engine.num_steps += 1
            engine.num_generated_tokens += 3
            logger.record_step(seconds)
            plain.record_step(seconds)
            logger.maybe_log()
            plain.maybe_log()
    lines = [r.getMessage() for r in caplog.records]
    timed = [line for line in lines if "step_time" in line]
    assert timed == [line for line in lines[::2]] and len(timed) == 2
    assert "steps=2 step_time_mean=20.0ms step_time_max=30.0ms" in timed[0]
    assert "steps=2 step_time_mean=3.0ms step_time_max=4.0ms" in timed[1]
