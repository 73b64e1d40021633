"""The decode side's transport, inside the decode server's engine process: one pyzmq DEALER
socket per prefill server (``host:port``), pulls out, replies in.

It knows keys, prompts and block ids, never requests: ``engine/disaggregation.py`` decides what
to pull and what a reply means for a request.

Invariants: a reply is matched to its pull by key; a reply whose key nobody waits for (the
request ended meanwhile) is dropped and its shm file deleted, so nothing leaks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from servelm.config import DisaggregationConfig
from servelm.disagg import transfer
from servelm.model.kv_cache import KVCache
from servelm.sampling.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


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

    def __init__(self, config: DisaggregationConfig, cache: KVCache) -> None:
        self.cache = cache
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
        self._socket(host, port).send_multipart([transfer.header({
            "type": "pull", "key": key, "num_prompt_tokens": len(prompt_token_ids),
            "prompt_sha256": transfer.prompt_digest(prompt_token_ids),
            "prefix_tokens": prefix_tokens, "layout": self.layout,
            "tp_size": transfer.tp_size(self.cache)})])

    def cancel(self, key: str, host: str, port: int) -> None:
        """The request ended here: the prefill side may free what it parked for it."""
        self.destinations.pop(key, None)
        self._socket(host, port).send_multipart([transfer.header({"type": "cancel", "key": key})])

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
        block_ids = self.destinations.pop(key, None)
        shm_path = message.get("shm_path")
        if block_ids is None:  # the request ended while its K/V travelled
            if isinstance(shm_path, str) and shm_path.startswith(transfer.SHM_DIR + "/servelm-kv-"):
                try:
                    os.remove(shm_path)
                except FileNotFoundError:
                    pass
            return None
        if message.get("type") == "error":
            return Arrival(key, error=str(message.get("message")))
        start_s = time.perf_counter()
        try:
            num_blocks = int(message["num_blocks"])
            if num_blocks != len(block_ids):
                raise ValueError(f"{num_blocks} blocks arrived for {len(block_ids)} reserved")
            shape = (self.cache.num_layers, num_blocks, transfer.bytes_per_block(self.cache))
            if isinstance(shm_path, str):
                k, v = transfer.read_shm(shm_path, shape)
            else:
                k, v = transfer.frames_to_blocks(frames[1:3], shape)
            transfer.write_blocks(self.cache, block_ids, k, v)
        except (ValueError, KeyError, RuntimeError, OSError, TypeError) as error:
            return Arrival(key, error=f"the K/V from the prefill server could not be read: {error}")
        self.num_transfers += 1
        num_bytes = 2 * int(torch.Size(shape).numel())
        self.num_bytes_received += num_bytes
        self.receive_time_s += time.perf_counter() - start_s
        return Arrival(key, int(message["first_token"]), transfer.decode_logprob(message.get("logprob")),
                       num_bytes=num_bytes)

    def close(self) -> None:
        for peer, socket in self.sockets.items():
            socket.disable_monitor()
            self.monitors[peer].close(linger=0)
            socket.close(linger=0)
        self.context.term()
