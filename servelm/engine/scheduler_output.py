"""What the scheduler hands the executor, and what comes back: plain dataclasses.

A step is one list of ``ScheduledRequest``s. Each carries its own ``SequencePlan`` (the tokens,
positions and blocks the model computes for it), so reordering or dropping a request moves its
plan with it; ``SchedulerOutput.seal`` builds the runner's ``BatchPlan`` from that list once the
schedule is final. Nothing keeps two lists in step by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.engine.outputs import TokenLogprob
from servelm.engine.request import Request
from servelm.model.forward_batch import BatchPlan, DraftTree, SequencePlan
from servelm.multimodal.processor import mrope_positions_for
from servelm.spec.tree import tree_plan_parents


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_tokens: int
    """Tokens computed this step, starting at the request's num_computed_tokens."""
    num_logits: int
    """Logits rows returned for this request (trailing positions of its chunk)."""
    is_sampling: bool
    """The chunk reaches the end of the request's tokens, so its last row is sampled."""
    num_prompt_logprob_rows: int
    """Leading rows of this request's logits that give prompt-token logprobs."""
    is_pooled: bool = False
    """An embedding request: its whole prompt is computed and pooled; the result is a vector."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative tokens computed after the request's last token this step (their K/V is
    written; ``update`` keeps only what the model accepted). Each adds one logits row."""
    draft_parents: list[int] | None = None
    """The drafts form a tree (``DraftState.parents``); None: a chain."""
    sequence: SequencePlan | None = None
    """What the model computes for this request (None: a step the model did not run, such as
    a decode server's arrived K/V)."""


def schedule_request(request: Request, num_tokens: int) -> ScheduledRequest:
    """The step's share of ``request``: its next ``num_tokens`` tokens (plus its drafts when the
    chunk reaches its end), its logits rows and its sequence plan."""
    start = request.num_computed_tokens
    if request.pooling is not None:
        return ScheduledRequest(request, num_tokens, 0, False, 0, is_pooled=True, sequence=SequencePlan(
            token_ids=request.token_slice(start, start + num_tokens), start_position=start,
            block_ids=request.block_ids, num_logits=0, is_pooled=True, lora_slot=request.lora_slot))
    is_sampling = start + num_tokens == request.num_tokens
    draft_state = request.drafts if is_sampling else None
    drafts = list(draft_state.token_ids) if draft_state is not None else []
    num_prompt_rows = 0
    if request.wants_prompt_logprobs:
        # Row i predicts position start + i + 1; prompt positions end at num_prompt_tokens - 1.
        num_prompt_rows = max(0, min(num_tokens, request.num_prompt_tokens - 1 - start))
    num_logits = num_prompt_rows + (1 if is_sampling else 0)
    if num_prompt_rows and is_sampling:
        num_logits = num_tokens  # prompt rows plus the final sampling row are contiguous
    num_logits += len(drafts)  # one row per draft: the model's token after each
    parents = (list(draft_state.parents) if drafts and draft_state is not None
               and draft_state.parents is not None else None)
    sequence = SequencePlan(token_ids=request.token_slice(start, start + num_tokens) + drafts,
                            start_position=start, block_ids=request.block_ids,
                            num_logits=num_logits, lora_slot=request.lora_slot,
                            images=request.image_spans(start, start + num_tokens),
                            mrope_positions=mrope_positions_for(request.mm_inputs, start, num_tokens + len(drafts)))
    if parents is not None:  # verified as a tree: its root is the request's last token
        sequence.tree = DraftTree(start + num_tokens - 1, tree_plan_parents(parents))
    return ScheduledRequest(request, num_tokens, num_logits, is_sampling, num_prompt_rows,
                            draft_token_ids=drafts, draft_parents=parents, sequence=sequence)


@dataclass
class SchedulerOutput:
    """What to run this step: the scheduled requests (each with its plan) and the runner's plan."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Requests in plan order."""
    plan: BatchPlan = field(default_factory=BatchPlan)
    """The tokens, positions and blocks the model computes: ``scheduled``'s sequences, in order
    (set by ``seal``), plus the K/V copies the forward makes first."""
    finished: list[Request] = field(default_factory=list)
    """Requests the scheduler ended this step without running them (e.g. cannot fit the pool)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def remove(self, request: Request) -> int:
        """Take ``request`` out of this step; returns the tokens (drafts too) it had been given."""
        for index, scheduled in enumerate(self.scheduled):
            if scheduled.request is request:
                del self.scheduled[index]
                return scheduled.num_tokens + len(scheduled.draft_token_ids)
        return 0

    def seal(self) -> None:
        """The schedule is final: order it by LoRA slot (stable, so each adapter's rows are
        contiguous and its deltas read views of the batch) and build the runner's plan."""
        if any(s.sequence is not None and s.sequence.lora_slot for s in self.scheduled):
            self.scheduled.sort(key=lambda s: s.sequence.lora_slot if s.sequence is not None else 0)
        self.plan.sequences = [s.sequence for s in self.scheduled if s.sequence is not None]


@dataclass(slots=True)
class StepResult:
    """What the model produced for one scheduled request."""

    token_ids: list[int] = field(default_factory=list)
    """Accepted new tokens (one when sampling; none for a non-final prefill chunk; with k
    drafts, the accepted drafts plus the model's own next token: 1..k + 1)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] | None = None
    """The pooled vector of an embedding request."""
    accepted_draft_indices: list[int] | None = None
    """A draft tree's accepted path (draft indices, root first); None: a chain's leading drafts."""
