"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (bias on q, k, v as the config's
``qkv_bias`` says; none on o) with a sparse MoE block on the layers ``is_sparse_layer`` picks.

The block adds a shared expert (a gated MLP of ``shared_expert_intermediate_size`` that every
token goes through) scaled by ``sigmoid(shared_expert_gate(x))``, to the routed experts (top
``num_experts_per_tok`` of a softmax, renormalised only when ``norm_topk_prob``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.llama import LlamaAttention, LlamaForCausalLM
from servelm.model.architectures.moe_block import SparseMoeBlock, is_sparse_layer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return LlamaAttention(hf_config, layer_id, bool(getattr(hf_config, "qkv_bias", True)), False, False, parallel)

    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_id):
            return super().build_mlp(hf_config, layer_id, parallel)
        return SparseMoeBlock(hf_config, hf_config.moe_intermediate_size,
                              renormalize=bool(getattr(hf_config, "norm_topk_prob", False)), parallel=parallel,
                              shared_intermediate_size=hf_config.shared_expert_intermediate_size)
