"""Continuous batching: which tokens of which requests are computed in the next step.

There is no prefill or decode phase. Each request has ``num_computed_tokens`` (K/V already in
the cache) and ``num_tokens`` (prompt + output); a step computes up to the gap for as many
requests as the token budget, the chunk cap and the free blocks allow. A decode is a gap of one;
a prompt is a gap of many, cut into chunks; a preempted request's gap is all of its tokens.
The scheduler decides who runs and how many tokens; ``engine/kv_manager.py`` decides which
blocks (prefix hits, growth, rollback, forks), and every block goes through it.

Invariants:
- Running requests are served before waiting ones, oldest first; when blocks run out, the newest
  running request is preempted (its blocks freed, its computed count reset, re-queued at the
  front) so that older ones make progress. Its output so far is kept and recomputed, so greedy
  results are unchanged by preemption.
- A request finished here (stop token, length, abort, error) releases its blocks at once.
- The scheduler never asks for more blocks than the pool has free.
- With the prefix cache: a request admitted from the queue first takes the cached blocks of its
  longest cached prefix (all tokens but the last, so the last always yields logits) and computes
  from there. Every full block a request computes is inserted into the cache as soon as it is
  computed (so n>1 siblings and later turns hit it), and a finished or preempted request's blocks
  stay cached. When the pool is short, free cached blocks are evicted before anyone is preempted.
- Admission order is engine/policy.py's; admission stops at the first request that does not fit.
  While other groups (client requests) have work, one group holds at most GROUP_SHARE of
  ``--max-running-requests``: its further requests are skipped, not admitted, so a big batch
  leaves room (and a smaller, faster batch) for other users; alone it may use every slot.
  A request whose grammar is still compiling is skipped, not waited for, and so is one a stage
  holds (``held_by``: a copy of an n > 1 prompt until its first copy has computed it).
- While a heavy group and a light one both have work, and for LIGHT_GRACE_S after a light one
  last had work (a user's next request follows within a round trip), each step is shared
  (engine/policy.py ``FairShares``): the heavy groups (more prompt work left than HEAVY_PROMPT_WORK, weighted for
  prompt-logprob rows and deep context, or more than HEAVY_SEQUENCES sequences) together compute
  at most --fair-step-tokens tokens (prompt tokens and decode rows) in equal shares, and one group
  computes at most GROUP_SHARE of --max-running-requests sequences; a running request whose group
  has had its share waits for the next step. So a heavy request (a long prompt with echo
  logprobs, many copies, a wide beam, the longest context) moves at its share and a normal
  user's steps stay short. Light groups are not bounded, nor are heavy ones among themselves
  once no light group has had work for LIGHT_GRACE_S.
- An embedding request is computed whole in the step that admits it (never chunked: an encoder
  attends both ways, and pooling needs every row at once), never matches or fills the prefix
  cache, and is finished by ``update`` with its pooled vector, freeing its blocks in that step.
  It waits while the step's remaining token budget is smaller than its prompt.
- An image (``Request.mm_inputs``) is never cut across steps: its placeholder tokens attend to
  each other in both directions, so a chunk that would end inside an image ends before it, or,
  when it starts at (or inside) the image, runs to the image's end even past the chunk cap; past
  the step's budget only when nothing else is scheduled this step (else it waits for the next).
- The default --chunked-prefill-size caps a prompt's chunk only when another request is queued or
  running; a lone request's prompt takes up to the step budget at once (``_is_alone``). A size set
  to anything else caps every chunk.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from servelm.config import SchedulerConfig
from servelm.engine.kv_manager import KVManager, cdiv
from servelm.engine.policy import FairShares, GroupShares, order_waiting, urgency
from servelm.engine.request import FinishReason, Request, RequestStatus
from servelm.engine.stop_rules import ending_after
from servelm.engine.scheduler_output import (ScheduledRequest, SchedulerOutput, StepResult,
                                             schedule_request)

__all__ = ["GROUP_SHARE", "ScheduledRequest", "Scheduler", "SchedulerOutput", "StepResult", "cdiv"]

GROUP_SHARE = 0.25
"""Share of the running slots one group (client request) may take while other groups have work."""


class Scheduler:
    """Owns the waiting queue and the running set; ``kv`` owns their blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVManager, seed: int = 0,
                 adapter_slot: Callable[[Request, set[str]], int | str | None] | None = None) -> None:
        self.config = config
        self.adapter_slot = adapter_slot
        """Gives a LoRA request being admitted its runner slot, given the running adapters
        (engine/lora_stage.py): the slot, None when it must wait (--max-loras-per-batch adapters
        run, or no slot is free), or an error message (it ends with it). None: no LoRA."""
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        """Prompt tokens of admitted requests (first admission only): the hit rate's denominator."""
        self.num_cached_prompt_tokens = 0
        """Of those, tokens served from the prefix cache."""
        self.num_prefill_tokens = 0
        """Prompt positions the model computed (recomputes after preemption included): n copies
        of one prompt add the prompt once (engine/prompt_sharing.py)."""
        self._rng = random.Random(seed)
        self._num_steps_without_admission = 0
        self.fair_shares = FairShares(config.fair_step_tokens, self._group_share())
        """Each step's shares while heavy and light groups have work (engine/policy.py)."""

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Start a request that already holds its blocks (a forked beam): no admission."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None, error_status: int | None = None) -> None:
        """End a request and free its blocks; it leaves the queues."""
        if request.is_finished:
            return
        was_waiting = request.status is not RequestStatus.RUNNING
        (self.waiting if was_waiting else self.running).remove(request)
        self.kv.release(request, was_waiting, reason in (FinishReason.STOP, FinishReason.LENGTH))
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        request.error_status = error_status
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_tokens_per_step
        did_preempt = False

        shares = self.fair_shares.for_step(self.running, self.waiting)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = self._chunk(request, budget)
            if num_tokens and shares is not None:
                num_tokens = shares.take(request, num_tokens)
            if num_tokens == 0:  # nothing to compute (an idle beam), its group's share is used,
                index += 1       # or an embedding prompt larger than what is left of the budget
                continue
            num_drafts = self._num_drafts(request, num_tokens, budget)
            target_tokens = request.num_computed_tokens + num_tokens + num_drafts
            if not self.kv.grow(request, target_tokens):
                did_preempt = True
                if not self._preempt_for(request, target_tokens, output):
                    continue  # request itself was preempted or failed; the list shifted
            output.scheduled.append(schedule_request(request, num_tokens))
            budget -= num_tokens + num_drafts
            index += 1

        if self.waiting and budget > 0 and not did_preempt and self._is_admission_step():
            self._admit(output, budget, shares)
        output.seal()
        if output.scheduled:  # K/V copies the forward makes before it writes anything
            output.plan.block_copies = self.kv.take_block_copies()
            output.plan.slot_copies = self.kv.take_slot_copies()
        return output

    def _num_drafts(self, request: Request, num_tokens: int, budget: int) -> int:
        """Cut the request's drafts to what this step can verify: only a decode (its one
        remaining token) carries drafts, within the token budget, and never past max_tokens or the
        context (k accepted drafts plus the model's token are appended)."""
        drafts = request.drafts
        if drafts is None:
            return 0
        limit = budget - num_tokens
        if request.num_computed_tokens + num_tokens != request.num_tokens or num_tokens != 1:
            limit = 0
        limit = min(limit, request.num_appendable_tokens())
        if limit <= 0:
            request.drafts = None
            return 0
        if len(drafts.token_ids) > limit:
            drafts.truncate(limit)
        return len(drafts.token_ids)

    def _is_admission_step(self) -> bool:
        """LightLLM's --router_max_wait_tokens: while others decode, admit every N steps only."""
        wait_steps = self.config.router_max_wait_tokens
        if wait_steps == 0 or not self.running or self._num_steps_without_admission + 1 >= wait_steps:
            self._num_steps_without_admission = 0
            return True
        self._num_steps_without_admission += 1
        return False

    def _group_share(self) -> int:
        return max(1, int(self.config.max_running_requests * GROUP_SHARE))

    def _admit(self, output: SchedulerOutput, budget: int, shares: GroupShares | None = None) -> None:
        """Move waiting requests to running in policy order while they fit."""
        admitted: list[Request] = []
        group_cap = self._group_cap()
        running_per_group: dict[str, int] = {}
        for running in self.running:
            running_per_group[running.group] = running_per_group.get(running.group, 0) + 1
        for request in order_waiting(self.waiting, self.config, self.kv.prefix_cache, self._rng):
            if budget <= 0 or (admitted and self.config.prefill_only_one_req):
                break
            if group_cap is not None and running_per_group.get(request.group, 0) >= group_cap:
                continue  # this client request has its share; others go first
            if request.is_compiling or request.is_awaiting_kv:
                continue  # its grammar (or its K/V from a prefill server) is not ready
            if request.held_by is not None:
                continue  # a stage holds it (a copy waiting for its prompt, a parked beam)
            if not self.kv.can_ever_fit(request.num_tokens + 1):
                self.finish(request, FinishReason.ERROR, error=(
                    f"request needs {request.num_tokens + 1} tokens of KV cache but the pool holds "
                    f"{self.kv.pool_capacity_tokens}"))
                output.finished.append(request)
                continue
            if not self._give_adapter_slot(request, output):
                continue
            if self.kv.shares_prefix_in_flight(request, admitted):
                continue  # compute the shared prefix once: next step it is cached
            if not self.kv.is_prefetched(request):
                continue  # its blocks are still being read from disk (--hicache-storage-prefetch-policy)
            self.kv.match_prefix(request)
            num_tokens = self._chunk(request, budget)
            if num_tokens == 0:
                self.kv.unmatch(request)
                return  # an embedding prompt (or an image) waits for a step with room for all of it
            granted = num_tokens if shares is None or request.pooling is not None else shares.take(request, num_tokens)
            if granted == 0:
                self.kv.unmatch(request)
                continue  # its group has had its share of this step
            if granted < num_tokens and request.mm_inputs is not None and request.mm_inputs.images:
                granted = self._whole_images(request, granted, num_tokens)  # a share cuts no image either
            num_tokens = granted
            while not self._fits(request, num_tokens):
                victim = self._priority_victim(request)
                if victim is None:
                    self.kv.unmatch(request)
                    return
                budget += output.remove(victim)
                self._preempt(victim)
                num_tokens = min(granted, self._chunk(request, budget))
            self.start(request)
            output.scheduled.append(schedule_request(request, num_tokens))
            admitted.append(request)
            running_per_group[request.group] = running_per_group.get(request.group, 0) + 1
            budget -= num_tokens

    def _give_adapter_slot(self, request: Request, output: SchedulerOutput) -> bool:
        """Whether a request may be admitted as far as its LoRA adapter goes (slot set)."""
        if request.lora is None or self.adapter_slot is None:
            return True
        running = {r.lora.adapter_id for r in self.running if r.lora is not None}
        slot = self.adapter_slot(request, running)
        if isinstance(slot, str):
            self.finish(request, FinishReason.ERROR, error=slot)
            output.finished.append(request)
            return False
        if slot is None:
            return False  # its adapter cannot run beside the running ones yet: wait for one to drain
        request.lora.slot = slot
        return True

    def _group_cap(self) -> int | None:
        """Most running requests per group, or None while a single group has all the work."""
        groups = {request.group for request in self.running}
        groups.update(request.group for request in self.waiting)
        if len(groups) <= 1:
            return None
        return self._group_share()

    def _fits(self, request: Request, num_tokens: int) -> bool:
        if len(self.running) >= self.config.max_running_requests:
            return False
        if not self.kv.has_headroom(request, num_tokens, self.running, self.config):
            return False
        return self.kv.grow(request, request.num_computed_tokens + num_tokens)

    def _priority_victim(self, request: Request) -> Request | None:
        """Priority scheduling: the least urgent running request (newest among equals), when
        ``request`` is more urgent than it by more than the threshold; else None."""
        if not self.config.is_priority_scheduling or not self.running:
            return None
        low_first = self.config.is_low_priority_value_first
        victim = max(reversed(self.running), key=lambda r: urgency(r, low_first))
        margin = urgency(victim, low_first) - urgency(request, low_first)
        return victim if margin > self.config.priority_scheduling_preemption_threshold else None

    def start(self, request: Request) -> None:
        """A waiting request runs from this step (admitted, or its K/V arrived from a prefill
        server: engine/disaggregation.py); its first admission counts its prompt."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.num_preemptions == 0:
            self.num_prompt_tokens += request.num_prompt_tokens
            self.num_cached_prompt_tokens += request.num_cached_tokens

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is queued or running."""
        if self.has_unfinished():
            return False
        self.kv.flush()
        return True

    def _chunk(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if request.pooling is not None:  # all or nothing: one forward computes the whole prompt
            return remaining if remaining <= budget else 0
        cap = self.config.max_chunk_tokens
        if cap is None or self._is_alone(request):
            num_tokens = min(remaining, budget)
        else:
            num_tokens = min(remaining, budget, cap)
        if request.mm_inputs is not None and request.mm_inputs.images:
            num_tokens = self._whole_images(request, num_tokens, budget)
        return num_tokens

    def _whole_images(self, request: Request, num_tokens: int, budget: int) -> int:
        """``num_tokens`` moved so the chunk cuts no image: back to the image's start when the
        chunk starts before it, on to its end when the chunk starts at or inside it (0: it does
        not fit the rest of this step's budget; the whole budget always takes it)."""
        start = request.num_computed_tokens
        end = start + num_tokens
        for span in request.mm_inputs.images if request.mm_inputs is not None else ():
            span_end = span.offset + span.length
            if span.offset < end < span_end:
                if span.offset > start:
                    return span.offset - start
                needed = span_end - start
                return needed if needed <= budget or budget >= self.config.max_tokens_per_step else 0
        return num_tokens

    def _is_alone(self, request: Request) -> bool:
        """The only request with work, under the default chunk size: no decode's inter-token
        latency and no other prompt's first token waits on its step, so its prompt is not cut at
        --chunked-prefill-size (the step budget, --max-prefill-tokens, still bounds it). One step
        instead of several saves a pass over the weights and a chunk's attention over paged K/V.
        Prompt logprobs keep the cap: their logits rows grow with the chunk. Copies held for
        this request's prompt (engine/prompt_sharing.py) wait for all of it: they do not count."""
        if self.config.is_lone_prompt_chunked or request.wants_prompt_logprobs:
            return False
        if len(self.running) + len(self.waiting) == 1:
            return True
        return (len(self.running) <= 1
                and all(other is request for other in self.running)
                and all(other is request or other.held_by is not None for other in self.waiting))

    def _preempt_for(self, request: Request, target_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request`` can cover ``target_tokens``.

        Returns False when ``request`` itself had to go (preempted, or failed when alone).
        """
        while True:   # the newest whose blocks share the request's pool (DP attention: its rank's)
            victim = next((other for other in reversed(self.running) if self.kv.same_pool(other, request)), request)
            if victim is request and len(self.running) == 1 and not self.waiting:
                self.finish(request, FinishReason.ERROR, error=(
                    f"KV pool exhausted: request reached {request.num_tokens} tokens and the pool "
                    f"holds {self.kv.pool_capacity_tokens}"))
                output.finished.append(request)
                return False
            self._preempt(victim)
            if victim is request:
                return False
            if self.kv.grow(request, target_tokens):  # the victim's blocks are free or evictable
                return True

    def preempt(self, request: Request) -> None:
        """Give a running request's blocks back (its full blocks stay cached); it is recomputed
        when admitted again (engine/beam.py: an idle beam whose sibling cannot be admitted)."""
        assert request.status is RequestStatus.RUNNING
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.drafts = None
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- update -----------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, results: list[StepResult]) -> list[Request]:
        """Apply the model's results; returns the requests that got new tokens or finished."""
        touched: list[Request] = list(output.finished)
        self.fair_shares.step_done(sum(scheduled.num_tokens for scheduled in output.scheduled))
        for scheduled, result in zip(output.scheduled, results, strict=True):
            request = scheduled.request
            if request.is_finished:
                continue  # aborted while the step ran
            start = request.num_computed_tokens
            self.num_prefill_tokens += max(0, min(request.num_prompt_tokens, start + scheduled.num_tokens)
                                           - start)
            request.num_computed_tokens += scheduled.num_tokens
            if request.pooling is not None:
                assert result.embedding is not None, "a pooled request gets its vector"
                request.pooling.embedding = result.embedding
                self.finish(request, FinishReason.STOP)
                touched.append(request)
                continue
            self.kv.cache_computed_blocks(request)
            if request.params.prompt_logprobs is not None and request.prompt_logprobs is None:
                request.prompt_logprobs = [None]  # the first prompt token has no logprob
            if result.prompt_logprobs:
                assert request.prompt_logprobs is not None
                request.prompt_logprobs.extend(result.prompt_logprobs)
            if request.beam is not None:
                continue  # engine/beam.py reads its candidates and appends the chosen token
            if not result.token_ids:
                continue
            num_accepted_drafts = len(result.token_ids) - 1 if scheduled.draft_token_ids else 0
            if result.accepted_draft_indices:  # a tree's path: move its K/V next to the root
                self.kv.move_accepted_path(request, request.num_computed_tokens - 1,
                                           result.accepted_draft_indices)
            for index, token_id in enumerate(result.token_ids):
                request.output_token_ids.append(token_id)
                if result.logprobs:
                    request.pending_logprobs.append(result.logprobs[index])
                if index < num_accepted_drafts:
                    request.num_computed_tokens += 1  # an accepted draft: its K/V was computed
                ending = ending_after(request, token_id)
                if ending is not None:
                    self.finish(request, ending.reason, ending.stop_reason, ending.error,
                                ending.error_status)
                    break
            if scheduled.draft_token_ids and not request.is_finished:
                request.drafts = None
                self.kv.roll_back_drafts(request)
            touched.append(request)
        return touched
