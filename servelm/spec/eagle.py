"""The EAGLE / EAGLE-3 proposer: a draft head over the model's own hidden states drafts a chain of
k tokens (topk 1), one head step per token.

The head's entry at position p reads the token at p + 1 and the model's feature (hidden state) of
position p, and predicts the token at p + 2. The model computes features for the tokens it runs;
the engine hands the accepted ones over after each step (``add_features``). A step, batched over
the requests it drafts for:

1. catch up: one head forward over the entries whose feature arrived since the last step (the
   whole prompt the first time, then the last token and the accepted drafts), each paired with the
   token after it; the last one, for the model's last computed position N - 2, gives draft 1;
2. chain: k - 1 one-token head forwards, each on the draft just chosen, with the head's own output
   feature of the entry before in place of the model's;
   or tree (--speculative-eagle-topk K > 1, ``spec/tree.py``): num_steps - 1 head forwards, each
   over a request's K frontier nodes at once (a tree attention mask: a node sees the head's
   context and its own ancestors), then the best --num-speculative-tokens candidates by
   cumulative log-probability form the tree. Frontier entries of depth d sit at head entries
   ``E + (d - 1) * K ..`` (E: the first entry after the catch-up), scratch like a chain's.

Invariants:
- Entry i of a request's head KV holds (token ``offset + i + 1``, model feature ``offset + i``) for
  ``i < num_entries``; chain entries past ``num_entries`` are scratch, overwritten by the next
  catch-up, so a rejected draft never stays in the head's context. Rollback needs no comparison:
  the model's features only ever arrive for accepted tokens.
- ``offset`` is the first position whose feature the head saw: a prefix-cache hit or a preemption
  leaves the earlier positions without features, and the head's positions (rope) are shifted by
  ``offset``, which keeps every relative position, so the head simply sees a shorter context.
  Features that do not continue a request's entries (recompute after preemption) restart it.
- Greedy drafts are the head's argmax (a point mass); a sampling request's draft is drawn from the
  head's distribution within its top_k / top_p, returned over the model's vocabulary (zero outside
  a reduced draft vocabulary) for ``verify.rejection_sample``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from servelm.spec.draft_model import DraftBlocks, DraftSequence, _filtered_distribution, seeded_generator
from servelm.spec.proposer import Draft, DraftRequest
from servelm.spec.tree import Candidate, select_tree

ABSORB_ROWS = 256
"""Features a request may hold before ``absorb`` writes them into the head's KV ahead of a
propose: long prompts and requests not drafting (--speculative-disable-by-batch-size) would
otherwise keep every token's feature (EAGLE-3: 3 x hidden floats) until their next draft."""

_UINT64_MASK = (1 << 64) - 1


class EagleRunner(Protocol):
    """The head (``servelm.model.eagle.EagleHeadRunner``): batched forwards over its own KV pool."""

    block_size: int
    vocab_size: int
    """The model's vocabulary: drafts are model token ids."""
    draft_to_target: torch.Tensor | None
    """``[draft_vocab]`` model token id of each logits column (None: the model's own vocabulary)."""

    def forward(self, sequences: list[DraftSequence], features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[n, draft_vocab]`` float32 logits, ``[n, hidden]`` output feature) of each sequence's
        last token (of every token of a sequence with ``tree_parents``); ``features`` has one row
        per token of the sequences, in order."""
        ...


class FeatureSource(Protocol):
    """Where the model's features of the last forward wait (``servelm.model.eagle.HiddenCapture``)."""

    def take(self) -> torch.Tensor | None:
        """``[num_tokens, width]`` of the last forward's plan, once (None: taken or none ran)."""
        ...


@dataclass(slots=True)
class _HeadState:
    offset: int
    """Model position whose feature head entry 0 holds."""
    num_entries: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    """Model features of positions ``offset + num_entries ..``, not yet in the head's KV."""
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """The model position whose feature is expected next."""
        return self.offset + self.num_entries + self.num_pending


class EagleProposer:
    """Chains of drafts from an EAGLE head, batched over the step's requests."""

    def __init__(self, name: str, runner: EagleRunner, blocks: DraftBlocks,
                 seed: int | None = None, feature_source: FeatureSource | None = None,
                 topk: int = 1, num_steps: int | None = None) -> None:
        self.name = name
        self.topk = topk
        """Children kept per head step (--speculative-eagle-topk); > 1 drafts trees."""
        self.num_steps = num_steps
        """Head steps (tree depth, --speculative-num-steps); None: the request's draft count."""
        self.runner = runner
        self.blocks = blocks
        self.feature_source = feature_source
        """The model's features of each step (None: the caller calls ``add_features`` itself)."""
        self._states: dict[str, _HeadState] = {}
        self._generator = seeded_generator(seed)
        self.num_pool_misses = 0
        """Request-steps left without drafts because the head's pool was short."""
        self.absorb_rows = ABSORB_ROWS

    @property
    def num_held_blocks(self) -> int:
        return sum(len(state.block_ids) for state in self._states.values())

    def held_request_ids(self) -> set[str]:
        return set(self._states)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.block_ids:
            self.blocks.release(state.block_ids)

    def take_features(self) -> torch.Tensor | None:
        """The last forward's features of every planned token (see ``FeatureSource``)."""
        return None if self.feature_source is None else self.feature_source.take()

    def add_features(self, request_id: str, start_position: int, features: torch.Tensor) -> None:
        """The model's features ``[n, width]`` of positions ``start_position ..`` of a request
        (accepted tokens only)."""
        if not features.shape[0]:
            return
        state = self._states.get(request_id)
        if state is None or start_position != state.next_position:
            self.release(request_id)
            state = self._states[request_id] = _HeadState(offset=start_position)
        state.pending.append(features)
        state.num_pending += features.shape[0]

    def absorb(self, requests: list[tuple[str, list[int]]]) -> None:
        """Write the entries of requests holding more than ``absorb_rows`` features into the
        head's KV now (one batched forward), all but the last, which the next propose reads for
        its first draft. ``requests``: (request id, its tokens known so far)."""
        sequences: list[DraftSequence] = []
        features: list[torch.Tensor] = []
        for request_id, tokens in requests:
            state = self._states.get(request_id)
            if state is None or state.num_pending <= self.absorb_rows:
                continue
            count = state.num_pending - 1
            first = state.offset + state.num_entries
            if len(tokens) < first + count + 1 or not self._hold_blocks(state, state.num_entries + count):
                continue
            pending = torch.cat(state.pending)
            sequences.append(DraftSequence(tokens[first + 1:first + count + 1], state.num_entries,
                                           state.block_ids))
            features.append(pending[:count])
            state.pending, state.num_pending = [pending[count:]], 1
            state.num_entries += count
        if sequences:
            self.runner.forward(sequences, torch.cat(features), True)

    def _hold_blocks(self, state: _HeadState, num_positions: int) -> bool:
        """Grow the request's blocks to hold ``num_positions`` head entries (False: pool short)."""
        num_needed = -(-num_positions // self.runner.block_size)
        if len(state.block_ids) < num_needed:
            more = self.blocks.allocate(num_needed - len(state.block_ids))
            if more is None:
                return False
            state.block_ids.extend(more)
        return True

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        active: list[tuple[int, DraftRequest, int]] = []  # (index, request, number of tokens)
        sequences: list[DraftSequence] = []
        features: list[torch.Tensor] = []
        for index, request in enumerate(requests):
            tokens = request.prompt_token_ids + request.output_token_ids
            sequence = self._catch_up(request, tokens)
            if sequence is not None:
                state = self._states[request.request_id]
                active.append((index, request, len(tokens)))
                sequences.append(sequence)
                features.append(torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0])
                state.num_entries += state.num_pending
                state.pending, state.num_pending = [], 0
        if not active:
            return drafts
        logits, feature = self.runner.forward(sequences, torch.cat(features), True)
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        rows = list(range(len(active)))  # rows of ``active`` that ``logits`` / ``feature`` hold
        tree_rows = [row for row in rows if self._is_tree(active[row][1])]
        if tree_rows:
            self._grow_trees([active[row] for row in tree_rows], logits[tree_rows],
                             feature[tree_rows], drafts)
            rows = [row for row in rows if row not in set(tree_rows)]
            logits, feature = logits[rows], feature[rows]
        for step in range(max((self._chain_length(active[row][1]) for row in rows), default=0)):
            if step:
                kept = [position for position, row in enumerate(rows)
                        if step < self._chain_length(active[row][1])]
                rows = [rows[position] for position in kept]
                chain = []
                for row in rows:
                    index, request, num_tokens = active[row]
                    state = self._states[request.request_id]
                    chain.append(DraftSequence([drafts[index].token_ids[-1]],
                                               num_tokens - 2 - state.offset + step, state.block_ids))
                logits, feature = self.runner.forward(chain, feature[kept], False)
            for logits_row, row in enumerate(rows):
                index, request, _ = active[row]
                token_id, q = self._draw(logits[logits_row], request, step)
                drafts[index].token_ids.append(token_id)
                if q is not None:
                    probs[row].append(q)
        for row, (index, _, _) in enumerate(active):
            if probs[row]:
                drafts[index].probs = torch.stack(probs[row])
        return drafts

    def _catch_up(self, request: DraftRequest, tokens: list[int]) -> DraftSequence | None:
        """The request's catch-up sequence (entries for the features that arrived), holding the
        blocks through draft k - 1; None: nothing new to read, or no room (no draft)."""
        state = self._states.get(request.request_id)
        if state is None or not state.num_pending or state.next_position != len(tokens) - 1:
            return None  # not a decode whose features all arrived (or the head has none yet)
        last_entry = len(tokens) - 2 - state.offset + self._num_scratch_entries(request)
        num_needed = -(-(last_entry + 1) // self.runner.block_size)
        if len(state.block_ids) > num_needed:
            self.blocks.release(state.block_ids[num_needed:])
            del state.block_ids[num_needed:]
        elif len(state.block_ids) < num_needed:
            more = self.blocks.allocate(num_needed - len(state.block_ids))
            if more is None:
                self.num_pool_misses += 1
                return None
            state.block_ids.extend(more)
        first = state.offset + state.num_entries
        return DraftSequence(tokens[first + 1:], state.num_entries, state.block_ids)

    def _is_tree(self, request: DraftRequest) -> bool:
        """With topk > 1 every request drafts a tree (one node when only one draft fits: the
        head's top token), greedy or sampling: its drafts are point masses (``spec/tree.py``)."""
        return self.topk > 1

    def _chain_length(self, request: DraftRequest) -> int:
        """Drafts of a chain: the request's count, at most --speculative-num-steps."""
        if self.num_steps is None:
            return request.max_draft_tokens
        return min(request.max_draft_tokens, self.num_steps)

    def _num_scratch_entries(self, request: DraftRequest) -> int:
        """Head entries past the catch-up that drafting writes (chain: k - 1; tree: the frontier
        entries of depths 1 .. num_steps - 1)."""
        if self._is_tree(request):
            return (self._tree_depth(request) - 1) * self.topk
        return max(self._chain_length(request) - 1, 0)

    def _tree_depth(self, request: DraftRequest) -> int:
        return min(self.num_steps or request.max_draft_tokens, request.max_draft_tokens)

    def _grow_trees(self, items: list[tuple[int, DraftRequest, int]], logits: torch.Tensor,
                    feature: torch.Tensor, drafts: list[Draft]) -> None:
        """Draft trees for ``items`` (index, request, number of tokens) from the head's logits and
        output feature after each root; the frontier steps run batched over the requests."""
        topk = self.topk
        num_items = len(items)
        candidates: list[list[Candidate]] = [[] for _ in items]
        entry_parents: list[list[int]] = [[] for _ in items]  # head tree entries' parents
        frontier: list[list[int]] = [[] for _ in items]      # candidate index of each frontier node
        parent_ranks: list[list[int]] = [[] for _ in items]  # its parent's rank in the frontier before
        values, ids = self._top_children(logits)                        # [n][K] each
        for item in range(num_items):
            for rank in range(topk):
                candidates[item].append(Candidate(ids[item][rank], -1, values[item][rank], 1))
                frontier[item].append(rank)
        frontier_feature = feature.repeat_interleave(topk, dim=0)        # [n * K, hidden]
        depths = [self._tree_depth(request) for _, request, _ in items]
        for depth in range(2, max(depths) + 1):
            growing = [item for item in range(num_items) if depth <= depths[item]]
            sequences = []
            for item in growing:
                _, request, num_tokens = items[item]
                state = self._states[request.request_id]
                first_entry = num_tokens - 1 - state.offset
                # the frontier (depth - 1) goes to entries (depth - 2) * K ..; its parents' at one
                # level before
                entry_parents[item].extend([-1] * topk if depth == 2 else
                                           [(depth - 3) * topk + rank for rank in parent_ranks[item]])
                sequences.append(DraftSequence(
                    [candidates[item][c].token_id for c in frontier[item]],
                    first_entry + (depth - 2) * topk, self._states[request.request_id].block_ids,
                    tree_parents=list(entry_parents[item]), tree_first_position=first_entry))
            rows = torch.tensor([item * topk + rank for item in growing for rank in range(topk)])
            step_logits, step_feature = self.runner.forward(sequences, frontier_feature[rows], False)
            step_values, step_ids = self._top_children(step_logits)
            next_feature = frontier_feature.clone()
            for position, item in enumerate(growing):
                base = len(candidates[item])
                scores = []
                for rank in range(topk):
                    parent = frontier[item][rank]
                    row = position * topk + rank
                    for child in range(topk):
                        score = candidates[item][parent].score + step_values[row][child]
                        candidates[item].append(Candidate(step_ids[row][child], parent, score, depth))
                        scores.append(score)
                best = sorted(range(len(scores)), key=lambda i: -scores[i])[:topk]
                frontier[item] = [base + i for i in best]
                parent_ranks[item] = [i // topk for i in best]
                next_feature[item * topk:(item + 1) * topk] = step_feature[
                    torch.tensor([position * topk + i // topk for i in best])]
            frontier_feature = next_feature
        for item, (index, request, _) in enumerate(items):
            token_ids, parents = select_tree(candidates[item], request.max_draft_tokens)
            drafts[index] = Draft(token_ids, parents=parents)

    def _top_children(self, logits: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Per row, the K best tokens (model ids) and their head log-probabilities."""
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(self.topk, dim=-1)
        to_target = self.runner.draft_to_target
        if to_target is not None:
            ids = to_target[ids]
        return values.tolist(), ids.tolist()

    def _draw(self, logits: torch.Tensor, request: DraftRequest,
              step: int) -> tuple[int, torch.Tensor | None]:
        """Draft ``step``: the argmax (greedy) or a draw from the head's distribution, as a model
        token id with that distribution over the model's vocabulary."""
        to_target = self.runner.draft_to_target
        if request.temperature == 0.0:  # greedy (DraftRequest.temperature)
            draft = int(logits.argmax())
            return (draft if to_target is None else int(to_target[draft])), None
        q = _filtered_distribution(logits.float() / request.temperature, request.top_k, request.top_p)
        generator = self._generator
        if request.seed is not None:
            generator = torch.Generator().manual_seed(
                (request.seed * 0x9E3779B97F4A7C15 + len(request.output_token_ids) * 1_000_003
                 + step) & _UINT64_MASK)
        draft = int(torch.multinomial(q.cpu(), 1, generator=generator))
        if to_target is None:
            return draft, q
        full = torch.zeros(self.runner.vocab_size, dtype=q.dtype, device=q.device)
        full[to_target] = q
        return int(to_target[draft]), full
