"""EagleProposer's bookkeeping with a scripted head: which tokens, head positions and features each
forward gets (catch-up pairs token p + 1 with the model's feature of p; the chain feeds the head's
own output feature), the offset after a prefix hit, restarts, blocks held and released, and the
reduced-vocabulary mapping of EAGLE-3 drafts."""

from __future__ import annotations

import torch

from servelm.cache.block_pool import BlockPool
from servelm.spec.draft_model import DraftSequence
from servelm.spec.eagle import EagleProposer
from servelm.spec.proposer import DraftRequest

VOCAB = 16


class ScriptedHead:
    """Logits favour (last token + 1) % VOCAB; the output feature is the input's last row + 100.
    Records (tokens, start, features as ints, is_target_feature) of every forward."""

    block_size = 4
    vocab_size = VOCAB

    def __init__(self, draft_to_target: torch.Tensor | None = None) -> None:
        self.calls: list[list[tuple[list[int], int]]] = []
        self.features: list[tuple[list[int], bool]] = []
        self.draft_to_target = draft_to_target

    def forward(self, sequences: list[DraftSequence], features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert features.shape[0] == sum(len(s.token_ids) for s in sequences)
        self.calls.append([(list(s.token_ids), s.start_position) for s in sequences])
        self.features.append(([int(f) for f in features[:, 0]], is_target_feature))
        width = VOCAB if self.draft_to_target is None else len(self.draft_to_target)
        logits = torch.zeros(len(sequences), width)
        row, last_rows = 0, []
        for index, sequence in enumerate(sequences):
            num_positions = sequence.start_position + len(sequence.token_ids)
            assert len(sequence.block_ids) * self.block_size >= num_positions
            logits[index, (sequence.token_ids[-1] + 1) % width] = 5.0
            row += len(sequence.token_ids)
            last_rows.append(row - 1)
        return logits, features[last_rows] + 100


def feature_rows(start: int, count: int) -> torch.Tensor:
    """Feature of position p: p in every column."""
    return torch.arange(start, start + count, dtype=torch.float32)[:, None].repeat(1, 3)


def request(output: list[int], k: int = 3, prompt: list[int] | None = None) -> DraftRequest:
    return DraftRequest("a", prompt or [1, 2, 3, 4, 5], output, k)


def test_catch_up_chain_and_rollback() -> None:
    head, pool = ScriptedHead(), BlockPool(8)
    proposer = EagleProposer("EAGLE", head, pool)
    proposer.add_features("a", 0, feature_rows(0, 5))      # the prompt's 5 positions
    [draft] = proposer.propose([request([6])])
    assert draft.token_ids == [7, 8, 9]
    # catch-up: entries 0..4 pair tokens 2..6 with features 0..4; chain entries 5, 6 read the
    # head's own output feature
    assert head.calls == [[([2, 3, 4, 5, 6], 0)], [([7], 5)], [([8], 6)]]
    assert head.features == [([0, 1, 2, 3, 4], True), ([104], False), ([204], False)]
    assert proposer.num_held_blocks == 2
    # The model accepted 7, then said 0: features of positions 5 (token 6) and 6 (token 7) arrive.
    head.calls.clear()
    head.features.clear()
    proposer.add_features("a", 5, feature_rows(5, 2))
    [draft] = proposer.propose([request([6, 7, 0])])
    assert head.calls[0] == [([7, 0], 5)]                   # scratch entries 5, 6 overwritten
    assert head.features[0] == ([5, 6], True)
    assert draft.token_ids == [1, 2, 3]
    proposer.release("a")
    assert pool.num_free_blocks == 8 and proposer.held_request_ids() == set()


def test_prefix_hit_offsets_positions_and_restart_on_recompute() -> None:
    head, pool = ScriptedHead(), BlockPool(8)
    proposer = EagleProposer("EAGLE", head, pool)
    proposer.add_features("a", 3, feature_rows(3, 2))      # positions 0..2 came from the cache
    [draft] = proposer.propose([request([6])])
    assert head.calls[0] == [([5, 6], 0)] and draft.token_ids == [7, 8, 9]
    # Features that do not continue the entries (a recompute after preemption) start over.
    proposer.add_features("a", 0, feature_rows(0, 5))
    assert pool.num_free_blocks == 8
    head.calls.clear()
    proposer.propose([request([6])])
    assert head.calls[0] == [([2, 3, 4, 5, 6], 0)]


def test_no_draft_without_fresh_features_or_room() -> None:
    proposer = EagleProposer("EAGLE", ScriptedHead(), BlockPool(1))
    assert proposer.propose([request([6])])[0].token_ids == []   # no features yet
    proposer.add_features("a", 0, feature_rows(0, 4))             # one short of the decode
    assert proposer.propose([request([6])])[0].token_ids == []
    proposer.add_features("a", 4, feature_rows(4, 1))
    assert proposer.propose([request([6])])[0].token_ids == []   # 2 blocks needed, 1 in the pool
    assert proposer.num_pool_misses == 1


def test_reduced_vocabulary_maps_drafts_and_their_distribution() -> None:
    to_target = torch.tensor([0, 3, 5, 7, 8, 9, 10, 12])       # 8 draft tokens -> model ids
    proposer = EagleProposer("EAGLE3", ScriptedHead(to_target), BlockPool(8), seed=0)
    proposer.add_features("a", 0, feature_rows(0, 5))
    [greedy] = proposer.propose([request([6], k=2)])
    # draft column (6 + 1) % 8 = 7 -> model token 12; then column (12 + 1) % 8 = 5 -> 9
    assert greedy.token_ids == [12, 9] and greedy.probs is None
    proposer.release("a")
    proposer.add_features("a", 0, feature_rows(0, 5))
    sampling = DraftRequest("a", [1, 2, 3, 4, 5], [6], 2, temperature=1.0, seed=3)
    [sampled] = proposer.propose([sampling])
    assert sampled.probs is not None and sampled.probs.shape == (2, VOCAB)
    assert torch.allclose(sampled.probs.sum(dim=-1), torch.ones(2))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[to_target] = False
    assert float(sampled.probs[:, outside].sum()) == 0.0
    assert all(int(t) in to_target.tolist() for t in sampled.token_ids)
    assert all(float(sampled.probs[i, t]) > 0 for i, t in enumerate(sampled.token_ids))


def test_absorb_writes_long_pending_features_ahead_of_propose() -> None:
    head, pool = ScriptedHead(), BlockPool(8)
    proposer = EagleProposer("EAGLE", head, pool)
    proposer.absorb_rows = 3
    tokens = [1, 2, 3, 4, 5, 6]
    proposer.add_features("a", 0, feature_rows(0, 3))
    proposer.absorb([("a", tokens)])
    assert head.calls == []                                  # 3 rows: not more than absorb_rows
    proposer.add_features("a", 3, feature_rows(3, 2))
    proposer.absorb([("a", tokens)])
    # entries 0..3 (tokens 2..5, features 0..3) written; feature 4 waits for the propose
    assert head.calls == [[([2, 3, 4, 5], 0)]] and head.features == [([0, 1, 2, 3], True)]
    head.calls.clear()
    [draft] = proposer.propose([request([6])])
    assert head.calls[0] == [([6], 4)] and draft.token_ids == [7, 8, 9]


class ScriptedTreeHead(ScriptedHead):
    """Like ScriptedHead, but logits favour t + 1 (5.0) then t + 2 (4.0), and a tree step's
    sequence gets logits (and output features) for every token."""

    def forward(self, sequences: list[DraftSequence], features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert features.shape[0] == sum(len(s.token_ids) for s in sequences)
        self.calls.append([(list(s.token_ids), s.start_position, s.tree_parents,
                            s.tree_first_position) for s in sequences])  # type: ignore[arg-type]
        self.features.append(([int(f) for f in features[:, 0]], is_target_feature))
        rows, tokens = [], []
        row = 0
        for sequence in sequences:
            assert len(sequence.block_ids) * self.block_size >= sequence.start_position + len(sequence.token_ids)
            count = len(sequence.token_ids) if sequence.tree_parents is not None else 1
            rows += range(row + len(sequence.token_ids) - count, row + len(sequence.token_ids))
            tokens += sequence.token_ids[-count:]
            row += len(sequence.token_ids)
        logits = torch.zeros(len(rows), VOCAB)
        for index, token in enumerate(tokens):
            logits[index, (token + 1) % VOCAB] = 5.0
            logits[index, (token + 2) % VOCAB] = 4.0
        return logits, features[rows] + 100


def test_tree_frontier_steps_entries_and_selection() -> None:
    head, pool = ScriptedTreeHead(), BlockPool(8)
    proposer = EagleProposer("EAGLE", head, pool, topk=2, num_steps=3)
    proposer.add_features("a", 0, feature_rows(0, 5))
    [draft] = proposer.propose([request([6], k=4)])
    # catch-up (entries 0..4), then the depth-1 frontier [7, 8] at entries 5, 6 (both hang off
    # the context), then the depth-2 frontier [7->8, 7->9] at entries 7, 8, children of entry 5
    assert head.calls == [[([2, 3, 4, 5, 6], 0, None, 0)],
                          [([7, 8], 5, [-1, -1], 5)],
                          [([8, 9], 7, [-1, -1, 0, 0], 5)]]
    assert head.features == [([0, 1, 2, 3, 4], True), ([104, 104], False), ([204, 204], False)]
    # best 4 by cumulative log-probability, breadth-first: 7, 8 | 7->8 | 7->8->9
    assert (draft.token_ids, draft.parents) == ([7, 8, 8, 9], [-1, -1, 0, 2])
    assert proposer.num_held_blocks == 3           # entries 0..8
    proposer.release("a")
    assert pool.num_free_blocks == 8
