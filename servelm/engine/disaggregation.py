"""The disaggregation stage of the engine step (``--disaggregation-mode prefill|decode``).

Prefill server: a request with a transfer runs as a one-token request (``max_tokens`` 1, as
SGLang's prefill server answers); when it finishes normally the scheduler parks its blocks and
this stage hands them to ``disagg/prefill.PrefillSide`` under the request's key, with the first
token (and its logprob), for the decode server's pull.

Decode server: a request with a transfer waits in the queue with ``is_awaiting_kv`` (``TransferState``) (the
scheduler never admits it). Before each schedule this stage reserves its blocks (its own cached
prefix shared, so only the rest is sent), pulls the K/V from the prefill server, and when it has
arrived admits the request and returns a synthetic step: the request's prompt counted as computed
and the prefill server's first token as its sampled token. The engine applies it with the normal
update (stop checks, grammar, detokenizer, outputs), so the request decodes on as if co-located.

Invariants: a pulled request that fails (error reply, timeout) ends with an error and frees its
blocks; one that ends here first (abort, client gone) tells the prefill side to free its K/V.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from servelm.config import EngineConfig
from servelm.disagg.decode import Arrival, DecodeClient
from servelm.disagg.prefill import Parked, PrefillSide
from servelm.disagg.spec import KVTransfer
from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.request import FinishReason, Request, TransferState
from servelm.engine.outputs import RequestOutput
from servelm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, StepResult
from servelm.engine.stage import Refusal, Refuses, Stage, StepCore

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
"""How long a decode engine with nothing to compute waits for K/V per step."""
LOST_PEER_GRACE_S = 2.0
"""A prefill server whose connection dropped (killed, restarting) fails its pulls after this long
without reconnecting, instead of waiting out the whole transfer timeout."""


CO_LOCATED = Refuses(lambda submission: submission.kv_transfer is not None,
                    "this server runs co-located (--disaggregation-mode null): it takes no K/V transfers")
"""The stage of a co-located server (the default): it refuses K/V transfers."""


def reserve_remote(scheduler: Scheduler, request: Request, reserve_tokens: int) -> bool:
    """Give a waiting request whose prompt K/V comes from a prefill server its blocks: its cached
    prefix (shared) plus new blocks for the rest of the prompt. Refused (False, nothing held)
    while --max-running-requests run or the pool would keep fewer than ``reserve_tokens`` free
    slots per running request beyond it."""
    if len(scheduler.running) >= scheduler.config.max_running_requests:
        return False
    headroom = scheduler.kv.blocks_for(reserve_tokens) * (len(scheduler.running) + 1)
    return scheduler.kv.reserve(request, request.num_prompt_tokens, headroom)


def start_arrived(scheduler: Scheduler, request: Request) -> None:
    """The request's prompt K/V has arrived: it runs from here (the update appends its first
    token and counts the prompt computed)."""
    assert request.transfer is not None
    request.transfer.is_awaiting_kv = False
    scheduler.start(request)


@dataclass(slots=True)
class _Pending:
    """A decode request whose K/V is on its way."""

    request: Request
    transfer: KVTransfer
    deadline_s: float | None = None
    """Set when the pull is sent."""
    pulled_s: float = 0.0
    """When the pull was sent (monotonic)."""
    arrival: Arrival | None = None
    """The K/V arrived (written into the pool); admitted once its grammar is ready."""


class Disaggregation(Stage):
    """The prefill or the decode side of every transfer this engine takes part in (a stage:
    arrived K/V before the schedule, parked blocks handed over when a request finishes)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, kv_cache: Any) -> None:
        self.config = config.disaggregation
        self.mode = self.config.mode
        self.scheduler = scheduler
        self.engine_id = uuid.uuid4().hex[:12]
        self.timeout_s = self.config.disaggregation_transfer_timeout
        self.prefill = (PrefillSide(self.config, kv_cache, scheduler.kv.block_pool, self.engine_id)
                        if self.mode == "prefill" else None)
        self.decode = (DecodeClient(self.config, kv_cache, scheduler.kv.block_pool, self.engine_id)
                       if self.mode == "decode" else None)
        self.tp_size = config.parallel.tensor_parallel_size
        self._prefill_requests: dict[str, KVTransfer] = {}
        """prefill: request id -> its transfer, while the request is queued or running."""
        self._pending: dict[str, _Pending] = {}
        """decode: request id -> its pull, until the request is admitted or ends."""
        self._num_polls = 0
        self.num_failed = 0
        self.pull_time_s = 0.0
        """Sum over arrived transfers of the time from the pull to the K/V written here."""

    def describe(self) -> dict[str, Any]:
        """What /get_server_info reports about the role (model_info)."""
        return {"disaggregation_mode": self.mode,
                "disaggregation_bootstrap_port": self.config.disaggregation_bootstrap_port,
                "disaggregation_transfer_backend": self.config.transfer_backend,
                "disaggregation_engine_id": self.engine_id}

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        """Why this engine cannot take part in the request's transfer, or None."""
        transfer = submission.kv_transfer
        if transfer is None:
            return None
        if transfer.role != self.mode:
            return Refusal(f"this server runs --disaggregation-mode {self.mode}; the request asks "
                           f"for the {transfer.role} side")
        if self.mode == "decode" and request.params.prompt_logprobs is not None:
            return Refusal("prompt logprobs are computed by the prefill server; a decode server "
                           "cannot return them")
        if self.mode == "decode" and any(p.transfer == transfer for p in self._pending.values()):
            return Refusal(f"transfer {transfer.key} is already in progress (a bootstrap_room used twice)")
        return None

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        if submission.kv_transfer is not None:
            self.add(request, submission.kv_transfer)
        return False

    def add(self, request: Request, transfer: KVTransfer) -> None:
        """Take part in the request's transfer (``check`` passed)."""
        if self.prefill is not None:
            key = transfer.key or request.request_id
            request.transfer = TransferState(key=key)
            params = request.params
            request.params = dataclasses.replace(params, max_tokens=1,
                                                 min_tokens=min(params.min_tokens, 1))
            self._prefill_requests[request.request_id] = transfer
            self.prefill.start(key)
        else:
            request.transfer = TransferState(is_awaiting_kv=True)
            self._pending[request.request_id] = _Pending(request, transfer)

    def on_finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended: a prefill request's blocks go to the prefill side. Returns vLLM's
        ``kv_transfer_params`` for the response (without host and port, the front end's)."""
        transfer = self._prefill_requests.pop(request.request_id, None)
        if transfer is None or self.prefill is None:
            return None
        state = request.transfer
        assert state is not None and state.key is not None
        key = state.key
        parked = None
        if state.parked_block_ids:
            logprob = request.pending_logprobs[0] if request.pending_logprobs else None
            parked = Parked(key, state.parked_block_ids, list(request.prompt_token_ids),
                            request.output_token_ids[0], logprob,
                            time.monotonic() + self.timeout_s)
            block_ids = list(state.parked_block_ids)
            state.parked_block_ids = []
        reason = request.error or (request.finish_reason.value if request.finish_reason else "ended")
        self.prefill.finish(key, parked, reason)
        if not transfer.is_vllm or parked is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": key,
                "remote_engine_id": self.engine_id, "remote_block_ids": block_ids, "tp_size": self.tp_size}

    @property
    def is_waiting(self) -> bool:
        """A decode request waits for K/V, or a prefill side's write is in flight: an otherwise
        idle step should wait briefly, then step again."""
        return bool(self._pending) or (self.prefill is not None and bool(self.prefill.sending))

    def wait(self) -> None:
        if self.decode is not None:
            self.decode.wait(IDLE_WAIT_S)
        elif self.prefill is not None:
            self.prefill.socket.poll(1)

    def sockets(self) -> list[Any]:
        """Sockets the engine process should wake up for (the prefill side's bootstrap endpoint)."""
        return [self.prefill.socket] if self.prefill is not None else []

    # -- the stage's hooks ------------------------------------------------------------------
    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        """K/V that arrived: those requests' first tokens, applied with the normal update."""
        output, results = self.poll(len(self.scheduler.running))
        if output.scheduled or output.finished:
            return core.apply(output, results)
        return []

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        if request.finish_reason is not FinishReason.ABORT:  # an abort leaves its transfer alone
            output.kv_transfer_params = self.on_finished(request)

    def wait_idle(self) -> bool:
        if not self.is_waiting:
            return False
        self.wait()
        return True

    # -- the step ---------------------------------------------------------------------------
    def poll(self, num_running: int) -> tuple[SchedulerOutput, list[StepResult]]:
        """Prefill: answer pulls. Decode: reserve, pull, and admit what arrived; returns the
        synthetic step that gives arrived requests their first token (apply it with the engine's
        update)."""
        output, results = SchedulerOutput(), list[StepResult]()
        if self.prefill is not None:
            self.prefill.poll()
            return output, results
        if self.decode is None or not (self._pending or self.decode.holds):
            return output, results  # (held blocks wait for the prefill side's final reply)
        self._num_polls += 1
        interval = self.config.disaggregation_decode_polling_interval
        if num_running and self._num_polls % interval:
            return output, results
        now = time.monotonic()
        for arrival in self.decode.receive():
            pending = next((p for p in self._pending.values() if p.transfer.key == arrival.key
                            and p.deadline_s is not None and p.arrival is None), None)
            if pending is not None and arrival.is_waiting:
                pending.deadline_s = now + self.timeout_s
            elif pending is not None:
                pending.arrival = arrival
                self.pull_time_s += time.monotonic() - pending.pulled_s
        for request_id, pending in list(self._pending.items()):
            request = pending.request
            if request.is_finished:  # aborted (client gone) or failed its grammar
                self._drop(request_id, cancel=pending.deadline_s is not None)
            elif pending.arrival is not None and pending.arrival.error is not None:
                self._fail(request_id, pending.arrival.error, output)
            elif pending.arrival is not None:
                if not request.is_compiling:  # its grammar (if any) is ready too
                    self._admit(request_id, pending.arrival, output, results)
            elif pending.deadline_s is None:
                self._start_pull(pending)
            else:
                self._check_peer(request_id, pending, now, output)
        return output, results

    def _check_peer(self, request_id: str, pending: _Pending, now: float,
                    output: SchedulerOutput) -> None:
        """Fail a pull whose prefill server is gone: its connection dropped (for longer than
        LOST_PEER_GRACE_S), or it never answered within the timeout. While connected (zmq
        heartbeats, answered even during a long prefill step) the request waits, kept alive by
        the prefill server's ``waiting`` messages; the prefill server itself ends a pull it has no
        request for after the timeout."""
        assert self.decode is not None and pending.deadline_s is not None
        host, port = pending.transfer.host, pending.transfer.port
        assert host is not None and port is not None
        is_connected, lost_s = self.decode.peer_state(host, port)
        if lost_s is not None and lost_s >= pending.pulled_s and now - lost_s > LOST_PEER_GRACE_S:
            self._fail(request_id, f"the prefill server {host}:{port} closed the connection "
                       "during the transfer", output)
        elif now > pending.deadline_s and not is_connected:
            self._fail(request_id, f"no K/V from the prefill server {host}:{port} within "
                       f"{self.timeout_s:g} s (--disaggregation-transfer-timeout)", output)
        elif now > pending.deadline_s + 10 * self.timeout_s:  # connected, yet silent for far too long
            self._fail(request_id, f"the prefill server {host}:{port} sent no K/V or keep-alive "
                       f"for {11 * self.timeout_s:g} s", output)

    def _start_pull(self, pending: _Pending) -> None:
        assert self.decode is not None
        request, transfer = pending.request, pending.transfer
        if not reserve_remote(self.scheduler, request, self.config.num_reserved_decode_tokens):
            return  # no room yet: try again next step
        assert transfer.key is not None and transfer.host is not None and transfer.port is not None
        block_size = self.scheduler.kv.block_size
        prefix = request.num_computed_tokens
        self.decode.pull(transfer.key, transfer.host, transfer.port, request.prompt_token_ids,
                         prefix, request.block_ids[prefix // block_size:])
        pending.pulled_s = time.monotonic()
        pending.deadline_s = pending.pulled_s + self.timeout_s

    def _admit(self, request_id: str, arrival: Arrival, output: SchedulerOutput,
               results: list[StepResult]) -> None:
        request = self._pending.pop(request_id).request
        assert arrival.first_token is not None
        num_new = request.num_prompt_tokens - request.num_computed_tokens
        start_arrived(self.scheduler, request)
        output.scheduled.append(ScheduledRequest(request, num_new, 1, True, 0))
        logprobs = [arrival.logprob] if arrival.logprob is not None and \
            request.params.logprobs is not None else []
        results.append(StepResult([arrival.first_token], logprobs))

    def _fail(self, request_id: str, error: str, output: SchedulerOutput) -> None:
        pending = self._pending[request_id]
        logger.warning("request %s: %s", request_id, error)
        self.num_failed += 1
        self._drop(request_id, cancel=True)
        self.scheduler.finish(pending.request, FinishReason.ERROR, error=error, error_status=503)
        output.finished.append(pending.request)

    def _drop(self, request_id: str, cancel: bool) -> None:
        pending = self._pending.pop(request_id)
        transfer = pending.transfer
        if cancel and self.decode is not None and transfer.key is not None \
                and transfer.host is not None and transfer.port is not None:
            self.decode.cancel(transfer.key, transfer.host, transfer.port)

    def stats(self) -> dict[str, Any]:
        if self.prefill is not None:
            return self.prefill.describe()
        assert self.decode is not None
        return {"disaggregation_num_awaiting_kv": len(self._pending),
                "disaggregation_num_transfers": self.decode.num_transfers,
                "disaggregation_bytes_received": self.decode.num_bytes_received,
                "disaggregation_receive_time_s": round(self.decode.receive_time_s, 4),
                "disaggregation_pull_time_s": round(self.pull_time_s, 4),
                "disaggregation_num_held_blocks": self.decode.num_held_blocks,
                "disaggregation_num_failed": self.num_failed}

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
