"""Gemma 3's decoder layers for a decode step of a few rows, as flat calls instead of modules.

A decode step of Gemma 3 270M runs 18 layers of ~14 module calls each: ~3 ms of Python in a 12 ms
step. ``DecodePlan`` (flat_decode.py's ``FlatDecodePlan``: the checks, the per-step rope and attention
it shares with the Llama family) holds each layer's weights and kernel arguments, and ``run`` calls,
per layer, the same kernels in the same order as Gemma3DecoderLayer.forward: the fused (1 + w)
RMSNorms (the post-norms with their residual add), the block kernel, q/k norm + RoPE, attention,
act * up; a float32 model's one-row step on the AVX2 block kernel takes each layer's o .. down and the
next input norm in one native call (``decode_mlp``). Bit-identical to the module path
(tests/unit/model/test_flat_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from servelm.model.architectures.flat_decode import (FlatDecodePlan, LayerPlan, call_dtype, decode_mlp, decode_stack,
                                                     norms_fuse)
from servelm.model.layers import fused
from servelm.model.layers.norm import GemmaRMSNorm

if TYPE_CHECKING:
    from servelm.model.architectures.gemma3 import Gemma3DecoderLayer
    from servelm.model.forward_batch import ForwardBatch


@dataclass(slots=True)
class _LayerPlan(LayerPlan):
    """A Gemma 3 layer's plan: the shared fields and the feed-forward's pre- and post-norms."""

    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor


class DecodePlan(FlatDecodePlan):
    """Gemma 3's flat decode (see the module docstring)."""

    final_norm_type = GemmaRMSNorm

    def __init__(self, layers: list[Gemma3DecoderLayer], routed: bool = False) -> None:
        super().__init__(layers, routed)
        for plan in self.layers or ():
            plan.mlp_run = decode_mlp(plan, self.dtype, [plan.post_attention_norm, plan.pre_feedforward_norm,
                                                         plan.post_feedforward_norm])
        self.stack = decode_stack(self.layers, offset=True) if self.layers else None

    def layer_plan(self, layer: Gemma3DecoderLayer) -> _LayerPlan | None:
        attn, mlp = layer.self_attn, layer.mlp
        calls = [self.call_of(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(call is None for call in calls) or mlp.act.activation not in fused.ACTIVATION_KINDS:
            return None
        qkv_call, o_call, gate_up_call, down_call = calls
        assert qkv_call is not None and o_call is not None and gate_up_call is not None and down_call is not None
        dtype = call_dtype([qkv_call, o_call, gate_up_call, down_call])
        if (not norms_fuse([layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                            layer.post_feedforward_layernorm], dtype)
                or not norms_fuse([attn.q_norm, attn.k_norm], dtype)):
            return None
        return _LayerPlan(
            input_norm=layer.input_layernorm.weight, qkv_call=qkv_call, split_sizes=list(attn.qkv_proj.output_sizes),
            num_heads=attn.qkv_proj.num_heads, num_kv_heads=attn.qkv_proj.num_kv_heads,
            head_dim=attn.qkv_proj.head_dim, rotary=attn.rotary_emb, q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight, head_eps=attn.q_norm.eps, attention=attn.attn, o_call=o_call,
            post_attention_norm=layer.post_attention_layernorm.weight,
            pre_feedforward_norm=layer.pre_feedforward_layernorm.weight, gate_up_call=gate_up_call,
            activation_kind=fused.ACTIVATION_KINDS[mlp.act.activation], down_call=down_call,
            post_feedforward_norm=layer.post_feedforward_layernorm.weight, eps=layer.input_layernorm.eps)

    def run(self, hidden: torch.Tensor, batch: ForwardBatch, final_norm: nn.Module | None = None) -> torch.Tensor:
        """The layers' output for ``hidden`` [T, hidden] (``applies`` checked by the caller), through
        ``final_norm`` where given."""
        step = self.step(hidden, batch)
        ops = step.ops
        rounds, round_updates = self.rounds, self.round_updates
        plan: _LayerPlan
        normed: torch.Tensor | None = None   # the layer's input norm, where the previous layer's call made it
        if self.stack is not None and self.layers:
            first = self.layers[0]
            normed = ops.rms_norm(hidden, first.input_norm, first.eps, True, None)
            whole = self.in_one_call(step, normed, hidden, final_norm)
            if whole is not None:
                return whole
        for plan in self.layers or ():
            if normed is None:
                normed = ops.rms_norm(hidden, plan.input_norm, plan.eps, True, None)
            kernel, codes, scales, offsets, block = plan.qkv_call
            qkv = kernel(normed, codes, scales, offsets, block, rounds)
            attended = step.rope_and_attend(plan, qkv, True)     # [T, H * D]
            one_call = (None if plan.mlp_run is None   # no method call where no layer has it (AVX-512)
                        else self.mlp_in_one_call(plan, step.num_tokens, attended, hidden, final_norm))
            if one_call is not None:   # o .. down and the next (or final) norm: one call
                normed, after = one_call
                if after is None:
                    return normed
                hidden = after
                continue
            kernel, codes, scales, offsets, block = plan.o_call
            hidden = ops.rms_norm(kernel(attended, codes, scales, offsets, block, round_updates), plan.post_attention_norm,
                                  plan.eps, True, hidden)
            acted = self.acted(plan, ops, ops.rms_norm(hidden, plan.pre_feedforward_norm, plan.eps, True, None))
            kernel, codes, scales, offsets, block = plan.down_call
            down = kernel(acted, codes, scales, offsets, block, round_updates)
            hidden = ops.rms_norm(down, plan.post_feedforward_norm, plan.eps, True, hidden)
            normed = None
        return hidden if final_norm is None else final_norm(hidden)
