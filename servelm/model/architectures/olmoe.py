"""OLMoE (allenai/OLMoE-1B-7B): the Llama decoder with RMSNorm over the whole q and k projections
(not per head) before rope, optional clipping of q, k and v to ``[-clip_qkv, clip_qkv]``, and a
sparse MoE block on every layer: top ``num_experts_per_tok`` of a softmax over the experts, not
renormalised unless ``norm_topk_prob`` (false in the released models), experts of
``intermediate_size``.

The q/k norms span every head. Under tensor parallelism a rank holds some heads, so the ranks
sum each token's squares of q and of k (one all-reduce of two numbers a token; a KV head
replicated on r ranks counts once) and each rank scales its own columns by its slice of the norm
weights: the norm of the whole projection, as one process computes it.
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
        bias = bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config, layer_id, bias, bias, False, parallel)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = self.qkv_proj.head_dim
        self.q_norm = RMSNorm(num_heads * head_dim, hf_config.rms_norm_eps)   # whole on every rank
        self.k_norm = RMSNorm(num_kv_heads * head_dim, hf_config.rms_norm_eps)
        self.parallel = parallel
        self.kv_replicas = max(1, parallel.tp_size // num_kv_heads)
        """Ranks holding each KV head (its squares are summed this many times)."""
        self.clip_qkv: float | None = getattr(hf_config, "clip_qkv", None)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj
        q, k, v = self.qkv_proj(hidden, batch.lora).split(qkv.output_sizes, dim=-1)  # [T, H*D], [T, Hkv*D] x2
        if self.parallel.tp_size == 1:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        else:
            q, k = self._norm_across_ranks(q, k)
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q = q.view(-1, qkv.num_heads, qkv.head_dim)
        k = k.view(-1, qkv.num_kv_heads, qkv.head_dim)
        v = v.reshape(-1, qkv.num_kv_heads, qkv.head_dim)
        q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache)
        return self.o_proj(self.attn(q, k, v, batch), batch.lora)

    def _norm_across_ranks(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's columns of the q and k norms over the whole projections (RMSNorm's
        arithmetic: float32 statistics, the normed value rounded to the input's dtype, then the
        weight's product)."""
        qkv = self.qkv_proj
        shard, width = qkv.head_shard, qkv.head_dim
        q32, k32 = q.float(), k.float()
        squares = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1) / self.kv_replicas], dim=-1)
        self.parallel.all_reduce(squares)   # [T, 2]: every rank's squares of q and k
        widths = torch.tensor([self.q_norm.weight.numel(), self.k_norm.weight.numel()], dtype=torch.float32,
                              device=squares.device)
        scales = torch.rsqrt(squares / widths + torch.tensor([self.q_norm.eps, self.k_norm.eps],
                                                            device=squares.device))
        q_weight = self.q_norm.weight[shard.q.start * width:(shard.q.start + shard.q.size) * width]
        k_weight = self.k_norm.weight[shard.kv.start * width:(shard.kv.start + shard.kv.size) * width]
        return (q_weight * (q32 * scales[:, :1]).to(q.dtype), k_weight * (k32 * scales[:, 1:]).to(k.dtype))


class OlmoeForCausalLM(LlamaForCausalLM):
    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return OlmoeAttention(hf_config, layer_id, parallel)

    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return SparseMoeBlock(hf_config, hf_config.intermediate_size,
                              renormalize=bool(getattr(hf_config, "norm_topk_prob", False)), parallel=parallel)
