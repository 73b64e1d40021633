"""The router's view of its workers: one Worker per server URL, grouped in pools by role.

Invariants:
- A worker joins the rotation (``is_healthy``) at its first passed health probe and leaves it
  when ``failure_threshold`` probes fail in a row, or at once when a connection to it is refused
  while routing; it comes back after ``success_threshold`` probes pass in a row. Removal
  (``/remove_worker``) deletes it instead.
- ``num_in_flight`` counts the requests this router has open on the worker: incremented before a
  request is sent, decremented when its response is closed, whatever the outcome.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlparse


class Role(str, Enum):
    """What a worker does: a whole request (``normal``), or one half of a PD pair."""

    NORMAL = "normal"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Worker:
    """One server the router sends requests to, with its counters for /metrics."""

    url: str
    role: Role
    bootstrap_port: int | None = None
    """Prefill servers: the port of their KV bootstrap server (None until known)."""
    is_healthy: bool = False
    """In rotation; a new worker joins at its first passed probe."""
    has_been_healthy: bool = False
    num_in_flight: int = 0
    num_requests: int = 0
    num_errors: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0

    @property
    def bootstrap_host(self) -> str:
        """The host part of the URL, as SGLang's PD protocol puts it in ``bootstrap_host``."""
        host = urlparse(self.url).hostname or ""
        try:
            if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
                return f"[{host}]"
        except ValueError:
            pass
        return host

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "role": self.role.value, "is_healthy": self.is_healthy,
                "bootstrap_port": self.bootstrap_port, "num_in_flight": self.num_in_flight,
                "num_requests": self.num_requests, "num_errors": self.num_errors}

    def record_probe(self, is_ok: bool, failure_threshold: int, success_threshold: int) -> bool:
        """Count one health probe; True when it changed ``is_healthy``."""
        if is_ok:
            self.consecutive_failures = 0
            self.consecutive_successes += 1
            needed = success_threshold if self.has_been_healthy else 1
            if not self.is_healthy and self.consecutive_successes >= needed:
                self.is_healthy = self.has_been_healthy = True
                return True
        else:
            self.consecutive_successes = 0
            self.consecutive_failures += 1
            if self.is_healthy and self.consecutive_failures >= failure_threshold:
                self.is_healthy = False
                return True
        return False

    def mark_down(self) -> None:
        """A connection was refused: out of rotation until probes pass again."""
        self.is_healthy = False
        self.consecutive_successes = 0
        self.consecutive_failures = max(self.consecutive_failures, 1)


class Registry:
    """All workers by URL; a URL has one role."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}

    def add(self, url: str, role: Role, bootstrap_port: int | None = None) -> Worker:
        """Add (or re-role) a worker; an existing one keeps its counters."""
        worker = self._workers.get(url)
        if worker is None or worker.role != role:
            worker = Worker(url, role, bootstrap_port)
            self._workers[url] = worker
        elif bootstrap_port is not None:
            worker.bootstrap_port = bootstrap_port
        return worker

    def remove(self, url: str) -> Worker | None:
        return self._workers.pop(url, None)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def pool(self, role: Role) -> list[Worker]:
        """Workers of one role in the order they were added (healthy or not)."""
        return [w for w in self._workers.values() if w.role == role]

    def healthy(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.is_healthy]

    @property
    def is_pd(self) -> bool:
        """Requests go to prefill/decode pairs once any prefill or decode server is known."""
        return any(w.role != Role.NORMAL for w in self._workers.values())
