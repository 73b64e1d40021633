"""Connection-level limits of the HTTP server, and rate-limited logging.

uvicorn bounds neither how long a client may take to send a request nor how many connections
may be open: idle or slowloris sockets then pile up until the process runs out of file handles.

Invariants:
- A connection waiting for a request's headers (fresh, or after a response) is closed once it
  has waited ``--http-header-timeout-s``, however slowly it trickles bytes; a request whose body
  has not fully arrived ``--http-body-timeout-s`` after its headers is closed (the route sees a
  disconnect). A request being answered or streamed is never timed out here.
- At most ``--max-connections`` connections are served (and never more than the open-file limit
  allows, less a reserve for the engine's sockets and files). A connection past that is answered
  at once, before its request is read, with a 503 (OpenAI error JSON, ``Retry-After``,
  ``Connection: close``); the server then stops writing, discards what the client sends (so the
  client reads the answer rather than a reset) and closes it when the client does or after
  ``REFUSED_LINGER_S``. At most ``MAX_REFUSED_LINGERING`` refused connections linger at once (they
  hold file handles too); past that a new one is closed with nothing said.
- uvicorn's error log gets the same repeat filter as servelm's (logging_utils.RepeatFilter).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from servelm.logging_utils import RepeatFilter
from servelm.server.errors import RETRY_AFTER_S, error_body

logger = logging.getLogger(__name__)

FILE_RESERVE = 256
"""File handles kept back from connections: sockets to the engine, log files, the tokenizer."""

REFUSED_LINGER_S = 2.0
"""How long a connection refused with a 503 stays open for the client to read the answer."""

MAX_REFUSED_LINGERING = 64
"""Refused connections lingering at once (a quarter of FILE_RESERVE): past it, a plain close."""


def _refusal(max_connections: int) -> bytes:
    body = json.dumps(error_body(
        f"The server has {max_connections} open connections, its limit (--max-connections); "
        "retry shortly", "server_error")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (RETRY_AFTER_S, len(body))) + body


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

    refusal = _refusal(max_connections)
    num_lingering = 0

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._state_since_s = time.monotonic()
            self._seen_cycle: object | None = None
            self._is_refused = len(self.connections) > max_connections
            self._is_lingering = False
            if self._is_refused:
                self.connections.discard(self)  # the limit counts served connections only
                logger.warning("connection limit reached (%d open, --max-connections); answering "
                               "new connections 503", max_connections)
                self._refuse()
                return
            self._schedule_check()

        def _refuse(self) -> None:
            nonlocal num_lingering
            if num_lingering >= MAX_REFUSED_LINGERING or not self.transport.can_write_eof():
                self.transport.write(refusal)  # a TLS transport cannot half-close: best effort
                self.transport.close()
                return
            num_lingering += 1
            self._is_lingering = True
            self.transport.write(refusal)
            self.transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            nonlocal num_lingering
            if self._is_lingering:
                num_lingering -= 1
                self._is_lingering = False
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._is_refused:
                return  # answered already; read and dropped so that closing sends no reset
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
