"""Which data-parallel replica serves the next request (``--load-balance-method``).

The front end dispatches each request to one engine replica and keeps its aborts and outputs
there. The balancer sees what the front end knows without asking anyone: the requests and
tokens it has sent to each replica and not yet seen finish. That view is exact and current
(the replicas' own reports lag by up to a step), and choosing costs no round trip.

Policies (SGLang's names):
- ``round_robin``: replicas in turn, whatever their load.
- ``shortest_queue``: the replica with the fewest unfinished requests.
- ``minimum_tokens``: the replica with the fewest unfinished tokens (each request counts its
  prompt plus its output budget until it finishes).
Ties go to the lowest replica index, so dispatch is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")


@dataclass
class ReplicaLoad:
    """One replica's unfinished work as the front end sees it, and what it has served."""

    running_requests: int = 0
    running_tokens: int = 0
    served_requests: int = 0


@dataclass
class LoadBalancer:
    """Chooses a replica per request; ``finish`` must be called once per ``choose``."""

    method: str
    num_replicas: int
    loads: list[ReplicaLoad] = field(init=False)
    _next: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load-balance method {self.method!r} "
                             f"(choose from {', '.join(LOAD_BALANCE_METHODS)})")
        if self.num_replicas < 1:
            raise ValueError(f"need at least one replica, got {self.num_replicas}")
        self.loads = [ReplicaLoad() for _ in range(self.num_replicas)]

    def choose(self, num_tokens: int) -> int:
        """The replica for a request of ``num_tokens`` (prompt + output budget); counts it."""
        if self.method == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % self.num_replicas
        elif self.method == "shortest_queue":
            replica = min(range(self.num_replicas), key=lambda i: self.loads[i].running_requests)
        else:
            replica = min(range(self.num_replicas), key=lambda i: self.loads[i].running_tokens)
        load = self.loads[replica]
        load.running_requests += 1
        load.running_tokens += num_tokens
        load.served_requests += 1
        return replica

    def finish(self, replica: int, num_tokens: int) -> None:
        """A request ``choose`` sent to ``replica`` with ``num_tokens`` is over."""
        load = self.loads[replica]
        load.running_requests -= 1
        load.running_tokens -= num_tokens
