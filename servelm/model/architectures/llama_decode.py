"""The Llama family's decoder layers (Llama, Mistral, SmolLM2, Qwen2, Qwen3) for a decode step of a
few rows (bf16, or float32 on a CPU without a native bf16 GEMM), as flat calls instead of modules.

Qwen2.5-Coder 0.5B runs 24 layers of ~12 module calls each per decode step. ``LlamaDecodePlan``
(flat_decode.py's ``FlatDecodePlan``: the checks, the per-step rope and attention it shares with
Gemma 3) holds each layer's weights and kernel arguments, and ``run`` calls, per layer, the same
kernels in the same order as LlamaDecoderLayer.forward: the fused RMSNorm, the QKV block kernel,
RoPE (with Qwen3's q/k norms), attention, the O kernel, the fused add + RMSNorm, gate_up, silu * up,
down, and the residual add, which the fused add + RMSNorm takes together with the next layer's input
norm (it rounds the sum to the stream's dtype before norming it, as torch's add then the norm: one call,
not two). A QKV bias (Qwen2) goes to the prepared call, which adds it in float32 before any rounding
(as GGUFBlockLinearMethod.apply's decode call); the other projections must be bias-free.
Bit-identical to the module path (tests/unit/model/test_flat_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from servelm.model.architectures.flat_decode import (FlatDecodePlan, LayerPlan, call_dtype, decode_mlp, decode_stack,
                                                     norms_fuse)
from servelm.model.layers import fused

from servelm.model.architectures.common import GatedMLP

if TYPE_CHECKING:
    from servelm.model.architectures.llama import LlamaDecoderLayer
    from servelm.model.forward_batch import ForwardBatch


@dataclass(slots=True)
class _LayerPlan(LayerPlan):
    """A Llama-family layer's plan: the shared fields, the QKV bias, and the next layer's input norm
    (the residual add goes with it)."""

    qkv_bias: torch.Tensor | None   # added by the QKV call (kernel_call checks that it takes one)


class LlamaDecodePlan(FlatDecodePlan):
    """The Llama family's flat decode (see the module docstring)."""

    def __init__(self, layers: list[LlamaDecoderLayer], routed: bool = False) -> None:
        super().__init__(layers, routed)
        for plan in self.layers or ():
            plan.mlp_run = decode_mlp(plan, self.dtype, [plan.post_attention_norm])
        self.stack = decode_stack(self.layers, offset=False) if self.layers else None

    def layer_plan(self, layer: LlamaDecoderLayer) -> _LayerPlan | None:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP) or not getattr(attn, "has_flat_decode", False):
            return None   # an MoE block, or attention with steps of its own (OLMoE): the module path
        qkv_call = self.call_of(attn.qkv_proj, allow_bias=True)
        calls = [self.call_of(linear) for linear in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        head_norms = [attn.q_norm, attn.k_norm] if attn.has_qk_norm else []
        if qkv_call is None or any(call is None for call in calls) or mlp.act.activation not in fused.ACTIVATION_KINDS:
            return None
        o_call, gate_up_call, down_call = calls
        assert o_call is not None and gate_up_call is not None and down_call is not None
        dtype = call_dtype([qkv_call, o_call, gate_up_call, down_call])
        if (not norms_fuse([layer.input_layernorm, layer.post_attention_layernorm], dtype)
                or (head_norms and not norms_fuse(head_norms, dtype))):
            return None
        qkv = attn.qkv_proj
        return _LayerPlan(
            input_norm=layer.input_layernorm.weight, qkv_call=qkv_call,
            qkv_bias=qkv.bias,
            split_sizes=list(qkv.output_sizes),
            num_heads=qkv.num_heads, num_kv_heads=qkv.num_kv_heads, head_dim=qkv.head_dim, rotary=attn.rotary_emb,
            q_norm=head_norms[0].weight if head_norms else None, k_norm=head_norms[1].weight if head_norms else None,
            head_eps=head_norms[0].eps if head_norms else 0.0, attention=attn.attn, o_call=o_call,
            post_attention_norm=layer.post_attention_layernorm.weight, gate_up_call=gate_up_call,
            activation_kind=fused.ACTIVATION_KINDS[mlp.act.activation], down_call=down_call,
            eps=layer.input_layernorm.eps)

    def run(self, hidden: torch.Tensor, batch: ForwardBatch, final_norm: nn.Module | None = None) -> torch.Tensor:
        """The layers' output for ``hidden`` [T, hidden] (``applies`` checked by the caller), through
        ``final_norm`` where given: with the last residual add in one fused call where it is the
        model's RMSNorm with no hooks (as the layers' own adds and norms; else the module after it)."""
        step = self.step(hidden, batch)
        ops = step.ops
        rounds, round_updates = self.rounds, self.round_updates
        plan: _LayerPlan
        plans = self.layers or []
        normed = ops.rms_norm(hidden, plans[0].input_norm, plans[0].eps, False, None)
        whole = self.in_one_call(step, normed, hidden, final_norm)
        if whole is not None:
            return whole
        final: torch.Tensor
        for plan in plans:
            kernel, codes, scales, offsets, block = plan.qkv_call
            qkv = kernel(normed, codes, scales, offsets, block, rounds, plan.qkv_bias)
            attended = step.rope_and_attend(plan, qkv, False)     # [T, H * D]
            one_call = (None if plan.mlp_run is None   # no method call where no layer has it (AVX-512)
                        else self.mlp_in_one_call(plan, step.num_tokens, attended, hidden, final_norm))
            if one_call is not None:   # o .. down and the next (or final) norm: one call
                normed, after = one_call
                if after is None:
                    return normed
                hidden = after
                continue
            kernel, codes, scales, offsets, block = plan.o_call
            normed, hidden = ops.add_rms_norm(kernel(attended, codes, scales, offsets, block, round_updates), hidden,
                                              plan.post_attention_norm, plan.eps, False)
            kernel, codes, scales, offsets, block = plan.down_call
            down = kernel(self.acted(plan, ops, normed), codes, scales, offsets, block, round_updates)
            if plan.next_input_norm is None:
                if self.fuses_final_norm(final_norm):
                    assert final_norm is not None
                    final = ops.add_rms_norm(down, hidden, final_norm.weight, final_norm.eps, False)[0]
                    return final
                hidden = hidden + down
            else:   # the residual add with the next layer's input norm: the sum in the stream's dtype, then normed
                normed, hidden = ops.add_rms_norm(down, hidden, plan.next_input_norm, plan.next_eps, False)
        return hidden if final_norm is None else final_norm(hidden)
