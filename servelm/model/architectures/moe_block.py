"""The sparse MoE block every MoE family shares: a router, the fused experts, and optionally a
shared expert (Qwen2-MoE) scaled by its own sigmoid gate; and which layers are sparse.

Names follow transformers (>= 5): ``mlp.gate`` (the router, ``[E, H]``), ``mlp.experts`` (the
stacked weights: servelm.model.layers.moe), ``mlp.shared_expert`` and ``mlp.shared_expert_gate``.
The router and the shared expert's gate are plain (replicated) linears, never quantized: a
rounding change in the router's logits changes which experts run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import GatedMLP
from servelm.model.layers.linear import LoRAGroup
from servelm.model.layers.moe import FusedMoE, Routing, route
from servelm.model.layers.moe_parallel import ExpertGroupMoE, ExpertParallelMoE


def num_experts_of(hf_config: Any) -> int:
    """The routed experts of a config (``num_experts``; Mixtral's ``num_local_experts``)."""
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def is_sparse_layer(hf_config: Any, layer_id: int) -> bool:
    """Whether layer ``layer_id`` has the MoE block (else a dense MLP): Qwen's ``mlp_only_layers``
    and ``decoder_sparse_step`` (every step-th layer, counting from 1); every layer elsewhere."""
    if layer_id in (getattr(hf_config, "mlp_only_layers", None) or []):
        return False
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    return num_experts_of(hf_config) > 0 and (layer_id + 1) % step == 0


class RoutedExpertsBlock(nn.Module):
    """What every MoE block has: the routed experts (``FusedMoE``, or this rank's share of them
    under --ep-size, ``ExpertParallelMoE``) and the routing the expert distribution recorder reads
    (model/expert_load.py finds the blocks by this class)."""

    def __init__(self, num_experts: int, hidden: int, intermediate_size: int, activation: str,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.num_experts = num_experts
        """Routed (logical) experts: the router's outputs."""
        self.experts: FusedMoE
        if parallel.expert_ranks is not None:   # DP attention: this rank's tokens, experts over all ranks
            self.experts = ExpertParallelMoE(num_experts, hidden, intermediate_size, activation,
                                             parallel=parallel.expert_ranks, local_tokens=True)
        else:
            experts = (FusedMoE if parallel.ep_size == 1 else ExpertParallelMoE if parallel.ep_size == parallel.tp_size
                       else ExpertGroupMoE)
            self.experts = experts(num_experts, hidden, intermediate_size, activation, parallel=parallel)
        self.is_recording = False
        """Keep each pass's routing in ``pass_expert_ids`` (the expert distribution recorder)."""
        self.pass_expert_ids: list[torch.Tensor] = []
        """Each call's ``[T, k]`` expert ids since ``ExpertLoad.after_pass`` last took them: one call
        a pass, one per micro-batch on a pipeline stage. Appended inside the compiled decode graphs
        too (--enable-torch-compile: dynamo replays the append after the graph)."""

    def run_experts(self, x: torch.Tensor, routing: Routing, rows: Any = None) -> torch.Tensor:
        if self.is_recording:
            self.pass_expert_ids.append(routing.expert_ids)
        return self.experts(x, routing, rows)


class SparseMoeBlock(RoutedExpertsBlock):
    """``forward(x [T, H]) -> [T, H]``: the routed experts' weighted sum, plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` where there is a shared expert."""

    def __init__(self, hf_config: Any, intermediate_size: int, renormalize: bool,
                 parallel: ParallelContext, shared_intermediate_size: int | None = None) -> None:
        hidden = hf_config.hidden_size
        num_experts = num_experts_of(hf_config)
        super().__init__(num_experts, hidden, intermediate_size, hf_config.hidden_act, parallel)
        self.top_k = int(hf_config.num_experts_per_tok)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {num_experts}]")
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, shared_intermediate_size, hf_config.hidden_act, parallel=parallel)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, lora: Sequence[LoRAGroup] | None = None, rows: Any = None) -> torch.Tensor:
        """``lora`` reaches the shared expert only (an adapter on the routed experts is refused when
        it is loaded, as the model has no such layer); ``rows`` (the pass's generation rows) reaches
        the GGUF routes of the shared and routed experts; the router is a plain float weight."""
        out = self.run_experts(x, route(self.gate(x), self.top_k, self.renormalize), rows)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora, rows)
        return out
