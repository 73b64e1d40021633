"""The draft-model proposer (SGLang STANDALONE, vLLM --speculative-model PATH): a smaller model with
the target's tokenizer guesses the next k tokens, one decode step of its own per token.

Per request the proposer keeps the draft's own KV (blocks from the draft pool) for a prefix of
the request's tokens. A step, batched over the requests it drafts for:

1. roll back: the cached prefix is cut to where it agrees with prompt + accepted output (the
   rejected drafts of the last step disagree there), and blocks past what this step needs go
   back to the pool;
2. catch up: one forward over each request's uncached tokens (the whole prompt the first time,
   the accepted drafts' last one and the target's own token after that) gives the logits of
   draft 1. It keeps the model's prefill budget: at most --chunked-prefill-size tokens of one
   request and --max-prefill-tokens in all, so a long prompt's first catch-up is spread over
   several steps, in which that request drafts nothing (it decodes normally);
3. chain: k - 1 one-token forwards, each on the draft just chosen, give drafts 2..k.

A greedy request's drafts are the draft model's argmaxes (a point mass: verification keeps the
prefix the target agrees with). A sampling request's draft i is drawn from q_i = softmax(logits /
temperature) within the request's top_k / top_p (the model samples within them too, so drafts
outside are wasted), and q_i is returned with it, so ``verify.rejection_sample`` keeps the target's
distribution exactly whatever q is.

Invariants:
- ``state.token_ids[:n]`` are the tokens whose K/V sit at positions 0..n-1 of ``state.block_ids``
  in the draft pool; nothing else of a request is cached, so rollback is a truncation.
- Blocks are released by ``release`` (finish, abort, preemption) and when a step needs fewer; a
  pool too short for a request's step gives that request an empty draft (it decodes normally),
  never an error.
- spec/ sits below engine/: the runner and the pool are the small protocols below, which
  ``servelm.engine.draft_model`` fills with a ModelRunner and a BlockPool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from servelm.spec.proposer import Draft, DraftRequest

_UINT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class DraftSequence:
    """One request's share of a draft forward pass (see ``model.forward_batch.SequencePlan``)."""

    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    tree_parents: list[int] | None = None
    """EAGLE tree steps: the parents of the tree entries from ``tree_first_position`` to this
    sequence's end (``model.forward_batch.DraftTree``); every token then gets logits."""
    tree_first_position: int = 0


class DraftRunner(Protocol):
    """The draft model: one forward over sequences, float32 logits of each one's last token."""

    @property
    def block_size(self) -> int: ...

    def forward_last(self, sequences: list[DraftSequence]) -> torch.Tensor:
        """``[len(sequences), vocab]`` logits; K/V of every token is written at its position."""
        ...


class DraftBlocks(Protocol):
    """The draft pool's free list (``servelm.cache.block_pool.BlockPool``)."""

    def allocate(self, num_blocks: int) -> list[int] | None: ...

    def release(self, block_ids: list[int]) -> None: ...


@dataclass(slots=True)
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """Tokens whose draft K/V is cached, from position 0."""


class DraftModelProposer:
    """Chains of drafts from a smaller model, batched over the step's requests."""

    name = "STANDALONE"

    def __init__(self, runner: DraftRunner, blocks: DraftBlocks, seed: int | None = None,
                 max_catch_up_tokens: int | None = None, max_forward_tokens: int | None = None) -> None:
        """``max_catch_up_tokens`` (--chunked-prefill-size) bounds one request's catch-up tokens
        in a step and ``max_forward_tokens`` (--max-prefill-tokens) the catch-up forward's total,
        the budgets the model's own steps keep; None: unbounded."""
        self.runner = runner
        self.blocks = blocks
        self.max_catch_up_tokens = max_catch_up_tokens
        self.max_forward_tokens = max_forward_tokens
        self._states: dict[str, _DraftState] = {}
        self._generator = seeded_generator(seed)
        """Draws of requests without a seed (seeded requests reseed per step, see ``_draw``)."""
        self.num_pool_misses = 0
        """Request-steps left without drafts because the draft pool was short."""

    @property
    def num_held_blocks(self) -> int:
        return sum(len(state.block_ids) for state in self._states.values())

    def held_request_ids(self) -> set[str]:
        return set(self._states)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.block_ids:
            self.blocks.release(state.block_ids)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        planned: list[tuple[int, DraftRequest, list[int], DraftSequence]] = []
        for index, request in enumerate(requests):
            tokens = request.prompt_token_ids + request.output_token_ids
            sequence = self._catch_up(request, tokens)
            if sequence is not None:
                planned.append((index, request, tokens, sequence))
        computed = [(plan, whole) for plan, whole in zip(planned, self._fit_budget(planned), strict=True)
                    if plan[3].token_ids]
        if not computed:
            return drafts
        logits = self.runner.forward_last([sequence for (_, _, _, sequence), _ in computed])
        # A request whose catch-up was cut drafts nothing this step (it decodes normally).
        active = [(index, request, tokens) for (index, request, tokens, _), whole in computed if whole]
        if not active:
            return drafts
        if len(active) < len(computed):
            logits = logits[torch.tensor([whole for _, whole in computed], dtype=torch.bool)]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for step in range(max(request.max_draft_tokens for _, request, _ in active)):
            if step:
                rows = [row for row, (_, request, _) in enumerate(active)
                        if step < request.max_draft_tokens]
                position = [len(tokens) + step - 1 for _, _, tokens in active]
                logits = self.runner.forward_last([
                    DraftSequence([drafts[active[row][0]].token_ids[-1]], position[row],
                                  self._states[active[row][1].request_id].block_ids)
                    for row in rows])
            else:
                rows = list(range(len(active)))
            for logits_row, row in enumerate(rows):
                index, request, _ = active[row]
                token_id, q = self._draw(logits[logits_row], request, step)
                drafts[index].token_ids.append(token_id)
                if q is not None:
                    probs[row].append(q)
        for row, (index, request, tokens) in enumerate(active):
            draft = drafts[index]
            # K/V was written for every draft but the last (the chain feeds it to no forward).
            self._states[request.request_id].token_ids = tokens + draft.token_ids[:-1]
            if probs[row]:
                draft.probs = torch.stack(probs[row])
        return drafts

    def _fit_budget(self, planned: list[tuple[int, DraftRequest, list[int], DraftSequence]]
                    ) -> list[bool]:
        """Cut the catch-up sequences to the step's budget (a long prompt's first catch-up is
        spread over steps, as the model's own prefill is chunked): shortest first, so requests
        already drafting (one or two tokens) always fit. Returns, in ``planned`` order, whether each sequence is whole (then it drafts this
        step); a cut one is shortened in place (possibly to nothing) and records the tokens it
        does compute as cached."""
        per_request = self.max_catch_up_tokens
        left = self.max_forward_tokens
        is_whole = [True] * len(planned)
        for row in sorted(range(len(planned)), key=lambda r: len(planned[r][3].token_ids)):
            _, request, tokens, sequence = planned[row]
            allowed = len(sequence.token_ids)
            if per_request is not None:
                allowed = min(allowed, per_request)
            if left is not None:
                allowed = min(allowed, left)
                left -= allowed
            if allowed < len(sequence.token_ids):
                is_whole[row] = False
                del sequence.token_ids[allowed:]
                self._states[request.request_id].token_ids = tokens[:sequence.start_position + allowed]
        return is_whole

    def _catch_up(self, request: DraftRequest, tokens: list[int]) -> DraftSequence | None:
        """Roll the request's cached prefix back to what still holds, hold the blocks this step
        writes (through draft k - 1) and return its catch-up sequence; None: no room, no draft."""
        state = self._states.setdefault(request.request_id, _DraftState())
        num_cached = 0
        limit = min(len(state.token_ids), len(tokens) - 1)  # at least one token gives the logits
        while num_cached < limit and state.token_ids[num_cached] == tokens[num_cached]:
            num_cached += 1
        del state.token_ids[num_cached:]
        block_size = self.runner.block_size
        num_needed = -(-(len(tokens) + request.max_draft_tokens - 1) // block_size)
        if len(state.block_ids) > num_needed:
            self.blocks.release(state.block_ids[num_needed:])
            del state.block_ids[num_needed:]
        elif len(state.block_ids) < num_needed:
            more = self.blocks.allocate(num_needed - len(state.block_ids))
            if more is None:
                self.num_pool_misses += 1
                return None
            state.block_ids.extend(more)
        return DraftSequence(tokens[num_cached:], num_cached, state.block_ids)

    def _draw(self, logits: torch.Tensor, request: DraftRequest,
              step: int) -> tuple[int, torch.Tensor | None]:
        """Draft ``step`` of ``request``: the argmax (greedy), or a draw from
        softmax(logits / temperature), returned with that distribution."""
        if request.temperature == 0.0:  # greedy (DraftRequest.temperature)
            return int(logits.argmax()), None
        q = _filtered_distribution(logits.float() / request.temperature, request.top_k, request.top_p)
        generator = self._generator
        if request.seed is not None:
            # Depends only on (seed, output length, step), as the sampler's seeded rows do.
            generator = torch.Generator().manual_seed(
                (request.seed * 0x9E3779B97F4A7C15 + len(request.output_token_ids) * 1_000_003
                 + step) & _UINT64_MASK)
        return int(torch.multinomial(q, 1, generator=generator)), q


def seeded_generator(seed: int | None) -> torch.Generator:
    """A model proposer's generator for requests without a seed: ``seed`` (the server's --seed)
    makes their drafts reproducible across runs; None seeds it from the OS."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _filtered_distribution(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """softmax of ``logits`` ``[vocab]`` restricted to its top_k tokens, then its top_p nucleus
    (the most likely token always stays)."""
    vocab_size = logits.shape[0]
    if 0 < top_k < vocab_size:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        is_removed = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        probs = probs.index_put((order[is_removed],), torch.zeros(()))
        probs = probs / probs.sum()
    return probs
