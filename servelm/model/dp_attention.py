"""DP attention (--enable-dp-attention): which rank runs each sequence's attention, and one rank's
share of a step.

Layout. Every rank holds the whole model except the routed experts (attention, dense MLPs,
embedding, LM head: replicated, tp 1), and its share of the experts (``ExpertParallelMoE`` with
``local_tokens``). Every rank receives every plan (the scheduler on rank 0 plans the whole batch,
as under TP) and runs only the sequences assigned to it: their attention over its own KV pool,
their MoE rows dispatched to the experts' ranks and combined. The logits rows travel to rank 0,
as hidden states (rank 0 computes the LM head) or, with --enable-dp-lm-head, as logits (each rank
computes its own rows').

Invariants:
- Each rank's KV pool holds ``blocks_per_rank`` blocks: partition ``r`` of the engine's block ids
  (``r * blocks_per_rank`` up to the next partition; cache/block_pool.py). The scheduler gives all
  of a sequence's blocks from one partition (engine/kv_manager.py), so a sequence runs on the rank
  of its first block, for its life, and every rank computes the same assignment from the plan alone.
- A rank's plan names its own pool's blocks: the engine's ids less its partition's first.
- A prefix-cache hit shares blocks of one partition only (the kv manager cuts a cached path where it
  changes partition), so the sharing sequence lands on the rank whose pool wrote them. A block copy
  (a beam fork) stays in its partition and runs on that rank.
- A rank with no sequence in a pass still calls every MoE layer, with no rows, in layer order: the
  other ranks' rows for its experts arrive in the all-to-alls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers.moe import Routing


@dataclass
class AttentionRanks:
    """Which rank runs each sequence: the rank whose pool partition holds its blocks."""

    num_ranks: int
    blocks_per_rank: int = 0
    """Blocks of each rank's pool (set when the pool is sized: ``ModelRunner.init_kv_cache``)."""

    def rank_of(self, block_ids: list[int]) -> int:
        rank = block_ids[0] // self.blocks_per_rank
        assert all(block // self.blocks_per_rank == rank for block in block_ids), (
            f"a sequence's blocks {block_ids} span the pools of several ranks ({self.blocks_per_rank} a rank)")
        return rank

    def assign(self, plan: BatchPlan) -> list[int]:
        """Each of the plan's sequences' rank, in plan order."""
        return [self.rank_of(sequence.block_ids) for sequence in plan.sequences]

    def local(self, sequence: SequencePlan, rank: int) -> SequencePlan:
        """``sequence`` (of ``rank``) naming the blocks of its rank's pool."""
        first = rank * self.blocks_per_rank
        return dataclasses.replace(sequence, block_ids=[block - first for block in sequence.block_ids])

    def own_copies(self, copies: list[tuple[int, int]], rank: int) -> list[tuple[int, int]]:
        """The (source, destination) block copies within ``rank``'s pool, in its own ids."""
        first = rank * self.blocks_per_rank
        return [(source - first, destination - first) for source, destination in copies
                if self.rank_of([source, destination]) == rank]


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a plan under DP attention."""

    plan: BatchPlan
    """This rank's sequences, naming its own pool's blocks (its block copies were made before)."""
    logits_counts: list[int]
    """Logits rows each rank contributes, in rank order."""
    plan_rows: torch.Tensor
    """``[plan.num_logits]`` int64: where each logits row of the whole plan (plan order) sits in
    the rows gathered in rank order."""


def rank_share(plan: BatchPlan, attention_ranks: AttentionRanks, rank: int) -> RankShare:
    """``rank``'s share of ``plan``: its sequences, naming its own pool's blocks."""
    num_ranks = attention_ranks.num_ranks
    ranks = attention_ranks.assign(plan)
    counts = [0] * num_ranks
    rank_rows: list[list[int]] = [[] for _ in range(num_ranks)]   # per rank, its rows' plan rows
    plan_row = 0
    for sequence, owner in zip(plan.sequences, ranks):
        rank_rows[owner].extend(range(plan_row, plan_row + sequence.num_logits))
        counts[owner] += sequence.num_logits
        plan_row += sequence.num_logits
    gathered_order = [row for rows in rank_rows for row in rows]   # gathered index -> plan row
    plan_rows = torch.empty(len(gathered_order), dtype=torch.int64)
    plan_rows[torch.tensor(gathered_order, dtype=torch.int64)] = torch.arange(len(gathered_order))
    mine = BatchPlan([attention_ranks.local(s, rank) for s, owner in zip(plan.sequences, ranks) if owner == rank])
    return RankShare(mine, counts, plan_rows)


def run_idle_experts(blocks: list[torch.nn.Module], hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """A rank with no rows this pass: every MoE layer's experts, in layer order, with none of its
    own (it computes the rows the other ranks send its experts)."""
    rows = torch.empty(0, hidden_size, dtype=dtype, device=device)
    nothing = Routing(torch.empty(0, 1, dtype=torch.float32, device=device),
                      torch.empty(0, 1, dtype=torch.int64, device=device))
    for block in blocks:
        block.experts(rows, nothing)
