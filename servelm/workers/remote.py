"""The ranks on other nodes, seen from the driver (rank 0): how their steps reach them, how we
know they are gone, and what node 0 publishes for the other nodes to find it.

Node 0 serves the torch.distributed rendezvous (a TCPStore at ``--dist-init-addr``). It binds one
ZMQ PUSH socket per remote rank (TCP, on the init address's host, an ephemeral port) and its reply
PULL socket on TCP too, then writes ``NodeLayout`` (JSON) under ``LAYOUT_KEY`` in the store. A node
``R > 0`` reads it, checks that it runs the same protocol, model and layout, and starts its ranks
with those addresses: the worker loop is the one local ranks run, only the transport differs.

Invariants:
- Each remote rank's command socket has exactly one peer, that rank. A ZMQ socket monitor reports
  its connections: once a peer has completed the ZMTP handshake, its disconnection (the process
  died, its node went away, or ZMQ heartbeats stopped for ``HEARTBEAT_TIMEOUT_MS``) marks the rank
  gone for good. The engine then fails the step and exits, as for a local rank.
- Like torch.distributed itself, these sockets are unauthenticated (pickled messages): multi-node
  servelm belongs on a trusted network.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import asdict, dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

LAYOUT_KEY = "servelm/layout"
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
"""A peer silent this long (no traffic, no heartbeat reply) is disconnected: a node that lost
power or its network, which sends no TCP reset."""


@dataclass(frozen=True)
class NodeLayout:
    """What node 0 publishes in the store for the other nodes (JSON)."""

    protocol_version: int
    model: str
    tensor_parallel_size: int
    nnodes: int
    reply_address: str
    """ZMQ address every remote rank pushes its replies to."""
    command_addresses: dict[str, str]
    """Global rank (as a string: JSON keys) -> ZMQ address that rank pulls its commands from."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeLayout:
        return cls(**json.loads(text))


def bind_host(host: str) -> str:
    """The IP address node 0 binds its sockets on: ``--dist-init-addr``'s host, resolved."""
    try:
        return socket.gethostbyname(host)
    except OSError as error:
        raise ValueError(f"--dist-init-addr host {host!r} does not resolve: {error}") from error


class RemoteRanks:
    """Command sockets for the ranks on other nodes, and which of them have gone.

    Thread-safe: the step loop and the watcher thread both ask ``gone()``.
    """

    def __init__(self, context: zmq.Context[Any], host_ip: str, ranks: list[int]) -> None:
        self.sockets: dict[int, zmq.Socket[Any]] = {}
        self._monitors: dict[int, zmq.Socket[Any]] = {}
        self._joined: set[int] = set()
        self._gone: set[int] = set()
        self._lock = threading.Lock()
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        for rank in ranks:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
            push.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            push.bind(f"tcp://{host_ip}:*")
            self._monitors[rank] = push.get_monitor_socket(events)
            self.sockets[rank] = push

    def addresses(self) -> dict[str, str]:
        return {str(rank): push.getsockopt_string(zmq.LAST_ENDPOINT)
                for rank, push in self.sockets.items()}

    def _drain_events(self) -> None:
        for rank, monitor in self._monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._joined.add(rank)
                elif event == zmq.EVENT_DISCONNECTED and rank in self._joined:
                    self._gone.add(rank)

    def gone(self) -> list[int]:
        """Remote ranks that connected and then disconnected (dead, or their node is)."""
        with self._lock:
            self._drain_events()
            return sorted(self._gone)

    def close(self, linger_ms: int) -> None:
        """Close the sockets, leaving ``linger_ms`` for queued messages (Shutdown) to go out."""
        with self._lock:
            for rank, push in self.sockets.items():
                push.disable_monitor()
                self._monitors[rank].close(linger=0)
                push.close(linger=linger_ms)
