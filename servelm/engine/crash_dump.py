"""The recent-request record behind ``--crash-dump-folder``: what the engine was given before it died.

The front end records every request it hands to the engine process (id, prompt token ids,
sampling parameters, priority, arrival time) and marks it when it ends. When the engine process
dies (a crash, the watchdog, a kill), the requests of the last ``WINDOW_S`` seconds are written to
one JSON file in the folder, so the request that triggered a crash can be replayed.

Invariants:
- Records older than ``WINDOW_S`` are dropped as new ones arrive: memory stays bounded by the
  traffic of one window, not by the server's uptime.
- A dump never raises: a crash report that fails (disk full, folder gone) is logged, and the
  shutdown that follows goes on.
- The file is plain JSON (never pickle): a dump may be read on another machine and must not be
  able to run code there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WINDOW_S = 300.0
"""Seconds of requests a dump covers (SGLang keeps the last five minutes too): long enough to hold
the request that started a slow failure, short enough to stay small under load."""


@dataclass(slots=True)
class RequestRecord:
    """One request as the engine received it, and how it ended (None while in flight)."""

    request_id: str
    received_unix_s: float
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    priority: int
    finish_reason: str | None = None
    num_output_tokens: int = 0


class CrashRecorder:
    """Keeps the last ``window_s`` seconds of requests and writes them out when asked."""

    def __init__(self, folder: str, window_s: float = WINDOW_S) -> None:
        self.folder = Path(folder)
        self.window_s = window_s
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()

    def record(self, request_id: str, prompt_token_ids: list[int], params: Any, priority: int) -> None:
        now = time.time()
        self._drop_older_than(now - self.window_s)
        self._records[request_id] = RequestRecord(
            request_id, now, list(prompt_token_ids), _as_dict(params), priority)

    def finish(self, request_id: str, finish_reason: str | None, num_output_tokens: int) -> None:
        record = self._records.get(request_id)
        if record is not None:
            record.finish_reason = finish_reason or "aborted"
            record.num_output_tokens = num_output_tokens

    def dump(self, reason: str) -> Path | None:
        """Write the window's requests to a new JSON file; return its path (None if that failed)."""
        now = time.time()
        self._drop_older_than(now - self.window_s)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        path = self.folder / f"crash_dump_{stamp}_{os.getpid()}.json"
        body = {
            "reason": reason,
            "dumped_unix_s": now,
            "window_s": self.window_s,
            "num_in_flight": sum(r.finish_reason is None for r in self._records.values()),
            "requests": [dataclasses.asdict(record) for record in self._records.values()],
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(body, default=str, indent=1))
        except OSError as error:
            logger.error("could not write the crash dump to %s: %s", path, error)
            return None
        logger.error("crash dump of %d requests written to %s", len(self._records), path)
        return path

    def _drop_older_than(self, cutoff_unix_s: float) -> None:
        while self._records:
            oldest = next(iter(self._records.values()))
            if oldest.received_unix_s >= cutoff_unix_s:
                return
            self._records.popitem(last=False)


def _as_dict(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, dict):
        return dict(params)
    return {"repr": repr(params)}
