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
- Every pull gets exactly one reply; every parked block list is released exactly once, after
  its blocks were sent (a one-sided write in flight keeps them until it ends, ``sending``).
- Every cancel gets a ``cancelled`` reply once no write for its key is in flight (a one-sided
  decode side keeps the destination blocks until then).

How the bytes travel is the backend's (``transport.py``); this class keeps the protocol.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from servelm.cache.block_pool import BlockPool
from servelm.config import DisaggregationConfig
from servelm.disagg import transfer, transport
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


@dataclass(slots=True)
class _Sending:
    """A pull whose K/V is being written (a one-sided backend's write in flight)."""

    identity: bytes
    parked: Parked
    reply: dict[str, Any]
    num_tokens: int
    start_s: float
    deadline_s: float
    cancelled_by: bytes | None = None
    """The identity of a decode engine that cancelled the key meanwhile (acked at the end)."""


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
        self.backend = config.transfer_backend
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
        self.sending: dict[str, _Sending] = {}
        """Keys whose K/V is being written to the decode pool (their blocks still held)."""
        self.stats = PrefillStats()
        try:
            self.sender = transport.make_sender(self.backend, cache, self.timeout_s, engine_id,
                                                 config.disaggregation_ib_device)
        except BaseException:
            self.socket.close()
            raise

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
        return sum(len(p.block_ids) for p in (*self.parked.values(),
                                               *(s.parked for s in self.sending.values())))

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
                self._cancel(identity, message["key"])
            elif message.get("type") == "pull":
                self._answer(identity, message)
        now = time.monotonic()
        for key, outcome in self.sender.poll(now):
            self._complete(self.sending.pop(key), outcome)
        self._expire(now)

    def close(self) -> None:
        self.sender.close()
        self.socket.close(linger=0)
        self.context.term()

    # -- internals --------------------------------------------------------------------------
    def _cancel(self, identity: bytes, key: str) -> None:
        parked = self.parked.pop(key, None)
        self.pulls.pop(key, None)
        self.stats.num_cancelled += 1
        if parked is not None:
            self.block_pool.release(parked.block_ids)
        elif key in self.live:
            self.cancelled[key] = time.monotonic() + self.timeout_s
        sending = self.sending.get(key)
        if sending is not None:  # acked when the write in flight ends
            sending.cancelled_by = identity
        else:
            self.socket.send_multipart([identity, transfer.header({"type": "cancelled", "key": key})])

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
        backend = message.get("backend", self.backend)
        if backend != self.backend and transport.ONE_SIDED & {backend, self.backend}:
            self._error(identity, key, f"the prefill server moves K/V with --disaggregation-"
                        f"transfer-backend {self.backend}, the decode server with {backend}; "
                        "give both the same")
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
        if not self._send(identity, message, parked):
            self.block_pool.release(parked.block_ids)

    def _send(self, identity: bytes, message: dict[str, Any], parked: Parked) -> bool:
        """Reply to the pull with the parked K/V; True while the write is in flight (the blocks
        are released when it ends)."""
        start_s = time.perf_counter()
        key = parked.key
        num_prompt = len(parked.prompt_token_ids)
        if message.get("num_prompt_tokens") != num_prompt or \
                message.get("prompt_sha256") != transfer.prompt_digest(parked.prompt_token_ids):
            self._error(identity, key, "the decode server's prompt differs from the prefill "
                        "server's (same model, tokenizer and chat template on both)")
            return False
        block_size = self.cache.block_size
        prefix = int(message.get("prefix_tokens", 0))
        if prefix % block_size or not 0 <= prefix < num_prompt:
            self._error(identity, key, f"bad prefix_tokens {prefix}")
            return False
        blocks = parked.block_ids[prefix // block_size:-(-num_prompt // block_size)]
        reply: dict[str, Any] = {
            "type": "kv", "key": key, "first_token": parked.first_token,
            "logprob": transfer.encode_logprob(parked.logprob), "num_blocks": len(blocks),
            "bytes_per_block": transfer.bytes_per_block(self.cache), "engine_id": self.engine_id}
        sending = _Sending(identity, parked, reply, num_prompt - prefix, start_s,
                           time.monotonic() + self.timeout_s)
        outcome = self.sender.start(key, message, blocks)
        if outcome is None:
            self.sending[key] = sending
            return True
        self._complete(sending, outcome, release=False)
        return False

    def _complete(self, sending: _Sending, outcome: transport.Outcome, release: bool = True) -> None:
        """A send ended: reply (K/V or error), ack a cancel that came meanwhile, free the blocks
        (``release``: they were held for a write in flight)."""
        key = sending.parked.key
        if outcome.error is not None:
            self._error(sending.identity, key, outcome.error)
        else:
            stats = self.stats  # counted before the reply goes: a reader who saw it sees them
            stats.num_transfers += 1
            stats.num_bytes_sent += outcome.num_bytes
            stats.num_tokens_sent += sending.num_tokens
            stats.send_time_s += time.perf_counter() - sending.start_s
            self.socket.send_multipart([sending.identity,
                                        transfer.header({**sending.reply, **outcome.fields}),
                                        *outcome.frames])
        if sending.cancelled_by is not None:
            self.socket.send_multipart([sending.cancelled_by,
                                        transfer.header({"type": "cancelled", "key": key})])
        if release:
            self.block_pool.release(sending.parked.block_ids)

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
        for key in [k for k, s in self.sending.items() if s.deadline_s < now]:
            if self.sender.abandon(key):
                self._complete(self.sending.pop(key), transport.Outcome(
                    error=f"the K/V write did not finish within {self.timeout_s:g} s"))
            else:  # the write may still read the blocks: keep them, try again later
                self.sending[key].deadline_s = now + self.timeout_s

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
                "disaggregation_num_cancelled": stats.num_cancelled,
                "disaggregation_num_sending": len(self.sending)}
