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
- The assignment is a pure function of the plans seen so far, in order; every rank sees the same
  plans in the same order, so every rank computes the same assignment without exchanging it.
- A sequence keeps its rank for its life: its rank is recorded under its first KV block, which a
  sequence holds from its first token to its end. A sequence whose pass starts at position 0 is
  new (its first block is fresh) and goes to the rank with the fewest sequences in this pass (then
  the fewest tokens, then the lowest rank); any other looks its rank up.
- A prefix-cache hit shares its cached blocks from the first one on (the cache matches prefixes),
  so the sharing sequence lands on the rank whose pool wrote those blocks. Block copies (beam
  forks) run on every rank. Each rank's pool has the engine's block ids and holds K/V only in its
  own sequences' blocks.
- A rank with no sequence in a pass still calls every MoE layer, with no rows, in layer order: the
  other ranks' rows for its experts arrive in the all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers.moe import Routing


@dataclass
class AttentionRanks:
    """The rank of every live sequence, by its first KV block (see the module invariants)."""

    num_ranks: int
    rank_of_first_block: dict[int, int] = field(default_factory=dict)

    def assign(self, plan: BatchPlan) -> list[int]:
        """Each of the plan's sequences' rank, in plan order (new ones placed and recorded)."""
        ranks = [self._known_rank(sequence) for sequence in plan.sequences]
        num_sequences, num_tokens = [0] * self.num_ranks, [0] * self.num_ranks
        for sequence, rank in zip(plan.sequences, ranks):
            if rank is not None:
                num_sequences[rank] += 1
                num_tokens[rank] += len(sequence.token_ids)
        placed: list[int] = []
        for sequence, known in zip(plan.sequences, ranks):
            rank = known
            if rank is None:
                rank = min(range(self.num_ranks), key=lambda r: (num_sequences[r], num_tokens[r], r))
                num_sequences[rank] += 1
                num_tokens[rank] += len(sequence.token_ids)
                self.rank_of_first_block[sequence.block_ids[0]] = rank
            placed.append(rank)
        return placed

    def _known_rank(self, sequence: SequencePlan) -> int | None:
        """The rank of a sequence that began in an earlier pass; None for a new one."""
        if sequence.start_position == 0:
            return None
        rank = self.rank_of_first_block.get(sequence.block_ids[0])
        assert rank is not None, (f"a sequence at position {sequence.start_position} whose first block "
                                  f"{sequence.block_ids[0]} no earlier pass computed")
        return rank


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a plan under DP attention."""

    plan: BatchPlan
    """This rank's sequences (the whole plan's block copies were applied on every rank before)."""
    logits_counts: list[int]
    """Logits rows each rank contributes, in rank order."""
    plan_rows: torch.Tensor
    """``[plan.num_logits]`` int64: where each logits row of the whole plan (plan order) sits in
    the rows gathered in rank order."""


def rank_share(plan: BatchPlan, ranks: list[int], rank: int, num_ranks: int) -> RankShare:
    """``rank``'s share of ``plan`` whose sequences run on ``ranks``."""
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
    mine = BatchPlan([s for s, owner in zip(plan.sequences, ranks) if owner == rank])
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
