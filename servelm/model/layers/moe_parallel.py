"""Expert parallelism: whole experts sharded over the tensor-parallel ranks, tokens dispatched to the
rank holding their expert and combined back with all-to-all; and the placement EPLB rebalances.
(An expert-parallel group smaller than the tensor-parallel one: ``ExpertGroupMoE``, at the end; it
places its slots on groups of ranks with the same ``ExpertPlacement``.)

A MoE layer has ``E`` logical experts (the checkpoint's) and ``E + R`` physical slots (``R``
redundant: extra replicas of busy experts). ``ExpertPlacement`` says which logical expert each slot
holds; rank r holds slots ``r * S .. (r + 1) * S - 1`` (``S = (E + R) / ep_size``).

Invariants:
- Under attention TP every rank has every token's hidden state (replicated after the all-reduce)
  and computes the same routing. Rank r takes its ``split`` of the tokens, sends each (token,
  chosen expert) row to the rank holding a replica of that expert (``all_to_all_rows``), computes
  the rows it received with its local slots, sends the results back, and weights and sums each
  token's ``k`` results in choice order; an all-gather of the token slices gives every rank the
  whole output again. Every expert row is computed exactly once, on one rank.
- Which replica a row goes to is a pure function of the placement and the row's global token index
  and choice (round robin over the expert's replicas), so every rank routes alike.
- The output never depends on the placement: replicas hold identical weights, and the ``k``
  results are summed in choice order whatever rank computed them (rebalancing changes which rank
  computes a row, not its value, up to the GEMM's row blocking).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from servelm.distributed.parallel import ParallelContext, even_split
from servelm.model.gguf.gguf_routes import PassRows
from servelm.model.layers.moe import FusedMoE, Routing


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot of one MoE layer holds (``num_ranks`` equal runs)."""

    physical_to_logical: tuple[int, ...]
    num_logical: int
    num_ranks: int

    def __post_init__(self) -> None:
        if len(self.physical_to_logical) % self.num_ranks:
            raise ValueError(f"{len(self.physical_to_logical)} expert slots do not divide among "
                             f"{self.num_ranks} expert-parallel ranks")
        if set(self.physical_to_logical) != set(range(self.num_logical)):
            raise ValueError("every logical expert needs at least one slot")

    @classmethod
    def initial(cls, num_logical: int, num_redundant: int, num_ranks: int) -> ExpertPlacement:
        """Slot p holds expert ``p % E``: experts in order, the redundant slots replicas of the first
        experts (until the first rebalance measures which are busy). ValueError naming the flags
        when ``E + R`` slots do not divide among the ranks."""
        num_physical = num_logical + num_redundant
        if num_physical % num_ranks:
            raise ValueError(f"--ep-size {num_ranks} must divide the {num_logical} experts plus "
                             f"--ep-num-redundant-experts {num_redundant} (each rank holds as many slots)")
        return cls(tuple(p % num_logical for p in range(num_physical)), num_logical, num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each of rank ``rank``'s slots, in slot order."""
        size = self.slots_per_rank
        return self.physical_to_logical[rank * size:(rank + 1) * size]

    @functools.cached_property
    def _replica_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[E, max replicas]`` each expert's slots (the row padded with its first), ``[E]`` how
        many; built once per placement (every MoE forward reads it)."""
        replicas = [[p for p, e in enumerate(self.physical_to_logical) if e == logical]
                    for logical in range(self.num_logical)]
        width = max(len(slots) for slots in replicas)
        return (torch.tensor([slots + slots[:1] * (width - len(slots)) for slots in replicas]),
                torch.tensor([len(slots) for slots in replicas]))

    def to_physical(self, expert_ids: torch.Tensor, first_pair: int = 0) -> torch.Tensor:
        """``[T, k]`` logical ids -> the physical slot each row goes to: round robin over the
        expert's replicas by the row's global token index plus its choice (the global pair index
        is ``first_pair`` + the row's flat index)."""
        table, counts = (tensor.to(expert_ids.device) for tensor in self._replica_table)
        flat = expert_ids.reshape(-1)
        pairs = torch.arange(first_pair, first_pair + flat.numel(), device=flat.device)
        top_k = max(1, expert_ids.shape[-1])
        # token + choice, not the pair index: with an even k the pair index's parity is the choice's,
        # and an expert is far more often a token's first choice than its second
        spread = torch.div(pairs, top_k, rounding_mode="floor") + pairs % top_k
        choice = torch.remainder(spread, counts[flat])
        return table[flat, choice].reshape(expert_ids.shape)

    def rows_per_rank(self, expert_ids: torch.Tensor) -> list[int]:
        """How many of the ``[T, k]`` routing's rows each rank computes."""
        ranks = torch.div(self.to_physical(expert_ids), self.slots_per_rank, rounding_mode="floor")
        return torch.bincount(ranks.reshape(-1), minlength=self.num_ranks).tolist()


def rebalance(load: list[float], num_redundant: int, num_ranks: int) -> ExpertPlacement:
    """A placement for a layer whose logical experts saw ``load`` rows: the ``num_redundant``
    extra slots go one by one to the expert with the most load per replica, then the replicas
    (each carrying its expert's load / replicas) are packed heaviest first onto the rank with the
    least load that still has a free slot (one not yet holding that expert where there is one)."""
    num_logical = len(load)
    num_replicas = [1] * num_logical
    for _ in range(num_redundant):
        busiest = max(range(num_logical), key=lambda e: (load[e] / num_replicas[e], -e))
        num_replicas[busiest] += 1
    items = sorted(((load[e] / num_replicas[e], e) for e in range(num_logical) for _ in range(num_replicas[e])),
                   key=lambda item: (-item[0], item[1]))
    slots = (num_logical + num_redundant) // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for share, expert in items:
        free = [rank for rank in range(num_ranks) if len(ranks[rank]) < slots]
        fresh = [rank for rank in free if expert not in ranks[rank]] or free
        rank = min(fresh, key=lambda r: (totals[r], r))
        ranks[rank].append(expert)
        totals[rank] += share
    return ExpertPlacement(tuple(e for rank_experts in ranks for e in sorted(rank_experts)), num_logical, num_ranks)


def missing_logical_parts(num_logical: int, loaded: set[tuple[int, str]]) -> list[str]:
    """The (logical expert, part) weights no checkpoint tensor has filled, named."""
    return [f"expert {expert} {part}" for expert in range(num_logical)
            for part in ("gate", "up", "down") if (expert, part) not in loaded]


def move_experts(layer: ExpertParallelMoE | ExpertGroupMoE, placement: ExpertPlacement, group: int,
                 column: int, num_columns: int, parallel: ParallelContext) -> None:
    """Move ``layer`` (this rank: expert-parallel ``group``, intermediate ``column`` of
    ``num_columns``; tp rank ``group * num_columns + column``) from its placement to ``placement``.
    Every rank calls this with the same placement, in the same layer order. A slot keeps the weights
    its rank already holds; an expert some group gains comes by broadcast, once per column, from
    the rank of that column in the first group holding it before (every rank takes part in every
    broadcast, and keeps the parts of its own column)."""
    old = layer.placement
    held_before = {e: slot for slot, e in enumerate(old.rank_experts(group))}
    stacks = (layer.gate_up_proj, layer.down_proj)
    new_stacks = [torch.empty_like(stack.data) for stack in stacks]
    column_sizes = [even_split(layer.full_intermediate_size, num_columns, c).size for c in range(num_columns)]
    for expert in range(layer.num_logical):
        wanted = [slot for slot, e in enumerate(placement.rank_experts(group)) if e == expert]
        is_moving = any(expert in placement.rank_experts(g) and expert not in old.rank_experts(g)
                        for g in range(old.num_ranks))
        parts: list[torch.Tensor] = []
        if is_moving:   # some group gains it: its first holder's ranks broadcast, column by column
            root_group = next(g for g in range(old.num_ranks) if expert in old.rank_experts(g))
            for source_column, size in enumerate(column_sizes):
                root = root_group * num_columns + source_column
                shapes = ((2 * size, layer.hidden_size), (layer.hidden_size, size))
                sent = [(stack.data[held_before[expert]].clone() if (group, column) == (root_group, source_column)
                         else stack.new_empty(shape)) for stack, shape in zip(stacks, shapes)]
                for part in sent:
                    parallel.broadcast(part, root)
                if source_column == column:
                    parts = sent
        elif wanted:
            parts = [stack.data[held_before[expert]] for stack in stacks]
        for new, part in zip(new_stacks, parts):
            for slot in wanted:
                new[slot].copy_(part)
    for stack, new in zip(stacks, new_stacks):
        stack.data.copy_(new)
    layer.placement = placement


class PartialExperts(FusedMoE):
    """A rank's share of the routed experts (expert-parallel ranks, or the groups of an EP group
    smaller than TP): loading counts every logical expert, since the others' are theirs to serve."""

    num_logical: int
    loaded_logical: set[tuple[int, str]]

    @property
    def num_checkpoint_experts(self) -> int:
        return self.num_logical

    def drop_stacked(self) -> None:
        """As FusedMoE's: the other ranks' experts are theirs to serve, so nothing is missing."""
        super().drop_stacked()
        self.loaded_logical.update((e, part) for e in range(self.num_logical) for part in ("gate", "up", "down"))


class ExpertParallelMoE(PartialExperts):
    """The routed experts of one MoE layer under expert parallelism: this rank's ``S`` slots (whole
    experts, stacked as FusedMoE stacks them), loaded from the checkpoint by logical expert id, and
    ``forward(x, routing)`` with the all-to-all dispatch and combine (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 *, parallel: ParallelContext, dtype: torch.dtype | None = None,
                 local_tokens: bool = False) -> None:
        placement = ExpertPlacement.initial(num_experts, parallel.num_redundant_experts, parallel.ep_size)
        super().__init__(placement.slots_per_rank, hidden_size, intermediate_size, activation,
                         parallel=ParallelContext.single(), dtype=dtype)
        self.ep = parallel
        self.num_logical = num_experts
        self.placement = placement
        self.loaded_logical: set[tuple[int, str]] = set()
        self.local_tokens = local_tokens
        """DP attention: each rank's ``x`` is its own tokens (no split, no gather; a rank with no
        tokens still calls ``forward`` with none, to meet the others in the all-to-alls)."""

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, routing: Routing, rows: PassRows | None = None) -> torch.Tensor:
        """``[T, H]``: each token's weighted sum over its experts, equal on every rank (with
        ``local_tokens``: this rank's tokens' only; the replica choice then counts pairs from 0 on
        every rank, which changes which replica computes a row, not its value) (``rows``: the
        pass's facts, for the GGUF routes of experts in their blocks)."""
        if self.local_tokens:
            return self.dispatch_and_combine(x, routing, 0, rows)
        num_tokens, top_k = routing.expert_ids.shape
        mine = self.ep.split(num_tokens)
        taken = slice(mine.start, mine.start + mine.size)
        local = Routing(routing.weights[taken], routing.expert_ids[taken])
        out = self.dispatch_and_combine(x[taken], local, mine.start * top_k, rows)
        return self.ep.all_gather_rows(out, num_tokens)

    def dispatch_and_combine(self, x: torch.Tensor, routing: Routing, first_pair: int,
                             rows: PassRows | None = None) -> torch.Tensor:
        """``[t, H]`` for this rank's ``t`` tokens: their rows sent to the ranks holding their
        experts, computed there, sent back and summed per token (``first_pair``: the global pair
        index of this rank's first row, for the replica choice)."""
        num_tokens, top_k = routing.expert_ids.shape
        slots = self.placement.slots_per_rank
        physical = self.placement.to_physical(routing.expert_ids, first_pair).reshape(-1)  # [t * k]
        destination = torch.div(physical, slots, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)                 # pairs grouped by rank
        send_counts = torch.bincount(destination, minlength=self.ep.tp_size)
        recv_counts = self.ep.exchange_counts(send_counts)
        sent = send_counts.tolist()
        received_rows = self.ep.all_to_all_rows(
            x.index_select(0, torch.div(order, top_k, rounding_mode="floor")), sent, recv_counts)
        received_slots = self.ep.all_to_all_rows(physical.index_select(0, order) % slots, sent, recv_counts)
        computed = self.compute_rows(received_rows, received_slots, rows)
        returned = self.ep.all_to_all_rows(computed, recv_counts, sent)  # [t * k, H] in ``order``
        pair_out = torch.empty_like(returned)
        pair_out[order] = returned
        weights = routing.weights.to(x.dtype).unsqueeze(-1)             # [t, k, 1]
        return (pair_out.view(num_tokens, top_k, x.shape[1]) * weights).sum(dim=1)

    def compute_rows(self, x: torch.Tensor, slots: torch.Tensor, rows: PassRows | None = None) -> torch.Tensor:
        """``[n, H]``: row i through local slot ``slots[i]``'s expert (unweighted)."""
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return super().forward(x, Routing(ones, slots.unsqueeze(1)), rows)

    @property
    def checkpoint_experts(self) -> tuple[int, ...]:
        return self.placement.rank_experts(self.ep.tp_rank)

    # -- loading -------------------------------------------------------------------------------
    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """Like FusedMoE's, by logical expert: each local slot holding expert ``e`` gets its part;
        the fused ``[E, ...]`` stack is taken one expert at a time."""
        if shard_id is not None:
            self._load_expert(param, loaded, *shard_id)
            return
        if loaded.shape[0] != self.num_logical:
            raise ValueError(f"expert stack of {loaded.shape[0]} experts, the config has {self.num_logical}")
        for expert in range(self.num_logical):
            if param is self.down_proj:
                self._load_expert(param, loaded[expert], expert, "down")
            else:
                gate, up = loaded[expert].chunk(2, dim=0)
                self._load_expert(param, gate, expert, "gate")
                self._load_expert(param, up, expert, "up")

    def _load_expert(self, param: torch.nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> None:
        if not 0 <= expert < self.num_logical:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_logical}")
        for slot, held in enumerate(self.placement.rank_experts(self.ep.tp_rank)):
            if held == expert:
                super().weight_loader(param, loaded, (slot, part))
        self.loaded_logical.add((expert, part))

    def missing_parts(self) -> list[str]:
        return missing_logical_parts(self.num_logical, self.loaded_logical)

    # -- rebalancing ---------------------------------------------------------------------------
    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Move to ``placement`` (every rank calls this with the same one, in the same layer order):
        slots keep the weights this rank already holds and receive the others by broadcast from a
        rank holding them before the move."""
        move_experts(self, placement, self.ep.tp_rank, 0, 1, self.ep)

    def extra_repr(self) -> str:
        return (f"experts={self.num_logical}, slots={self.placement.rank_experts(self.ep.tp_rank)}, "
                f"ep={self.ep.tp_rank}/{self.ep.ep_size}, hidden={self.hidden_size}, "
                f"intermediate={self.full_intermediate_size}")


class ExpertGroupMoE(PartialExperts):
    """The routed experts under an expert-parallel group smaller than the tensor-parallel one
    (``--ep-size`` dividing ``--tp-size``; SGLang's moe_tp_size = tp / ep): the ``E + R`` expert
    slots (``ExpertPlacement``, as under ``ExpertParallelMoE``) are cut into ``ep`` contiguous
    groups, and each group's ``tp / ep`` ranks split its slots' intermediate columns. Tokens are
    replicated (attention TP): each (token, expert) row goes to one replica of its expert
    (``to_physical``, the same on every rank), rank r computes the rows of its group's slots with
    its columns, and one all-reduce over the whole tensor-parallel group sums the groups' and the
    column slices' parts. A rebalance moves whole experts between groups, each column from the
    rank of the same column (``move_experts``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 *, parallel: ParallelContext, dtype: torch.dtype | None = None) -> None:
        placement = ExpertPlacement.initial(num_experts, parallel.num_redundant_experts, parallel.ep_size)
        num_columns = parallel.tp_size // parallel.ep_size
        group, column = divmod(parallel.tp_rank, num_columns)
        super().__init__(placement.slots_per_rank, hidden_size, intermediate_size, activation,
                         parallel=ParallelContext.single(), dtype=dtype,
                         intermediate_shard=even_split(intermediate_size, num_columns, column))
        self.num_columns = num_columns
        """Ranks of one expert-parallel group (SGLang's moe_tp_size), each holding a column slice."""
        self.group, self.column = group, column
        self.tp = parallel
        self.num_logical = num_experts
        self.placement = placement
        self.loaded_logical: set[tuple[int, str]] = set()

    def forward(self, x: torch.Tensor, routing: Routing, rows: PassRows | None = None) -> torch.Tensor:
        """``[T, H]`` on every rank: each token's weighted sum over its experts (``rows``: the pass's
        facts, for the block routes of experts kept in their blocks: a GGUF file's or a
        pre-quantized checkpoint's, narrowed to this rank's columns where those are whole blocks)."""
        first_slot = self.group * self.num_experts
        local = self.placement.to_physical(routing.expert_ids) - first_slot
        pairs = torch.nonzero(((local >= 0) & (local < self.num_experts)).reshape(-1)).flatten()
        tokens = torch.div(pairs, routing.expert_ids.shape[1], rounding_mode="floor")
        picked = Routing(routing.weights.reshape(-1)[pairs].unsqueeze(1), local.reshape(-1)[pairs].unsqueeze(1))
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, super().forward(x.index_select(0, tokens), picked, rows))
        return self.tp.all_reduce(out)

    @property
    def checkpoint_experts(self) -> tuple[int, ...]:
        """This group's experts, by their checkpoint ids, in slot order (the children ``split_experts``
        names)."""
        return self.placement.rank_experts(self.group)

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """FusedMoE's, by logical expert, for this group's slots only (the fused ``[E, ...]`` stack
        is cut to the experts of the group's slots, in slot order)."""
        held = self.placement.rank_experts(self.group)
        if shard_id is None:
            if loaded.shape[0] != self.num_logical:
                raise ValueError(f"expert stack of {loaded.shape[0]} experts, the config has {self.num_logical}")
            super().weight_loader(param, loaded[list(held)])
            parts = ("down",) if param is self.down_proj else ("gate", "up")
            self.loaded_logical.update((e, part) for e in range(self.num_logical) for part in parts)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_logical:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_logical}")
        for slot, logical in enumerate(held):
            if logical == expert:
                super().weight_loader(param, loaded, (slot, part))
        self.loaded_logical.add((expert, part))

    def missing_parts(self) -> list[str]:
        return missing_logical_parts(self.num_logical, self.loaded_logical)

    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Move to ``placement`` (every rank, the same one, in the same layer order)."""
        move_experts(self, placement, self.group, self.column, self.num_columns, self.tp)


PLACED_EXPERTS = (ExpertParallelMoE, ExpertGroupMoE)
"""The routed-expert layers with an ``ExpertPlacement`` (what EPLB moves and counts per rank)."""
