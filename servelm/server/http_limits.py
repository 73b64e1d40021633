"""Connection-level limits of the HTTP server, and rate-limited logging.

uvicorn bounds neither how long a client may take to send a request nor how many connections
may be open: idle or slowloris sockets then pile up until the process runs out of file handles.

Invariants:
- A connection waiting for a request's headers (fresh, or after a response) is closed once it
  has waited ``--http-header-timeout-s``, however slowly it trickles bytes; a request whose body
  has not fully arrived ``--http-body-timeout-s`` after its headers is closed (the route sees a
  disconnect). A request being answered or streamed is never timed out here.
- At most ``--max-connections`` connections are open (and never more than the open-file limit
  allows, less a reserve for the engine's sockets and files); a connection past that is closed
  as soon as it is accepted.
- uvicorn's error log gets the same repeat filter as servelm's (logging_utils.RepeatFilter).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from servelm.logging_utils import RepeatFilter

logger = logging.getLogger(__name__)

FILE_RESERVE = 256
"""File handles kept back from connections: sockets to the engine, log files, the tokenizer."""


def connection_limit(configured: int) -> int:
    """``configured``, lowered to what the open-file limit allows (raised to its hard cap first)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        if soft != resource.RLIM_INFINITY:
            return max(1, min(configured, soft - FILE_RESERVE))
    except (ImportError, OSError, ValueError):
        pass
    return configured


def guarded_protocol(max_connections: int, header_timeout_s: float,
                     body_timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` enforcing the limits above."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._state_since_s = time.monotonic()
            self._seen_cycle: object | None = None
            if len(self.connections) > max_connections:
                logger.warning("connection limit reached (%d open, --max-connections); closing "
                               "new connections", max_connections)
                transport.close()
                return
            self._schedule_check()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._seen_cycle:  # a new request's headers are complete
                self._seen_cycle = self.cycle
                self._state_since_s = time.monotonic()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._state_since_s = time.monotonic()

        def _schedule_check(self) -> None:
            self.loop.call_later(min(header_timeout_s, body_timeout_s, 1.0), self._check)

        def _check(self) -> None:
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                limit_s, what = header_timeout_s, "request headers"
            elif cycle.more_body and not cycle.disconnected:
                limit_s, what = body_timeout_s, "the request body"
            else:
                limit_s, what = None, ""
            if limit_s is not None and time.monotonic() - self._state_since_s > limit_s:
                logger.warning("closing a connection that took over %g s to send %s", limit_s, what)
                self.transport.close()
                return
            self._schedule_check()

    return GuardedH11Protocol


def install_repeat_filter(burst: int = 20, window_s: float = 60.0) -> None:
    """Rate-limit repeated lines of uvicorn's error log (servelm's own handler has its filter
    from ``configure_logging``)."""
    repeat = RepeatFilter(burst, window_s)
    for name in ("uvicorn.error", "uvicorn"):
        target = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in target.filters):
            target.addFilter(repeat)
