"""The decode side's transport, inside the decode server's engine process: one pyzmq DEALER
socket per prefill server (``host:port``), pulls out, replies in.

It knows keys, prompts and block ids, never requests: ``engine/disaggregation.py`` decides what
to pull and what a reply means for a request.

Invariants: a reply is matched to its pull by key; a reply whose key nobody waits for (the
request ended meanwhile) is dropped and its shm file deleted, so nothing leaks. With a one-sided
backend (nixl, mooncake: the prefill side writes into this pool) a pull's destination blocks get
one more reference (``holds``) until its final reply (kv, error, or the ``cancelled`` answering
a cancel), until its prefill server's connection has been lost for LOST_PEER_RELEASE_S (or
was not up within the transfer timeout), or until 11 transfer timeouts have passed, so a late
write never lands in blocks given to another request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from servelm.cache.block_pool import BlockPool
from servelm.config import DisaggregationConfig
from servelm.disagg import transfer, transport
from servelm.model.kv_cache import KVCache
from servelm.sampling.logprobs import TokenLogprob

logger = logging.getLogger(__name__)

LOST_PEER_RELEASE_S = 2.0
"""A one-sided pull's held blocks go back this long after its prefill server's connection
dropped (a dead process writes nothing more)."""


@dataclass(slots=True)
class _Hold:
    """Destination blocks a one-sided peer may still write."""

    block_ids: list[int]
    peer: tuple[str, int]
    pulled_s: float
    deadline_s: float


@dataclass(slots=True)
class _Landing:
    """A ``kv`` reply whose K/V has not fully landed yet (a notification still on its way)."""

    message: dict[str, Any]
    frames: list[bytes]
    block_ids: list[int]
    deadline_s: float


@dataclass(slots=True)
class Arrival:
    """A reply to a pull: the K/V (written into the pool already) and the first token, or an error."""

    key: str
    first_token: int | None = None
    logprob: TokenLogprob | None = None
    error: str | None = None
    num_bytes: int = 0
    is_waiting: bool = False
    """Only a keep-alive: the prefill server still computes the request."""


class DecodeClient:
    """Pulls K/V from prefill servers and writes it into this engine's pool."""

    def __init__(self, config: DisaggregationConfig, cache: KVCache, block_pool: BlockPool,
                 engine_id: str) -> None:
        self.cache = cache
        self.block_pool = block_pool
        self.backend = config.transfer_backend
        self.timeout_s = config.disaggregation_transfer_timeout
        self.receiver = transport.make_receiver(self.backend, cache, engine_id,
                                                 config.disaggregation_ib_device)
        self.holds: dict[str, list[_Hold]] = {}
        """key -> destination blocks a one-sided prefill side may still write, oldest first."""
        self.landing: dict[str, _Landing] = {}
        self.layout = transfer.layout(cache)
        self.context = zmq.Context()
        self.sockets: dict[tuple[str, int], zmq.Socket[Any]] = {}
        self.monitors: dict[tuple[str, int], zmq.Socket[Any]] = {}
        self.lost_s: dict[tuple[str, int], float] = {}
        """Peers whose connection dropped after it was made, and when (the prefill server is
        gone, or restarting); removed when it connects again."""
        self.connected: set[tuple[str, int]] = set()
        self.destinations: dict[str, list[int]] = {}
        """key -> the block ids its K/V goes to (those after the decode side's cached prefix)."""
        self.num_bytes_received = 0
        self.receive_time_s = 0.0
        self.num_transfers = 0

    def _socket(self, host: str, port: int) -> zmq.Socket[Any]:
        socket = self.sockets.get((host, port))
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # answered by the peer's I/O thread,
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)  # even during a long prefill step
            self.monitors[(host, port)] = socket.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            socket.connect(f"tcp://{host}:{port}")
            self.sockets[(host, port)] = socket
        return socket

    def peer_state(self, host: str, port: int) -> tuple[bool, float | None]:
        """(connected now, since when the connection has been lost: None if it has not)."""
        peer = (host, port)
        monitor = self.monitors.get(peer)
        while monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected.add(peer)
                self.lost_s.pop(peer, None)
            elif event == zmq.EVENT_DISCONNECTED and peer in self.connected:
                self.connected.discard(peer)
                self.lost_s[peer] = time.monotonic()
        return peer in self.connected, self.lost_s.get(peer)

    def pull(self, key: str, host: str, port: int, prompt_token_ids: list[int],
             prefix_tokens: int, block_ids: list[int]) -> None:
        """Ask ``host:port`` for the key's K/V after ``prefix_tokens``; it lands in ``block_ids``."""
        self.destinations[key] = block_ids
        fields = self.receiver.pull_fields(key, host, block_ids)
        if self.receiver.is_one_sided:
            self.block_pool.retain(block_ids)
            now = time.monotonic()
            self.holds.setdefault(key, []).append(
                _Hold(list(block_ids), (host, port), now, now + 11 * self.timeout_s))
        self._socket(host, port).send_multipart([transfer.header({
            "type": "pull", "key": key, "num_prompt_tokens": len(prompt_token_ids),
            "prompt_sha256": transfer.prompt_digest(prompt_token_ids),
            "prefix_tokens": prefix_tokens, "layout": self.layout, "backend": self.backend,
            "tp_size": transfer.tp_size(self.cache), **fields})])

    def cancel(self, key: str, host: str, port: int) -> None:
        """The request ended here: the prefill side may free what it parked for it."""
        self.destinations.pop(key, None)
        landing = self.landing.pop(key, None)
        if landing is not None:
            self.receiver.discard(landing.message)
        self._socket(host, port).send_multipart([transfer.header({"type": "cancel", "key": key})])

    def _release_hold(self, key: str) -> None:
        holds = self.holds.get(key)
        if holds:
            self.block_pool.release(holds.pop(0).block_ids)
        if not holds:
            self.holds.pop(key, None)

    def _release_stale_holds(self) -> None:
        """Holds whose prefill server is gone, or that outlived every timeout."""
        now = time.monotonic()
        for key, holds in list(self.holds.items()):
            for hold in list(holds):
                is_connected, lost_s = self.peer_state(*hold.peer)
                is_lost = lost_s is not None and lost_s >= hold.pulled_s \
                    and now - lost_s > LOST_PEER_RELEASE_S
                never_reached = not is_connected and (lost_s is None or lost_s < hold.pulled_s) \
                    and now - hold.pulled_s > self.timeout_s  # the pull never left this host
                if is_lost or never_reached or now > hold.deadline_s:
                    holds.remove(hold)
                    self.block_pool.release(hold.block_ids)
            if not holds:
                del self.holds[key]

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.block_ids) for holds in self.holds.values() for h in holds)

    def wait(self, timeout_s: float) -> None:
        """Block until a reply arrives or ``timeout_s`` passes (an engine with nothing to compute)."""
        if not self.sockets:
            time.sleep(timeout_s)
            return
        poller = zmq.Poller()
        for socket in self.sockets.values():
            poller.register(socket, zmq.POLLIN)
        poller.poll(int(timeout_s * 1000))

    def receive(self) -> list[Arrival]:
        """The replies that have arrived, K/V already written into the pool."""
        arrivals = []
        for key, landing in list(self.landing.items()):
            arrival = self._land(key, landing)
            if arrival is not None:
                del self.landing[key]
                arrivals.append(arrival)
        if self.holds:
            self.receiver.progress()
            self._release_stale_holds()
        for socket in self.sockets.values():
            while socket.poll(0):
                frames = socket.recv_multipart()
                arrival = self._arrival(frames)
                if arrival is not None:
                    arrivals.append(arrival)
        return arrivals

    def _arrival(self, frames: list[bytes]) -> Arrival | None:
        try:
            message = transfer.parse_header(frames[0])
        except (ValueError, UnicodeDecodeError):
            logger.warning("ignoring a malformed transfer reply")
            return None
        key = message["key"]
        if message.get("type") == "waiting":
            return Arrival(key, is_waiting=True) if key in self.destinations else None
        if message.get("type") == "cancelled":  # the prefill side writes nothing more for it
            self._release_hold(key)
            return None
        self._release_hold(key)  # kv (the write is done) or error: the pull's final reply
        block_ids = self.destinations.pop(key, None)
        if block_ids is None:  # the request ended while its K/V travelled
            self.receiver.discard(message)
            return None
        if message.get("type") == "error":
            return Arrival(key, error=str(message.get("message")))
        landing = _Landing(message, frames[1:], block_ids, time.monotonic() + self.timeout_s)
        arrival = self._land(key, landing)
        if arrival is None:
            self.landing[key] = landing
        return arrival

    def _land(self, key: str, landing: _Landing) -> Arrival | None:
        """The reply's K/V into the pool: its Arrival, or None while it has not fully landed."""
        message, block_ids = landing.message, landing.block_ids
        start_s = time.perf_counter()
        try:
            num_blocks = int(message["num_blocks"])
            if num_blocks != len(block_ids):
                raise ValueError(f"{num_blocks} blocks arrived for {len(block_ids)} reserved")
            if not self.receiver.land(message, landing.frames, block_ids):
                if time.monotonic() < landing.deadline_s:
                    return None
                raise ValueError(f"the write's completion notice did not come within "
                                 f"{self.timeout_s:g} s")
        except (ValueError, KeyError, RuntimeError, OSError, TypeError) as error:
            return Arrival(key, error=f"the K/V from the prefill server could not be read: {error}")
        self.num_transfers += 1
        sides = 2 if self.cache.v_caches else 1   # a latent pool (MLA) holds no V of its own
        num_bytes = sides * int(torch.Size(transport.shape(self.cache, num_blocks)).numel())
        self.num_bytes_received += num_bytes
        self.receive_time_s += time.perf_counter() - start_s
        return Arrival(key, int(message["first_token"]), transfer.decode_logprob(message.get("logprob")),
                       num_bytes=num_bytes)

    def close(self) -> None:
        self.receiver.close()
        for peer, socket in self.sockets.items():
            socket.disable_monitor()
            self.monitors[peer].close(linger=0)
            socket.close(linger=0)
        self.context.term()
