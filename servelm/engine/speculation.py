"""The speculative-decoding stage of the engine step: drafts in before scheduling, figures out
after the update.

``propose`` gives each decoding request (its one remaining token is the last one sampled) the
proposer's drafts in ``Request.drafts``; the scheduler computes them after that token
(k + 1 positions, k + 1 logits rows), the executor verifies them (``spec/verify.py``) and
``Scheduler.update`` appends what was accepted and rolls the rest back. Nothing else in the step
knows speculation exists.

Invariants:
- Drafts are set only on running requests whose next step is a decode; every other running
  request's drafts are cleared, so a draft is verified in the step right after it was proposed
  or never.
- In a step where ``--speculative-disable-by-batch-size`` or more requests run, nothing is drafted.
- Figures count verify passes of one request with at least one draft: ``spec_accept_length`` is
  the mean of the tokens such a pass emitted (accepted drafts + the model's own token),
  ``spec_acceptance_rate`` the share of drafted tokens accepted.
"""

from __future__ import annotations

from typing import Any

from servelm.config import SpeculativeConfig
from servelm.engine.monitor import acceptance_figures
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import DraftState, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.stage import Stage, StepCore
from servelm.engine.verification import Verification
from servelm.model.forward_batch import BatchPlan
from servelm.spec.draft_model import DraftModelProposer
from servelm.spec.eagle import EagleProposer
from servelm.spec.proposer import DraftRequest, Proposer, make_proposer
from servelm.spec.typical import make_typical_acceptance


class Speculation(Stage):
    """Proposes drafts for a step, verifies them (``verification``) and keeps the figures."""

    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, runner: Any,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.verification = Verification(make_typical_acceptance(config))
        """The verify rule, chosen once here; the executor applies it to each sampling request."""
        self.num_verify_passes = 0
        """Request-steps that carried at least one draft."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        """Drafted tokens the model accepted (the model's own token after them is not counted)."""

    @property
    def is_enabled(self) -> bool:
        return self.proposer is not None

    # -- the stage's hooks ------------------------------------------------------------------
    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        self.propose(self.scheduler)
        return []

    def before_update(self, output: SchedulerOutput, results: list[StepResult]) -> None:
        self.record(output, results)

    def after_update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        self.move_accepted_paths(self.scheduler, self.runner)
        return []

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        self.release(request)

    def propose(self, scheduler: Scheduler) -> None:
        """Set the drafts of this step's decoding requests."""
        if self.proposer is None:
            return
        disable_at = self.config.speculative_disable_by_batch_size
        is_disabled = disable_at is not None and len(scheduler.running) >= disable_at
        for request in scheduler.waiting:
            if request.num_preemptions:  # preempted: a draft model frees its KV too
                self.proposer.release(request.request_id)
        asking: list[Request] = []
        inputs: list[DraftRequest] = []
        for request in scheduler.running:
            request.drafts = None
            max_drafts = 0 if is_disabled else self._max_drafts(request)
            if max_drafts > 0:
                asking.append(request)
                inputs.append(DraftRequest(
                    request.request_id, request.prompt_token_ids, request.output_token_ids,
                    max_drafts,
                    temperature=0.0 if request.params.is_greedy else request.params.temperature,
                    top_k=request.params.top_k, top_p=request.params.top_p,
                    seed=(request.params.seed if request.params.seed is not None
                          else request.default_seed)))
        if not inputs:
            return
        for request, draft in zip(asking, self.proposer.propose(inputs), strict=True):
            num_drafts = min(len(draft.token_ids), self._max_drafts(request))
            if num_drafts:  # a tree's parents are cut like its tokens (breadth-first: a prefix is one)
                request.drafts = DraftState(
                    draft.token_ids[:num_drafts],
                    draft.probs[:num_drafts] if draft.probs is not None else None,
                    draft.parents[:num_drafts] if draft.parents is not None else None)

    def _max_drafts(self, request: Request) -> int:
        """Drafts worth proposing: only for a decode, and never past max_tokens or the context."""
        if request.pooling is not None or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        return min(self.config.max_draft_tokens, request.num_appendable_tokens())

    def record(self, scheduled: SchedulerOutput, results: list[StepResult]) -> None:
        """Count the step's verify passes (call before ``Scheduler.update``)."""
        if self.proposer is None:
            return
        if isinstance(self.proposer, EagleProposer):
            from servelm.engine.eagle import hand_over_features

            hand_over_features(self.proposer, scheduled, results)
        for item, result in zip(scheduled.scheduled, results, strict=True):
            if item.draft_token_ids and result.token_ids:
                self.num_verify_passes += 1
                self.num_draft_tokens += len(item.draft_token_ids)
                self.num_accepted_tokens += len(result.token_ids) - 1

    def move_accepted_paths(self, scheduler: Scheduler, runner: Any) -> None:
        """Copy the K/V of the draft trees' accepted paths next to their roots now (call after
        ``Scheduler.update``), before anything between steps can read those blocks (eviction to
        the host tier, a K/V transfer); without trees there is nothing to copy."""
        if scheduler.kv.pending_slot_copies:
            runner.execute(BatchPlan(slot_copies=scheduler.kv.take_slot_copies()))

    def release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(request.request_id)

    def stats(self) -> dict[str, Any]:
        """The acceptance figures, flat so data-parallel replicas' counts sum (/get_server_info,
        /metrics, the stats line, bench). Empty when speculation is off."""
        if self.proposer is None:
            return {}
        return {"speculative_algorithm": self.proposer.name,
                "spec_num_verify_passes": self.num_verify_passes,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                **acceptance_figures(self.num_verify_passes, self.num_draft_tokens,
                                     self.num_accepted_tokens),
                **self._draft_pool_stats()}

    def _draft_pool_stats(self) -> dict[str, Any]:
        if not isinstance(self.proposer, DraftModelProposer | EagleProposer):
            return {}
        return {"spec_draft_used_blocks": self.proposer.num_held_blocks,
                "spec_draft_pool_misses": self.proposer.num_pool_misses}

