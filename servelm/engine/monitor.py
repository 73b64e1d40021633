"""What watches the engine loop from inside the engine process: the stats line and the watchdog.

Invariants:
- The stats line is logged only while there is (or just was) work, at most every
  ``--log-stats-interval`` seconds, and also every ``--decode-log-interval`` steps when that is set.
- The watchdog is armed only while ``LLMEngine.step()`` runs. A step longer than
  ``--watchdog-timeout`` dumps every thread's stack and ends the process with exit status 70, so
  the front end sees a dead engine, fails the pending requests and exits, instead of hanging.
- Time the whole process spent stopped (SIGSTOP, a debugger, a suspended container or machine)
  is not step time. The watchdog thread wakes every ``poll_s``; a wake-up late by more than
  PAUSE_THRESHOLD_S means no thread of the process ran meanwhile, so the excess is subtracted.
  A paused engine is therefore not killed on resume; a step that hangs while the process runs
  still trips within ``timeout + poll_s``.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from servelm.config import ObservabilityConfig

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70
"""EX_SOFTWARE: the engine process ended itself because a step hung."""
PAUSE_THRESHOLD_S = 0.5
"""A watchdog wake-up this much later than asked means the process was stopped, not busy: a
loaded host delays a runnable thread by milliseconds, not half a second."""


def cache_hit_rate(stats: dict[str, Any]) -> float:
    """The engine's prefix-cache hit rate, or 0 when the engine reports none."""
    for key in ("prefix_cache_hit_rate", "cache_hit_rate"):
        if stats.get(key) is not None:
            return float(stats[key])
    return 0.0


def acceptance_figures(num_verify_passes: int, num_draft_tokens: int,
                       num_accepted_tokens: int) -> dict[str, float]:
    """``spec_acceptance_rate``: accepted / drafted tokens; ``spec_accept_length``: tokens emitted
    per verify pass (accepted drafts + the model's own token), SGLang's "accept length"."""
    return {"spec_acceptance_rate": round(num_accepted_tokens / max(1, num_draft_tokens), 4),
            "spec_accept_length": round((num_accepted_tokens + num_verify_passes)
                                        / max(1, num_verify_passes), 4)}


class StatsLogger:
    """Logs throughput, running/queued requests, KV use, cache hit rate and (with speculative
    decoding) the accept length and acceptance rate so far, periodically."""

    def __init__(self, engine: Any, config: ObservabilityConfig) -> None:
        self.engine = engine
        self.interval_s = config.log_stats_interval
        self.interval_steps = config.decode_log_interval
        self.last_s = time.monotonic()
        self.last_tokens = 0
        self.last_steps = 0
        self.show_time_cost = config.show_time_cost
        self.step_times_s: list[float] = []
        """--show-time-cost: durations of the steps since the last line."""

    def record_step(self, seconds: float) -> None:
        if self.show_time_cost:
            self.step_times_s.append(seconds)

    def maybe_log(self) -> None:
        if self.interval_s <= 0 and self.interval_steps <= 0:
            return
        now = time.monotonic()
        steps = getattr(self.engine, "num_steps", 0)
        is_time = self.interval_s > 0 and now - self.last_s >= self.interval_s
        is_steps = self.interval_steps > 0 and steps - self.last_steps >= self.interval_steps
        if not (is_time or is_steps):
            return
        tokens = self.engine.num_generated_tokens
        if tokens != self.last_tokens or self.engine.has_unfinished():
            logger.info(self.line(tokens - self.last_tokens, now - self.last_s))
        self.last_s, self.last_tokens, self.last_steps = now, tokens, steps
        self.step_times_s = []

    def line(self, num_tokens: int, elapsed_s: float) -> str:
        stats = self.engine.stats()
        return (f"running={stats['num_running']} queued={stats['num_waiting']} "
                f"kv_usage={100 * stats['token_usage']:.1f}% "
                f"cache_hit_rate={100 * cache_hit_rate(stats):.1f}% "
                f"gen_throughput={num_tokens / max(elapsed_s, 1e-9):.1f} tok/s"
                + (f" spec_accept_length={stats['spec_accept_length']:.2f} "
                   f"spec_acceptance_rate={100 * stats['spec_acceptance_rate']:.1f}%"
                   if "spec_accept_length" in stats else "")
                + (f" hicache_host_hit_tokens={stats['hicache_host_hit_tokens']} "
                   f"hicache_storage_hit_tokens={stats.get('hicache_storage_hit_tokens', 0)}"
                   if "hicache_host_hit_tokens" in stats else "")
                + (f" steps={len(self.step_times_s)} step_time_mean="
                   f"{1000 * sum(self.step_times_s) / len(self.step_times_s):.1f}ms "
                   f"step_time_max={1000 * max(self.step_times_s):.1f}ms"
                   if self.show_time_cost and self.step_times_s else ""))


def _die_loudly(elapsed_s: float, timeout_s: float) -> None:
    logger.critical("watchdog: an engine step has run for %.1f s (--watchdog-timeout %.1f s); "
                    "the engine process is exiting so the server does not hang. Stacks follow.",
                    elapsed_s, timeout_s)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT_CODE)


class Watchdog:
    """A daemon thread that calls ``on_timeout(elapsed_s, timeout_s)`` when a step hangs."""

    def __init__(self, timeout_s: float,
                 on_timeout: Callable[[float, float], None] = _die_loudly) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._step_start: tuple[float, float] | None = None
        """(monotonic start of the running step, ``_paused_s`` then), set in one assignment."""
        self._paused_s = 0.0
        """Total time the process was seen stopped (only the watchdog thread writes it)."""
        self._stopped = threading.Event()
        self._poll_s = max(0.005, min(1.0, timeout_s / 4))
        self._thread = threading.Thread(target=self._run, name="servelm-watchdog", daemon=True)
        self._thread.start()

    def step_started(self) -> None:
        self._step_start = (time.monotonic(), self._paused_s)

    def step_finished(self) -> None:
        self._step_start = None

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        last_s = time.monotonic()
        while not self._stopped.wait(self._poll_s):
            now_s = time.monotonic()
            late_s = now_s - last_s - self._poll_s
            last_s = now_s
            if late_s > PAUSE_THRESHOLD_S:
                self._paused_s += late_s
            step = self._step_start
            if step is None:
                continue
            started_s, paused_before_s = step
            elapsed_s = now_s - started_s - (self._paused_s - paused_before_s)
            if elapsed_s > self.timeout_s:
                self.on_timeout(elapsed_s, self.timeout_s)
                self._step_start = None  # report a hang once (when on_timeout returns)
