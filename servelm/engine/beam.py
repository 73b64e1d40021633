"""Beam search: ``width`` beams per prompt, scored by cumulative log-probability, sharing K/V.

A search is a stage beside the scheduler, like speculation: its beams are ordinary scheduler
requests (``Request.beam`` set) that the scheduler computes, chunks, preempts and caches like any other.
Only their sampled rows are different: the scheduler appends nothing, and ``update`` reads each
beam's top candidates (``params.logprobs``: the raw model log-probabilities) instead. Once every
live beam has its candidates, the search takes one step of transformers' beam search
(``GenerationMixin._beam_search``; the semantics are theirs, the code is ours):

- the best ``K = max(2, 1 + number of stop ids) * width`` continuations of all beams, by
  cumulative log-probability;
- those of the first ``width`` that end (EOS or a stop token, a stop string, max_tokens, the
  context) become finished hypotheses scored ``sum_logprobs / num_output_tokens ** length_penalty``
  (the best ``width`` are kept), unless the search is full under ``early_stopping=True`` or no
  running beam can improve on them any more;
- the best ``width`` that do not end are the next beams.

It stops when nothing can improve (``early_stopping`` False: judged at the current length;
"never": at max_tokens when the penalty favours length), when ``width`` hypotheses finished under
``early_stopping=True``, or when no continuation goes on.

Beams share blocks: a beam's first child continues in its request; each further child is a new
request holding references to the parent's full blocks and a copy of its partial last block
(copy-on-write: a (source, destination) pair the next forward copies before writing, so each beam
writes its next token into its own block). A beam with no child is finished at once and its
blocks go back to the pool (or stay in the prefix cache).

One search serves the ``num_returns`` client requests of one prompt (the server's n choices, each
with its ``rank``): they hold no blocks and are answered once, best first, when the search ends.
Streaming is therefore not incremental (the server refuses it). A client request joining a search
that already has its rank starts a new one: results never depend on how requests were batched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.outputs import RequestOutput
from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.request import BeamState, FinishReason, Request, RequestStatus
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.stage import Refusal, Stage
from servelm.sampling.params import BeamParams, SamplingParams

PARKED = "its beam search's next step"
"""``Request.held_by`` of a preempted beam that has its candidates: not admitted again until its
search has picked its next token (its siblings go first)."""
_MAX_LOGPROBS = 20
"""What SamplingParams lets a user ask for; a search asks its beams for more (internal params)."""


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]
    sum_logprobs: float
    score: float
    """``sum_logprobs / len(token_ids) ** length_penalty``: what hypotheses are ranked by."""
    finish_reason: FinishReason
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Candidate:
    sum_logprobs: float
    parent: Request
    token_id: int
    ending: tuple[FinishReason, int | str | None] | None = None
    """Why the beam would end with this token; None: it goes on."""


@dataclass
class BeamSearch:
    """One prompt's search: live beams (best first), finished hypotheses, the requests served."""

    search_id: str
    params: SamplingParams
    """The client's parameters (``params.beam`` set)."""
    receiver: Request
    """The first client request: prompt, priority, group and adapter of every beam."""
    num_candidates: int
    receivers: dict[int, str] = field(default_factory=dict)
    """Rank -> client request id."""
    beams: list[Request] = field(default_factory=list)
    sum_logprobs: dict[str, float] = field(default_factory=dict)
    """Beam request id -> cumulative log-probability of its output tokens."""
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Beam request id -> its top (token id, logprob) pairs after its last token."""
    finished: list[Hypothesis] = field(default_factory=list)
    num_output_tokens: int = 0
    is_improvement_possible: bool = True
    num_forks: int = 0

    @property
    def beam(self) -> BeamParams:
        assert self.params.beam is not None
        return self.params.beam

    @property
    def is_full(self) -> bool:
        return len(self.finished) >= self.beam.width


class BeamSearches(Stage):
    """Every running beam search of one engine, fed by the step's results (a stage: it answers
    for its client requests' ids, and reads the beams' candidates after each update)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None, is_speculating: bool = False) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.is_speculating = is_speculating
        """--speculative-algorithm is set: beam-search requests are refused."""
        self._searches: dict[str, BeamSearch] = {}
        """Search id (its first client request id) -> search."""
        self._open: dict[str, BeamSearch] = {}
        """Join key (group, prompt, parameters) -> the search new ranks join."""
        self._by_receiver: dict[str, BeamSearch] = {}
        self._by_beam: dict[str, BeamSearch] = {}
        self.num_searches = 0
        self.num_forks = 0
        """Beams started from another beam's blocks (not counting each search's first beam)."""
        self.num_block_copies = 0
        """Partial blocks copied on write at a fork."""

    def stats(self) -> dict[str, int]:
        return {"num_beam_searches": self.num_searches, "num_running_beam_searches": len(self._searches),
                "num_beam_forks": self.num_forks, "num_beam_block_copies": self.num_block_copies}

    def owns(self, request_id: str) -> bool:
        return request_id in self._by_receiver

    # -- requests ---------------------------------------------------------------------------
    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        if request.params.beam is not None and self.is_speculating:
            return Refusal("beam search is not supported with speculative decoding "
                           "(--speculative-algorithm)")
        return None

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        """Take a beam-search client request: its search's beams are the scheduler's requests."""
        if request.params.beam is None:
            return False
        self.add(request)
        return True

    def add(self, request: Request) -> None:
        """Serve a client request (validated by the engine) from the search of its prompt."""
        beam = request.params.beam
        assert beam is not None
        key = self._join_key(request)
        search = self._open.get(key)
        if search is None or beam.rank in search.receivers:
            search = self._start(request)
            self._open[key] = search
        search.receivers[beam.rank] = request.request_id
        self._by_receiver[request.request_id] = search

    @staticmethod
    def _join_key(request: Request) -> str:
        beam = request.params.beam
        assert beam is not None
        params = dataclasses.replace(request.params, beam=dataclasses.replace(beam, rank=0))
        return repr((request.group, request.prompt_token_ids, params, request.adapter_id))

    def _start(self, request: Request) -> BeamSearch:
        params = request.params
        assert params.beam is not None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        num_candidates = max(2, 1 + len(stop_ids)) * params.beam.width
        search = BeamSearch(f"{request.request_id}#beam", params, request, num_candidates)
        first = self._new_beam(search, [])
        search.beams.append(first)
        self._searches[search.search_id] = search
        self.scheduler.add_request(first)
        self.num_searches += 1
        return search

    def _new_beam(self, search: BeamSearch, output_token_ids: list[int]) -> Request:
        """A scheduler request for one beam; it samples greedily and reports its candidates."""
        receiver = search.receiver
        params = SamplingParams(max_tokens=search.params.max_tokens, temperature=0.0,
                                ignore_eos=True, logprobs=min(search.num_candidates, _MAX_LOGPROBS))
        params.logprobs = search.num_candidates  # internal: may exceed what users may ask for
        beam = Request(request_id=f"{search.search_id}{search.num_forks}",
                       prompt_token_ids=receiver.prompt_token_ids, params=params,
                       eos_token_ids=receiver.eos_token_ids,
                       max_context_tokens=receiver.max_context_tokens,
                       output_token_ids=output_token_ids, priority=receiver.priority,
                       group=receiver.group,
                       lora=dataclasses.replace(receiver.lora) if receiver.lora is not None else None,
                       beam=BeamState(search.search_id), mm_inputs=receiver.mm_inputs)
        search.num_forks += 1
        search.sum_logprobs[beam.request_id] = 0.0
        self._by_beam[beam.request_id] = search
        return beam

    def abort(self, request_id: str) -> RequestOutput | None:
        """End one client request; the search stops when nobody waits for it any more."""
        search = self._by_receiver.pop(request_id, None)
        if search is None:
            return None
        search.receivers = {r: i for r, i in search.receivers.items() if i != request_id}
        if not search.receivers:
            self._close(search, FinishReason.ABORT)
        return RequestOutput(request_id, [], "", finish_reason=FinishReason.ABORT.value,
                             num_prompt_tokens=search.receiver.num_prompt_tokens)

    # -- the step ---------------------------------------------------------------------------
    def after_update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        return self.update(output, results) if self._searches else []

    def update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        """Read the beams' candidates from this step; advance (and answer) complete searches."""
        ready: dict[str, BeamSearch] = {}
        for scheduled, result in zip(output.scheduled, results, strict=True):
            request = scheduled.request
            if request.beam is None or request.is_finished or not scheduled.is_sampling:
                continue
            assert result.logprobs, "a beam asks for its candidates' logprobs"
            search = self._by_beam[request.request_id]
            search.candidates[request.request_id] = result.logprobs[0].top
            ready[search.search_id] = search
        outputs: list[RequestOutput] = []
        for request in output.finished:  # a beam the scheduler or the forward pass ended
            failed = self._by_beam.get(request.request_id)
            if failed is not None and failed.search_id in self._searches:
                ready.pop(failed.search_id, None)
                outputs.extend(self._fail(failed, request.error or "a beam failed", request.error_status))
        for search in ready.values():
            if all(beam.request_id in search.candidates for beam in search.beams):
                if self._advance(search):
                    outputs.extend(self._answer(search))
        for search in self._searches.values():
            self._release_idle(search)
        return outputs

    def _release_idle(self, search: BeamSearch) -> None:
        """A beam with its candidates has nothing to compute until its siblings have theirs. When
        a sibling is still waiting after a step (the pool, --max-running-requests or its group's
        share kept it out), the idle beams give their blocks back instead of holding them while
        it waits for them, and are parked (not admitted) until the search moves on: a search
        never deadlocks on itself. Their full blocks stay in the prefix cache, so re-admission
        recomputes little."""
        beams = search.beams
        if not any(beam.status is RequestStatus.WAITING for beam in beams):
            return
        running = [beam for beam in beams if beam.status is RequestStatus.RUNNING]
        if running and all(beam.request_id in search.candidates for beam in running):
            for beam in running:
                self.scheduler.preempt(beam)
                beam.held_by = PARKED

    def _advance(self, search: BeamSearch) -> bool:
        """One step of the search; True when it is done."""
        width = search.beam.width
        length = search.num_output_tokens + 1
        candidates = [
            _Candidate(search.sum_logprobs[beam.request_id] + logprob, beam, token_id)
            for beam in search.beams for token_id, logprob in search.candidates.pop(beam.request_id)]
        candidates.sort(key=lambda c: -c.sum_logprobs)
        del candidates[search.num_candidates:]
        for candidate in candidates:
            candidate.ending = self._ending(search, candidate, length)
        penalty = search.beam.length_penalty
        if search.is_improvement_possible and not (search.is_full and search.beam.early_stopping is True):
            for candidate in candidates[:width]:
                if candidate.ending is not None:
                    search.finished.append(Hypothesis(
                        candidate.parent.output_token_ids + [candidate.token_id],
                        candidate.sum_logprobs, candidate.sum_logprobs / length ** penalty,
                        *candidate.ending))
            search.finished.sort(key=lambda h: -h.score)
            del search.finished[width:]
        running = [c for c in candidates if c.ending is None][:width]
        search.num_output_tokens = length
        if running and search.is_full:
            best_length = length
            if search.beam.early_stopping == "never" and penalty > 0:
                best_length = self._max_output_tokens(search)
            best_possible = running[0].sum_logprobs / best_length ** penalty
            if best_possible <= min(h.score for h in search.finished):
                search.is_improvement_possible = False
        is_done = (not running or not search.is_improvement_possible
                   or (search.is_full and search.beam.early_stopping is True))
        if is_done:
            search.candidates.clear()
            self._fill_from_running(search, running, length)
        else:
            self._move_beams(search, running)
        return is_done

    def _ending(self, search: BeamSearch, candidate: _Candidate,
                length: int) -> tuple[FinishReason, int | str | None] | None:
        params = search.params
        token_id = candidate.token_id
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if not params.ignore_eos and token_id in search.receiver.eos_token_ids:
            return FinishReason.STOP, None
        if params.stop and self.tokenizer is not None:
            stop = self._stop_string(params, candidate.parent.output_token_ids + [token_id])
            if stop is not None:
                return FinishReason.STOP, stop
        if length >= self._max_output_tokens(search):
            return FinishReason.LENGTH, None
        return None

    def _stop_string(self, params: SamplingParams, token_ids: list[int]) -> str | None:
        """A stop string in the text the newest token completes (earlier tokens held none)."""
        assert self.tokenizer is not None
        tail = token_ids[-(max(len(s) for s in params.stop) + 4):]
        text = self.tokenizer.decode(tail, skip_special_tokens=params.skip_special_tokens)
        return next((s for s in params.stop if s in text), None)

    @staticmethod
    def _max_output_tokens(search: BeamSearch) -> int:
        receiver = search.receiver
        limit = receiver.max_context_tokens - receiver.num_prompt_tokens
        max_tokens = search.params.max_tokens
        return limit if max_tokens is None else min(limit, max_tokens)

    @staticmethod
    def _fill_from_running(search: BeamSearch, running: list[_Candidate], length: int) -> None:
        """Fewer hypotheses than ranks (a search cut short): the best running beams complete them."""
        penalty = search.beam.length_penalty
        for candidate in running[:search.beam.num_returns - len(search.finished)]:
            search.finished.append(Hypothesis(
                candidate.parent.output_token_ids + [candidate.token_id], candidate.sum_logprobs,
                candidate.sum_logprobs / length ** penalty, FinishReason.LENGTH))

    def _move_beams(self, search: BeamSearch, running: list[_Candidate]) -> None:
        """Make the beams the ``running`` continuations: first children in place, forks share."""
        parents = {c.parent.request_id for c in running}
        for beam in search.beams:
            if beam.request_id not in parents:  # no child: its blocks go back
                self._drop_beam(search, beam)
        beams: list[Request] = []
        sum_logprobs: dict[str, float] = {}
        continued: set[str] = set()
        appends: list[tuple[Request, int]] = []
        for candidate in running:
            parent = candidate.parent
            if parent.request_id in continued:
                beam = self._fork(search, parent, candidate.token_id)
            else:
                continued.add(parent.request_id)
                beam = parent
                appends.append((parent, candidate.token_id))  # after every fork has read it
            beams.append(beam)
            sum_logprobs[beam.request_id] = candidate.sum_logprobs
        for parent, token_id in appends:
            parent.output_token_ids.append(token_id)
            parent.held_by = None
        search.beams = beams
        search.sum_logprobs = sum_logprobs

    def _fork(self, search: BeamSearch, parent: Request, token_id: int) -> Request:
        """A new beam: the parent's tokens plus ``token_id``, sharing the parent's K/V."""
        beam = self._new_beam(search, parent.output_token_ids + [token_id])
        computed = parent.num_computed_tokens if parent.status is RequestStatus.RUNNING else 0
        if self.scheduler.kv.fork(parent, beam, computed):
            self.num_block_copies += 1
        self.scheduler.add_running(beam)
        self.num_forks += 1
        return beam

    def _drop_beam(self, search: BeamSearch, beam: Request) -> None:
        self._by_beam.pop(beam.request_id, None)
        search.candidates.pop(beam.request_id, None)
        self.scheduler.finish(beam, FinishReason.STOP)

    # -- answers ----------------------------------------------------------------------------
    def _answer(self, search: BeamSearch) -> list[RequestOutput]:
        """The finished search's outputs, one per waiting client request (rank r: r-th best)."""
        outputs = []
        for rank, request_id in sorted(search.receivers.items()):
            if rank >= len(search.finished):
                outputs.append(self._error(search, request_id, "the beam search ended with fewer "
                                           f"beams than n ({len(search.finished)})", None))
                continue
            outputs.append(self._output(search, request_id, search.finished[rank]))
        self._close(search, FinishReason.STOP)
        return outputs

    def _output(self, search: BeamSearch, request_id: str, hypothesis: Hypothesis) -> RequestOutput:
        token_ids = hypothesis.token_ids
        text = ""
        stop_reason = hypothesis.stop_reason
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, search.receiver.prompt_token_ids,
                                                 search.params)
            stop = detokenizer.add_tokens(token_ids)
            if stop is not None:
                token_ids = token_ids[:detokenizer.num_output_tokens]
                stop_reason = stop
            text = detokenizer.take_new_text(True)
        return RequestOutput(
            request_id=request_id, new_token_ids=token_ids, new_text=text,
            finish_reason=hypothesis.finish_reason.value, stop_reason=stop_reason,
            num_prompt_tokens=search.receiver.num_prompt_tokens, num_output_tokens=len(token_ids),
            beam_score=hypothesis.score, cumulative_logprob=hypothesis.sum_logprobs)

    def _fail(self, search: BeamSearch, error: str, status: int | None) -> list[RequestOutput]:
        outputs = [self._error(search, request_id, error, status)
                   for request_id in search.receivers.values()]
        self._close(search, FinishReason.ERROR)
        return outputs

    @staticmethod
    def _error(search: BeamSearch, request_id: str, error: str, status: int | None) -> RequestOutput:
        return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value, error=error,
                             error_status=status, num_prompt_tokens=search.receiver.num_prompt_tokens)

    def _close(self, search: BeamSearch, reason: FinishReason) -> None:
        """Forget the search and end its beams (their blocks go back to the pool)."""
        for beam in search.beams:
            self._by_beam.pop(beam.request_id, None)
            self.scheduler.finish(beam, reason)
        search.beams = []
        for request_id in search.receivers.values():
            self._by_receiver.pop(request_id, None)
        self._searches.pop(search.search_id, None)
        for key, open_search in list(self._open.items()):
            if open_search is search:
                del self._open[key]
