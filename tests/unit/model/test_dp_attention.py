"""DP attention's assignment of sequences to ranks (model/dp_attention.py): a new sequence goes to
the rank with the fewest sequences in its pass, a continuing one (a later chunk, a decode, a
prefix-cache hit on its first block) to the rank that computed its first block; and the rows of
each rank gathered in rank order come back in plan order."""

from __future__ import annotations

import torch

from servelm.model.dp_attention import AttentionRanks, rank_share
from servelm.model.forward_batch import BatchPlan, SequencePlan


def sequence(first_block: int, start: int, num_tokens: int, num_logits: int = 1) -> SequencePlan:
    blocks = [first_block] + list(range(100 + first_block * 10, 100 + first_block * 10 + 8))
    return SequencePlan(list(range(num_tokens)), start, blocks, num_logits)


def test_new_sequences_balance_and_continuing_ones_stay() -> None:
    ranks = AttentionRanks(2)
    assert ranks.assign(BatchPlan([sequence(1, 0, 5)])) == [0]
    # a decode of sequence 1 and a prefix-cache hit on its first block stay on rank 0; new ones fill rank 1 first
    plan = BatchPlan([sequence(2, 0, 9), sequence(1, 5, 1), sequence(1, 8, 3), sequence(3, 0, 2), sequence(4, 0, 2)])
    assert ranks.assign(plan) == [1, 0, 0, 1, 0]   # the last: a tie in sequences, rank 0 has fewer tokens
    # block 2 freed and handed to a new sequence (it starts at 0): placed afresh
    assert ranks.assign(BatchPlan([sequence(3, 2, 1), sequence(2, 0, 4)])) == [1, 0]


def test_gathered_rows_return_in_plan_order() -> None:
    plan = BatchPlan([sequence(1, 0, 4, 2), sequence(2, 0, 3, 0), sequence(3, 0, 2, 1), sequence(4, 0, 1, 1)])
    owners = [1, 0, 0, 1]
    share = rank_share(plan, owners, 0, 2)
    assert [s.block_ids[0] for s in share.plan.sequences] == [2, 3]
    assert share.logits_counts == [1, 3]
    plan_rows = torch.tensor([10, 11, 30, 40])     # each logits row's label, plan order
    gathered = torch.tensor([30, 10, 11, 40])      # rank 0's rows, then rank 1's
    assert torch.equal(gathered[share.plan_rows], plan_rows)
