"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with a
sparse MoE block on the layers ``is_sparse_layer`` picks (``decoder_sparse_step``, minus
``mlp_only_layers``, which keep a dense MLP of ``intermediate_size``).

Routing: softmax over the experts, top ``num_experts_per_tok``, renormalised over the chosen ones
when ``norm_topk_prob`` (true in the released models); experts of ``moe_intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.moe_block import SparseMoeBlock, is_sparse_layer
from servelm.model.architectures.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_id):
            return super().build_mlp(hf_config, layer_id, parallel)
        return SparseMoeBlock(hf_config, hf_config.moe_intermediate_size,
                              renormalize=bool(getattr(hf_config, "norm_topk_prob", False)), parallel=parallel)
