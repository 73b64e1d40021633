"""Mixture-of-experts: top-k routing and the fused experts layer (rows grouped by expert).

A token goes to the ``k`` experts its router picks; its output is the routing-weighted sum of those
experts' gated MLPs. ``FusedMoE.forward`` computes it without a loop over tokens and without any
expert seeing a token it was not routed: the ``T * k`` (token, expert) pairs are sorted by expert id
(``ExpertGroups``), each expert with rows runs one GEMM for its fused gate+up projection and one for
its down projection over its contiguous slice of the sorted rows, and the weighted rows are
scatter-added back to their tokens.

Invariants:
- Weights are stacked per expert as transformers (>= 5) holds them in memory: ``gate_up_proj``
  ``[E, 2 * I_local, H]`` (an expert's gate rows, then its up rows) and ``down_proj``
  ``[E, H, I_local]``. They load from either that fused form or a checkpoint's per-expert tensors
  (``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``).
- Tensor parallelism splits every expert's intermediate dimension as GatedMLP does
  (``ParallelContext.split``): a rank holds all experts, each narrowed to its ``I_local`` columns,
  and the partial outputs are all-reduced. Routing is replicated (every rank computes the same
  top-k from the same hidden states), so no rank exchanges tokens.
- Routing is computed in float32 (softmax over all experts, top-k, then optionally renormalised
  over the chosen k), as transformers does; the weights reach the experts in the activation dtype.
- A per-layer weight format (a GGUF file's blocks, a pre-quantized checkpoint's integer codes,
  ``experts_int8``'s int8 weights) replaces the stacked weights through
  ``split_experts``: each expert gets its own two linear layers (children ``"0"``, ``"1"``, ...,
  so their checkpoint names are the per-expert ones), whose weights a LinearMethod then replaces
  (servelm/model/gguf/gguf_weights.py), and ``drop_stacked`` frees the stacks. The routing, grouping and
  combining are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext, Shard
from servelm.model.layers.activation import ActAndMul
from servelm.model.gguf.gguf_routes import GENERATION_ONLY, PassRows
from servelm.model.layers.linear import LinearBase, dense_linear

_CHECKPOINT_SHARDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                      "down_proj": "down", "w2": "down"}
"""A per-expert checkpoint tensor's projection name -> its part of the stacked weights."""
_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
"""A part of the stacked weights -> the per-expert projection name transformers gives it."""


def canonical_expert_name(name: str) -> str:
    """A per-expert checkpoint tensor's name with its projection as transformers names it
    (Mixtral's ``experts.<e>.w1`` / ``w3`` / ``w2`` -> ``gate_proj`` / ``up_proj`` / ``down_proj``:
    the names ``split_experts``' layers answer to); any other name unchanged."""
    stem, sep, rest = name.partition(".experts.")
    fields = rest.split(".")
    if not sep or len(fields) != 3 or not fields[0].isdigit() or fields[1] not in _CHECKPOINT_SHARDS:
        return name
    return f"{stem}.experts.{fields[0]}.{_PROJECTIONS[_CHECKPOINT_SHARDS[fields[1]]]}.{fields[2]}"


@dataclass(frozen=True, slots=True)
class Routing:
    """The experts each token goes to and their weights (``num_tokens`` rows, ``top_k`` columns)."""

    weights: torch.Tensor     # [T, k] float32
    expert_ids: torch.Tensor  # [T, k] int64


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts in float32, the ``top_k`` largest, renormalised to sum to 1 over
    the chosen ones where ``renormalize`` (Mixtral always; Qwen's ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, expert_ids)


def route_group_limited(router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                        scaling: float) -> Routing:
    """DeepSeek-V2: softmax over all experts in float32; with ``num_groups`` > 1 the experts form
    that many equal groups and only those of the ``topk_groups`` groups with the highest best
    score may be chosen (``group_limited_greedy``); the ``top_k`` scores, not renormalised, times
    ``scaling`` (``routed_scaling_factor``)."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)   # [T, E]
    if num_groups > 1:
        group_best = scores.view(scores.shape[0], num_groups, -1).amax(dim=-1)
        scores = _only_top_groups(scores, group_best, topk_groups, 0.0)
    weights, expert_ids = torch.topk(scores, top_k, dim=-1)
    return Routing(weights * scaling, expert_ids)


def route_noaux_tc(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                   topk_groups: int, renormalize: bool, scaling: float) -> Routing:
    """DeepSeek-V3 (``noaux_tc``): sigmoid scores in float32; experts are chosen by score plus
    ``correction_bias`` (the load-balancing bias), among the ``topk_groups`` groups whose two best
    biased scores sum highest; their weights are the unbiased scores, renormalised to sum to 1
    where ``renormalize`` (``norm_topk_prob``), times ``scaling``."""
    scores = router_logits.float().sigmoid()                            # [T, E]
    biased = scores + correction_bias.float()
    if num_groups > 1:
        group_score = biased.view(scores.shape[0], num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        biased = _only_top_groups(biased, group_score, topk_groups, float("-inf"))
    expert_ids = torch.topk(biased, top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * scaling, expert_ids)


def _only_top_groups(scores: torch.Tensor, group_score: torch.Tensor, topk_groups: int,
                     fill: float) -> torch.Tensor:
    """``scores`` ``[T, E]`` with every expert outside each token's ``topk_groups`` best groups (by
    ``group_score`` ``[T, G]``) set to ``fill``."""
    chosen = torch.topk(group_score, topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, chosen, True)
    return scores.masked_fill(~keep.repeat_interleave(scores.shape[1] // group_score.shape[1], dim=1), fill)


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """The ``T * k`` (token, expert) pairs of a routing, sorted by expert id (stable: within an
    expert, tokens keep their order). Expert ``e``'s rows are ``offsets[e]:offsets[e + 1]``."""

    order: torch.Tensor       # [T * k] int64: flat pair index (token * k + choice) of each sorted row
    token_rows: torch.Tensor  # [T * k] int64: the token of each sorted row
    offsets: list[int]        # [E + 1] row offsets per expert (a host list: the loop reads it)

    @classmethod
    def build(cls, expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        offsets = [0] + torch.cumsum(counts, 0).tolist()
        return cls(order, torch.div(order, top_k, rounding_mode="floor"), offsets)

    def rows_per_expert(self) -> list[int]:
        return [end - start for start, end in zip(self.offsets, self.offsets[1:])]


class ExpertLinears(nn.Module):
    """One expert's ``gate_up_proj`` ``[2 * I, H]`` and ``down_proj`` ``[H, I]`` as linear layers
    whose weights start as views of the stacked ones (``FusedMoE.split_experts``)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = LinearBase(gate_up.shape[1], gate_up.shape[0], bias=False, dtype=gate_up.dtype)
        self.gate_up_proj.weight = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = LinearBase(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        self.down_proj.weight = nn.Parameter(down, requires_grad=False)


def expert_rows(rows: PassRows | None) -> PassRows | None:
    """The row facts an expert's linear gets from its pass's (``rows``): an expert's rows are a
    subset of the pass's, so a pass with any generation row hands them all on as generation rows
    (no int8-rounded activations for them), a prompt-only pass as prompt rows (None)."""
    return None if rows is None or not (rows.generation_only or rows.generation_rows is not None) \
        else GENERATION_ONLY


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs ``hidden -> intermediate -> hidden`` with stacked weights (this
    rank's intermediate columns); ``forward(x, routing)`` gives each token's weighted expert sum."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 *, parallel: ParallelContext | None = None, dtype: torch.dtype | None = None,
                 intermediate_shard: Shard | None = None) -> None:
        """``intermediate_shard``: this rank's intermediate columns (None: its ``split`` of them)."""
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_shard = intermediate_shard or self.parallel.split(intermediate_size)
        self.full_intermediate_size = intermediate_size
        local = self.intermediate_shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype),
                                      requires_grad=False)
        self.act = ActAndMul(activation)
        self.loaded_parts: set[tuple[int, str]] = set()
        """(expert, "gate" | "up" | "down") loaded so far: ``missing_parts`` names the rest."""
        self.dense_routes: tuple[Any, Any] = (None, None)
        """float32 stacks' measured routes for gate_up and down (layers/f32_rows.py ``DenseRoutes``)."""
        self.expert_layers: list[ExpertLinears] | None = None
        """Each expert's own linear layers once ``split_experts`` made them, else None (the stacks)."""

    def split_experts(self) -> None:
        """Give each expert its own linear layers (children ``"<e>"``, ``e`` its checkpoint id), views
        of the stacked weights, for a LinearMethod to replace; ``forward`` runs them from now on.
        Once only: a second call keeps the layers the first made."""
        if self.expert_layers is not None:
            return
        self.expert_layers = [ExpertLinears(self.gate_up_proj.data[e], self.down_proj.data[e])
                              for e in range(self.num_experts)]
        for expert, layers in zip(self.checkpoint_experts, self.expert_layers, strict=True):
            self.add_module(str(expert), layers)

    @property
    def checkpoint_experts(self) -> tuple[int, ...]:
        """The checkpoint's expert id of each stacked slot (the child name ``split_experts`` gives it)."""
        return tuple(range(self.num_experts))

    @property
    def num_checkpoint_experts(self) -> int:
        """The checkpoint's experts of this layer (this module may hold some of them)."""
        return self.num_experts

    def drop_stacked(self) -> None:
        """Free the stacked weights once every expert's layers hold their own (``split_experts``)."""
        assert self.expert_layers is not None, "drop_stacked before split_experts"
        for name in ("gate_up_proj", "down_proj"):
            delattr(self, name)
            self.register_parameter(name, None)
        self.loaded_parts.update((e, part) for e in range(self.num_experts) for part in ("gate", "up", "down"))

    def expert_mlp(self, expert: int, x: torch.Tensor, rows: PassRows | None = None) -> torch.Tensor:
        """Expert ``expert``'s gated MLP of rows ``x`` [n, H] -> [n, H] (``rows``: ``expert_rows``)."""
        if self.expert_layers is None:
            gate_up, down = self.dense_routes
            return dense_linear(self.act(dense_linear(x, self.gate_up_proj[expert], None, gate_up)),
                                self.down_proj[expert], None, down)
        layers = self.expert_layers[expert]
        return layers.down_proj(self.act(layers.gate_up_proj(x, rows=rows)), rows=rows)

    def forward(self, x: torch.Tensor, routing: Routing, rows: PassRows | None = None) -> torch.Tensor:
        """``[T, H]``: for each token, the sum over its experts of weight * expert(x). ``rows``: the
        pass's row facts (for the GGUF routes of split experts)."""
        num_tokens, top_k = routing.expert_ids.shape
        out = torch.zeros_like(x)
        if num_tokens == 0:
            return out
        groups = ExpertGroups.build(routing.expert_ids, self.num_experts)
        sorted_rows = x.index_select(0, groups.token_rows)  # [T * k, H] sorted by expert
        expert_out = torch.empty_like(sorted_rows)          # [T * k, H]
        offsets = groups.offsets
        facts = expert_rows(rows)
        for expert in range(self.num_experts):
            start, end = offsets[expert], offsets[expert + 1]
            if start == end:
                continue
            expert_out[start:end] = self.expert_mlp(expert, sorted_rows[start:end], facts)
        weights = routing.weights.reshape(-1).index_select(0, groups.order).to(x.dtype)  # [T * k]
        expert_out.mul_(weights.unsqueeze(1))
        out.index_add_(0, groups.token_rows, expert_out)
        return self.parallel.all_reduce(out)

    # -- loading ------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_part(name: str) -> tuple[str, tuple[int, str]] | None:
        """``(stacked parameter name, (expert, part))`` for a per-expert checkpoint tensor such as
        ``model.layers.0.mlp.experts.3.gate_proj.weight``; None for any other name."""
        stem, sep, rest = name.partition(".experts.")
        if not sep:
            return None
        fields = rest.split(".")
        if len(fields) != 3 or not fields[0].isdigit() or fields[2] != "weight" \
                or fields[1] not in _CHECKPOINT_SHARDS:
            return None
        part = _CHECKPOINT_SHARDS[fields[1]]
        stacked = "gate_up_proj" if part in ("gate", "up") else "down_proj"
        return f"{stem}.experts.{stacked}", (int(fields[0]), part)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """Fill ``param`` (``gate_up_proj`` or ``down_proj``) with this rank's columns: the whole stack
        (``shard_id`` None: transformers' fused ``[E, 2I, H]`` / ``[E, H, I]``) or one expert's part."""
        shard, full = self.intermediate_shard, self.full_intermediate_size
        is_gate_up = param is self.gate_up_proj
        experts = range(self.num_experts) if shard_id is None else [shard_id[0]]
        if shard_id is None:
            expected = (self.num_experts, 2 * full, self.hidden_size) if is_gate_up else \
                (self.num_experts, self.hidden_size, full)
            parts = ["gate", "up"] if is_gate_up else ["down"]
        else:
            expert, part = shard_id
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts}")
            expected = (full, self.hidden_size) if part != "down" else (self.hidden_size, full)
            parts = [part]
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert weight of shape {tuple(loaded.shape)}, expected {expected}")
        for part in parts:
            if part == "down":
                source = loaded.narrow(-1, shard.start, shard.size)
                target = param.data if shard_id is None else param.data[shard_id[0]]
            else:
                row = full if part == "up" and shard_id is None else 0   # the stack's up rows follow its gate rows
                source = loaded.narrow(-2, row + shard.start, shard.size)
                start = 0 if part == "gate" else shard.size
                target = (param.data if shard_id is None else param.data[shard_id[0]]).narrow(-2, start, shard.size)
            target.copy_(source)
            self.loaded_parts.update((expert, part) for expert in experts)

    def missing_parts(self) -> list[str]:
        """The expert weights no checkpoint tensor has filled (checked after loading)."""
        return [f"expert {expert} {part}" for expert in range(self.num_experts)
                for part in ("gate", "up", "down") if (expert, part) not in self.loaded_parts]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_shard.size}/{self.full_intermediate_size}")
