"""A request's life inside the engine: its tokens, its KV blocks and its state.

Invariants:
- ``num_computed_tokens <= num_tokens``; positions below ``num_computed_tokens`` have K/V in
  ``block_ids`` (recompute preemption resets both to zero/empty).
- A finished request holds no blocks (its full blocks may live on in the prefix cache, which
  holds its own references).
- Leading blocks reused from the prefix cache are shared and never written: the request computes
  from ``num_computed_tokens`` on, which starts at the (block-aligned) cached length.
- An embedding request is prefill-only: it runs in exactly one step (its whole prompt) and ends
  there, with its pooled vector and no output tokens.
- Each optional feature keeps its per-request state in one object the feature owns (``drafts``,
  ``beam``, ``grammar``, ``lora``, ``pooling``, ``transfer``): None when the request does not use
  it, so the scheduler and the executor test that object, never a flag.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from servelm.constrained.compiler import CompileJob
from servelm.constrained.grammar import GrammarMatcher
from servelm.engine.outputs import TokenLogprob
from servelm.multimodal.cache_keys import keyed_tokens
from servelm.multimodal.inputs import MultimodalInputs
from servelm.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class TransferState:
    """A request's part in a prefill/decode K/V transfer (engine/disaggregation.py)."""

    key: str | None = None
    """Prefill server: the key its K/V is pulled by. When it finishes normally its blocks are
    parked (``parked_block_ids``) for the decode server instead of freed."""
    parked_block_ids: list[int] = field(default_factory=list)
    """Prefill server: the finished request's blocks, held for the decode server's pull (the
    disaggregation stage releases them)."""
    is_awaiting_kv: bool = False
    """Decode server: its prompt K/V comes from a prefill server. It waits (never admitted by the
    scheduler) until the K/V and first token arrive; then it runs as if it had computed them."""


@dataclass(slots=True)
class DraftState:
    """Speculative decoding: tokens proposed to follow ``output_token_ids``, verified in the next
    step (the proposer stage sets them before scheduling; never part of the output until the
    model accepts them, and their K/V is rolled back when it does not)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    """``[len(token_ids), vocab]`` distributions a draft model sampled the drafts from (verified
    by rejection sampling); None: point-mass drafts (n-gram, greedy)."""
    parents: list[int] | None = None
    """A draft tree (EAGLE topk > 1, ``spec/tree.py``): each draft's parent among the drafts (-1:
    the last accepted token); None: the drafts are a chain."""

    def truncate(self, num_drafts: int) -> None:
        """Keep the first ``num_drafts`` (breadth-first: a tree's prefix is still a tree)."""
        del self.token_ids[num_drafts:]
        if self.parents is not None:
            del self.parents[num_drafts:]


@dataclass(slots=True)
class BeamState:
    """One beam of a beam search (engine/beam.py): the scheduler computes it like any request,
    but its sampled row's candidates go to the search, which appends the chosen token (the
    scheduler's update appends nothing and applies no stop rule to it)."""

    search_id: str


@dataclass(slots=True)
class GrammarState:
    """Structured output: the compile job until the grammar is ready, then its matcher."""

    job: CompileJob | None = None
    """While the grammar compiles (off the step): the job its matcher will come from. The
    scheduler does not admit the request until this is None."""
    matcher: GrammarMatcher | None = None
    """The grammar state after exactly ``output_token_ids`` (fed by the scheduler as tokens are
    appended; preemption and recompute leave it alone)."""


@dataclass(slots=True)
class LoRAState:
    """The LoRA adapter a request runs with."""

    adapter_id: str
    """The adapter the K/V is computed with; part of the prefix-cache key."""
    slot: int = 0
    """Runner slot holding the adapter's weights, given at admission; goes into the plan."""


@dataclass(slots=True)
class PoolingState:
    """An embedding request (task embed): its whole prompt is computed in one step, never chunked
    or shared with the prefix cache, and it finishes with ``embedding`` instead of tokens."""

    embedding: list[float] | None = None
    """The pooled vector, set when the step that computed the prompt finishes the request."""


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    max_context_tokens: int
    """Prompt plus output may not exceed this (the model's context length)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int | None = None
    """HTTP status of ``error``: None is a server error (500); 400 when the request itself
    cannot be served (its grammar allows no further token, say)."""
    arrival_time_s: float = field(default_factory=time.monotonic)
    arrival_wall_s: float = field(default_factory=time.time)
    """Wall-clock times of the request's phases (seconds since the epoch, so the server process
    on the same host can place them in a trace): arrival here, first scheduled, first output
    token, finish; None until reached. ``detokenize_s`` sums the time spent detokenizing it."""
    scheduled_wall_s: float | None = None
    first_token_wall_s: float | None = None
    finished_wall_s: float | None = None
    detokenize_s: float = 0.0
    num_preemptions: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Logprobs of tokens sampled since the last output was sent."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Filled during prefill when params.prompt_logprobs is set; None for position 0."""
    is_prompt_logprobs_sent: bool = False
    num_sent_tokens: int = 0
    """Output tokens already reported to the client."""
    priority: int = 0
    """Scheduling priority (used with priority scheduling; see engine/policy.py)."""
    default_seed: int | None = None
    """Sampling seed when ``params.seed`` is None: derived from --seed and the arrival order."""
    num_cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache at first admission."""
    num_inserted_blocks: int = 0
    """Leading blocks of ``block_ids`` already given to the prefix cache."""
    group: str = ""
    """The client request this one belongs to (n > 1 and prompt lists make several); admission
    takes groups in turn (engine/policy.py), so one big request cannot starve the others.
    Empty: a group of its own (the request id)."""
    # -- each optional feature's state: None when the request does not use the feature --------
    drafts: DraftState | None = None
    """Speculative decoding (engine/speculation.py): the drafts verified in the next step."""
    beam: BeamState | None = None
    """One beam of a beam search (engine/beam.py)."""
    grammar: GrammarState | None = None
    """Structured output (engine/grammar_stage.py): its grammar's compile job, then its matcher."""
    lora: LoRAState | None = None
    """The LoRA adapter it runs with (engine/lora_stage.py); None: the base model."""
    pooling: PoolingState | None = None
    """An embedding request (task embed)."""
    transfer: TransferState | None = None
    """Disaggregation: the request's K/V crosses servers (None: co-located, the usual case)."""
    mm_inputs: MultimodalInputs | None = None
    """Its images (vision-language models): spans over ``prompt_token_ids`` (the expanded ids).
    The scheduler never cuts a span across steps; the prefix cache keys a span's positions by
    the image's digest (``cache_slice``). None: text only."""
    held_by: str | None = None
    """What a stage holds this waiting request back for (None: nothing): the scheduler does not
    admit it while set (engine/prompt_sharing.py: a copy waiting for its prompt's first copy;
    engine/beam.py: a parked beam waiting for its search's next step)."""

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id

    @property
    def is_compiling(self) -> bool:
        """Waiting for its grammar: not admitted yet, and holding up nobody behind it."""
        return self.grammar is not None and self.grammar.job is not None

    @property
    def is_awaiting_kv(self) -> bool:
        """Decode server: waiting for its prompt K/V from a prefill server (never admitted)."""
        return self.transfer is not None and self.transfer.is_awaiting_kv

    @property
    def is_internal(self) -> bool:
        """A request a stage answers for (a beam: its search), never reported itself."""
        return self.beam is not None

    @property
    def adapter_id(self) -> str | None:
        """The prefix-cache root its K/V is keyed under: its LoRA adapter (None: the base model)."""
        return self.lora.adapter_id if self.lora is not None else None

    @property
    def lora_slot(self) -> int:
        """The runner slot of its adapter's weights (0: the base model)."""
        return self.lora.slot if self.lora is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are asked for and not yet complete."""
        return (self.params.prompt_logprobs is not None
                and (self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens))

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def cache_slice(self, start: int, end: int) -> list[int]:
        """``token_slice`` as the prefix cache keys it: image placeholder positions read as their
        image's digest-derived pad id (servelm.multimodal.cache_keys), so K/V computed with one
        image is never served for another."""
        tokens = self.token_slice(start, end)
        if self.mm_inputs is None or not self.mm_inputs.images:
            return tokens
        return keyed_tokens(tokens, start, self.mm_inputs.images)

    def image_spans(self, start: int, end: int) -> list[Any]:
        """The ImageSpans overlapping positions [start, end), in order."""
        if self.mm_inputs is None:
            return []
        return [span for span in self.mm_inputs.images if span.offset < end and span.offset + span.length > start]

    def num_appendable_tokens(self) -> int:
        """Tokens this request may still append beside the one its next step samples (drafts,
        jump-forward text): within its context and its max_tokens; never negative."""
        limit = self.max_context_tokens - self.num_tokens - 1
        by_budget = self.params.num_appendable_tokens(len(self.output_token_ids))
        return max(0, limit if by_budget is None else min(limit, by_budget))

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens after the first ``num_output_tokens`` (a stop string ended the
        request inside a run of accepted drafts): what follows was never generated as far as
        the client is concerned. The request must be finished next (its grammar is past the cut)."""
        if len(self.output_token_ids) <= num_output_tokens:
            return
        del self.output_token_ids[num_output_tokens:]
        num_pending = num_output_tokens - self.num_sent_tokens
        del self.pending_logprobs[max(num_pending, 0):]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
