"""OLMoE (allenai/OLMoE-1B-7B): the Llama decoder with RMSNorm over the whole q and k projections
(not per head) before rope, optional clipping of q, k and v to ``[-clip_qkv, clip_qkv]``, and a
sparse MoE block on every layer: top ``num_experts_per_tok`` of a softmax over the experts, not
renormalised unless ``norm_topk_prob`` (false in the released models), experts of
``intermediate_size``.

The q/k norms span every head, so a rank holding some heads cannot compute them alone: OLMoE runs
on one tensor-parallel rank (``--tp-size 1``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.llama import LlamaAttention, LlamaForCausalLM
from servelm.model.architectures.moe_block import SparseMoeBlock
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.norm import RMSNorm


class OlmoeAttention(LlamaAttention):
    has_flat_decode = False

    def __init__(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> None:
        if parallel.tp_size > 1:
            raise ValueError(f"--tp-size {parallel.tp_size}: OLMoE's q/k norms span all heads, so it runs "
                             "on one tensor-parallel rank; use --tp-size 1")
        bias = bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config, layer_id, bias, bias, False, parallel)
        qkv = self.qkv_proj
        self.q_norm = RMSNorm(qkv.num_heads * qkv.head_dim, hf_config.rms_norm_eps)
        self.k_norm = RMSNorm(qkv.num_kv_heads * qkv.head_dim, hf_config.rms_norm_eps)
        self.clip_qkv: float | None = getattr(hf_config, "clip_qkv", None)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj
        q, k, v = self.qkv_proj(hidden, batch.lora).split(qkv.output_sizes, dim=-1)  # [T, H*D], [T, Hkv*D] x2
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q = q.view(-1, qkv.num_heads, qkv.head_dim)
        k = k.view(-1, qkv.num_kv_heads, qkv.head_dim)
        v = v.reshape(-1, qkv.num_kv_heads, qkv.head_dim)
        q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache)
        return self.o_proj(self.attn(q, k, v, batch), batch.lora)


class OlmoeForCausalLM(LlamaForCausalLM):
    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return OlmoeAttention(hf_config, layer_id, parallel)

    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return SparseMoeBlock(hf_config, hf_config.intermediate_size,
                              renormalize=bool(getattr(hf_config, "norm_topk_prob", False)), parallel=parallel)
