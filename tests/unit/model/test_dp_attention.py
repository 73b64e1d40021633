"""DP attention's assignment of sequences to ranks (model/dp_attention.py): a sequence runs on the
rank whose pool partition holds its blocks, naming them by that pool's own ids; block copies run
on their partition's rank; and the rows of each rank gathered in rank order come back in plan order."""

from __future__ import annotations

import pytest
import torch

from servelm.model.dp_attention import AttentionRanks, rank_share
from servelm.model.forward_batch import BatchPlan, SequencePlan

RANKS = AttentionRanks(2, blocks_per_rank=10)
"""Rank 0's pool: the engine's blocks 0-9; rank 1's: 10-19."""


def sequence(block_ids: list[int], num_tokens: int = 2, num_logits: int = 1) -> SequencePlan:
    return SequencePlan(list(range(num_tokens)), 0, block_ids, num_logits)


def test_a_sequence_runs_where_its_blocks_are_in_that_pool_s_ids() -> None:
    plan = BatchPlan([sequence([12, 13]), sequence([3]), sequence([19, 10, 11])])
    assert RANKS.assign(plan) == [1, 0, 1]
    share = rank_share(plan, RANKS, 1)
    assert [s.block_ids for s in share.plan.sequences] == [[2, 3], [9, 0, 1]]
    assert plan.sequences[0].block_ids == [12, 13]   # the engine's plan is left as it was
    assert RANKS.own_copies([(3, 4), (15, 17)], 1) == [(5, 7)] and RANKS.own_copies([(3, 4)], 1) == []
    with pytest.raises(AssertionError, match="span the pools of several ranks"):
        RANKS.assign(BatchPlan([sequence([9, 10])]))


def test_gathered_rows_return_in_plan_order() -> None:
    plan = BatchPlan([sequence([11], 4, 2), sequence([2], 3, 0), sequence([3], 2, 1), sequence([14], 1, 1)])
    share = rank_share(plan, RANKS, 0)
    assert [s.block_ids for s in share.plan.sequences] == [[2], [3]]
    assert share.logits_counts == [1, 3]
    plan_rows = torch.tensor([10, 11, 30, 40])     # each logits row's label, plan order
    gathered = torch.tensor([30, 10, 11, 40])      # rank 0's rows, then rank 1's
    assert torch.equal(gathered[share.plan_rows], plan_rows)
