"""The prefill side of a transfer, inside the prefill server's engine process.

The bootstrap endpoint is a pyzmq ROUTER bound on ``--disaggregation-bootstrap-port``; decode
engines connect DEALER sockets to it and ask for a key's K/V (``pull``).

Invariants:
- A request with a transfer key that finishes normally (its first token sampled) keeps its blocks:
  the scheduler hands them over instead of freeing them, and they are ``parked`` here under the
  key until a pull takes them, a ``cancel`` arrives or --disaggregation-transfer-timeout passes;
  then they are released (their full blocks stay in the prefix cache like any finished request's).
- A pull for a key not parked yet waits (the two servers get the request at the same time) until
  the request finishes, fails (``error`` reply) or the timeout passes (``error`` reply). While the
  key's request is queued or running here, the decode side hears ``waiting`` every third of the
  timeout, so a long queue or a slow grammar compile is not mistaken for a dead prefill server.
- Every pull gets exactly one reply; every parked block list is released exactly once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from servelm.cache.block_pool import BlockPool
from servelm.config import DisaggregationConfig
from servelm.disagg import transfer
from servelm.model.kv_cache import KVCache
from servelm.sampling.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Parked:
    """A finished prefill request's K/V, waiting for its decode server."""

    key: str
    block_ids: list[int]
    prompt_token_ids: list[int]
    first_token: int
    logprob: TokenLogprob | None
    deadline_s: float


@dataclass(slots=True)
class _Pull:
    identity: bytes
    message: dict[str, Any]
    deadline_s: float
    keepalive_s: float
    """When the decode side next hears ``waiting`` (while the request is queued or running here)."""


@dataclass
class PrefillStats:
    num_transfers: int = 0
    num_bytes_sent: int = 0
    num_tokens_sent: int = 0
    num_expired: int = 0
    num_cancelled: int = 0
    send_time_s: float = 0.0
    recent: list[dict[str, Any]] = field(default_factory=list)


class PrefillSide:
    """Parks finished prefill requests' blocks and answers decode engines' pulls."""

    def __init__(self, config: DisaggregationConfig, cache: KVCache, block_pool: BlockPool,
                 engine_id: str) -> None:
        self.config = config
        self.cache = cache
        self.block_pool = block_pool
        self.engine_id = engine_id
        self.timeout_s = config.disaggregation_transfer_timeout
        self.use_shm = config.transfer_backend == "shm"
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        try:
            self.socket.bind(f"tcp://*:{config.disaggregation_bootstrap_port}")
        except zmq.ZMQError as error:
            self.socket.close()
            raise ValueError(f"--disaggregation-bootstrap-port {config.disaggregation_bootstrap_port}: "
                             f"cannot listen ({error}); choose a free port") from None
        self.layout = transfer.layout(cache)
        self.decode_tp = config.disaggregation_decode_tp or transfer.tp_size(cache)
        """The --tp-size a decode server must run with (a pull says its own)."""
        self.parked: dict[str, Parked] = {}
        self.pulls: dict[str, _Pull] = {}
        """Pulls that arrived before their request finished."""
        self.live: set[str] = set()
        """Keys of requests still queued or running here."""
        self.failed: dict[str, tuple[str, float]] = {}
        """Keys whose request ended without K/V (abort, error): the reason, until the deadline."""
        self.cancelled: dict[str, float] = {}
        """Keys the decode side gave up on before the request finished here."""
        self.shm_files: list[tuple[str, float]] = []
        self.stats = PrefillStats()

    # -- the engine's calls -----------------------------------------------------------------
    def start(self, key: str) -> None:
        """A request with this key was queued here."""
        self.live.add(key)

    def finish(self, key: str, parked: Parked | None, reason: str) -> None:
        """The key's request ended: with its K/V parked (``parked``), or without (``reason``)."""
        self.live.discard(key)
        now = time.monotonic()
        if parked is None:
            self.failed[key] = (reason, now + self.timeout_s)
        elif self.cancelled.pop(key, None) is not None:
            self.block_pool.release(parked.block_ids)
        else:
            replaced = self.parked.pop(key, None)
            if replaced is not None:  # a room used twice: the older K/V can never be pulled now
                logger.warning("transfer %s: a newer request took its key; freeing the older K/V", key)
                self.block_pool.release(replaced.block_ids)
            self.parked[key] = parked
        pull = self.pulls.pop(key, None)
        if pull is not None:
            self._answer(pull.identity, pull.message)

    @property
    def num_parked_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self.parked.values())

    def poll(self) -> None:
        """Answer the pulls that have arrived; expire what waited too long. Never blocks."""
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            if len(frames) < 2:
                continue
            identity = frames[0]
            try:
                message = transfer.parse_header(frames[1])
            except (ValueError, UnicodeDecodeError):
                logger.warning("ignoring a malformed transfer message")
                continue
            if message.get("type") == "cancel":
                self._cancel(message["key"])
            elif message.get("type") == "pull":
                self._answer(identity, message)
        self._expire(time.monotonic())

    def close(self) -> None:
        for path, _ in self.shm_files:
            _remove(path)
        self.socket.close(linger=0)
        self.context.term()

    # -- internals --------------------------------------------------------------------------
    def _cancel(self, key: str) -> None:
        parked = self.parked.pop(key, None)
        self.pulls.pop(key, None)
        self.stats.num_cancelled += 1
        if parked is not None:
            self.block_pool.release(parked.block_ids)
        elif key in self.live:
            self.cancelled[key] = time.monotonic() + self.timeout_s

    def _answer(self, identity: bytes, message: dict[str, Any]) -> None:
        key = message["key"]
        if message.get("layout") != self.layout:
            self._error(identity, key, f"the prefill server's KV layout {self.layout} differs from "
                        f"the decode server's {message.get('layout')} (same model, --page-size and "
                        "--kv-cache-dtype on both)")
            return
        decode_tp = message.get("tp_size", 1)
        if decode_tp != self.decode_tp:
            self._error(identity, key, f"the decode server runs --tp-size {decode_tp}, but this "
                        f"prefill server expects {self.decode_tp} (--disaggregation-decode-tp; "
                        "unset, the prefill server's own --tp-size)")
            return
        parked = self.parked.pop(key, None)
        if parked is None:
            failure = self.failed.pop(key, None)
            if failure is not None:
                self._error(identity, key, f"the prefill request ended without K/V: {failure[0]}")
            else:  # not finished (or not arrived) yet: answered when it finishes, or on timeout
                now = time.monotonic()
                self.pulls[key] = _Pull(identity, message, now + self.timeout_s,
                                        now + self.timeout_s / 3)
            return
        try:
            self._send(identity, message, parked)
        finally:
            self.block_pool.release(parked.block_ids)

    def _send(self, identity: bytes, message: dict[str, Any], parked: Parked) -> None:
        start_s = time.perf_counter()
        key = parked.key
        num_prompt = len(parked.prompt_token_ids)
        if message.get("num_prompt_tokens") != num_prompt or \
                message.get("prompt_sha256") != transfer.prompt_digest(parked.prompt_token_ids):
            self._error(identity, key, "the decode server's prompt differs from the prefill "
                        "server's (same model, tokenizer and chat template on both)")
            return
        block_size = self.cache.block_size
        prefix = int(message.get("prefix_tokens", 0))
        if prefix % block_size or not 0 <= prefix < num_prompt:
            self._error(identity, key, f"bad prefix_tokens {prefix}")
            return
        blocks = parked.block_ids[prefix // block_size:-(-num_prompt // block_size)]
        k, v = transfer.read_blocks(self.cache, blocks)
        reply: dict[str, Any] = {
            "type": "kv", "key": key, "first_token": parked.first_token,
            "logprob": transfer.encode_logprob(parked.logprob), "num_blocks": len(blocks),
            "bytes_per_block": transfer.bytes_per_block(self.cache), "engine_id": self.engine_id}
        if self.use_shm:
            path = transfer.write_shm(k, v)
            self.shm_files.append((path, time.monotonic() + self.timeout_s))
            reply["shm_path"] = path
            self.socket.send_multipart([identity, transfer.header(reply)])
        else:
            self.socket.send_multipart([identity, transfer.header(reply), k.numpy().tobytes(),
                                        v.numpy().tobytes()])
        stats = self.stats
        stats.num_transfers += 1
        stats.num_bytes_sent += k.numel() + v.numel()
        stats.num_tokens_sent += num_prompt - prefix
        stats.send_time_s += time.perf_counter() - start_s

    def _error(self, identity: bytes, key: str, text: str) -> None:
        logger.warning("transfer %s refused: %s", key, text)
        self.socket.send_multipart([identity, transfer.header(
            {"type": "error", "key": key, "message": text})])

    def _expire(self, now: float) -> None:
        for key in [k for k, p in self.parked.items() if p.deadline_s < now]:
            parked = self.parked.pop(key)
            self.block_pool.release(parked.block_ids)
            self.stats.num_expired += 1
            logger.warning("transfer %s: no decode server pulled its K/V within %g s; freed",
                           key, self.timeout_s)
        for key, pull in self.pulls.items():
            if key in self.live and pull.keepalive_s < now:  # still computing: keep the decode side waiting
                pull.deadline_s, pull.keepalive_s = now + self.timeout_s, now + self.timeout_s / 3
                self.socket.send_multipart([pull.identity, transfer.header(
                    {"type": "waiting", "key": key})])
        for key in [k for k, p in self.pulls.items() if p.deadline_s < now]:
            pull = self.pulls.pop(key)
            self._error(pull.identity, key, f"the prefill server did not finish the request within "
                        f"{self.timeout_s:g} s (was it sent to this prefill server?)")
        for key in [k for k, (_, deadline) in self.failed.items() if deadline < now]:
            del self.failed[key]
        for key in [k for k, deadline in self.cancelled.items() if deadline < now]:
            del self.cancelled[key]
        while self.shm_files and self.shm_files[0][1] < now:
            _remove(self.shm_files.pop(0)[0])

    def describe(self) -> dict[str, Any]:
        stats = self.stats
        return {"disaggregation_num_parked": len(self.parked),
                "disaggregation_num_parked_blocks": self.num_parked_blocks,
                "disaggregation_num_waiting_pulls": len(self.pulls),
                "disaggregation_num_transfers": stats.num_transfers,
                "disaggregation_bytes_sent": stats.num_bytes_sent,
                "disaggregation_tokens_sent": stats.num_tokens_sent,
                "disaggregation_send_time_s": round(stats.send_time_s, 4),
                "disaggregation_num_expired": stats.num_expired,
                "disaggregation_num_cancelled": stats.num_cancelled}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
