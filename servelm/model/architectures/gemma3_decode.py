"""Gemma 3's decoder layers for a decode step of a few bf16 rows, as flat calls instead of modules.

A decode step of Gemma 3 270M runs 18 layers of ~14 module calls each, and at one row every call
is a few microseconds of Python (nn.Module dispatch, attribute lookups, each op's own "does the
fused path apply" checks) around a few microseconds of work: ~3 ms of a 12 ms step. ``DecodePlan``
checks once per model that every layer can take the fast path (GGUF block weights on the VNNI kernel
without bias, the fused ops' kernel, one tensor-parallel rank) and holds each layer's weights and
kernel arguments; ``run`` checks once per forward that the batch can (bf16, at most ``max_rows``
rows, no LoRA, the fused ops on) and then calls, per layer, the same kernels in the same order as
Gemma3DecoderLayer.forward: the fused RMSNorms, the block kernel, q/k norm + RoPE, attention, act *
up. For an all-decode batch on the torch_native backend, attention is the backend's own decode
(K/V written at the batch's slots, the paged decode kernel over the group's views, built once per
step and window); otherwise the backend is called. The results are bit-identical to the module
path (the same kernels on the same tensors); only the Python around them is gone.

Invariant: a layer's plan reads only weights fixed at load (norm weights, BlockWeight tensors), so it
is built once; anything decided per batch (LoRA, rows, dtype) is checked in ``run`` every forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from servelm.model.attention import paged_decode
from servelm.model.attention.torch_native import TorchNativeAttention, TorchNativeMetadata
from servelm.model.layers import fused
from servelm.model.layers.gguf_linear import GGUFBlockLinearMethod, decode_rows

if TYPE_CHECKING:
    from servelm.model.architectures.gemma3 import Gemma3DecoderLayer
    from servelm.model.forward_batch import ForwardBatch


@dataclass(slots=True)
class _LayerPlan:
    """One layer's weights and kernel arguments (``*_call``: the block kernel, codes, scales,
    offsets, block) in the order its forward uses them."""

    input_norm: torch.Tensor
    qkv_call: tuple[Any, ...]
    split_sizes: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: Any          # RotaryEmbedding: cos/sin from the step's rope cache
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    head_eps: float
    attention: Any       # the Attention module (the backend reads its layer id, scale, window)
    o_call: tuple[Any, ...]
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up_call: tuple[Any, ...]
    activation_kind: int   # fused.ACTIVATION_KINDS[the activation]
    down_call: tuple[Any, ...]
    post_feedforward_norm: torch.Tensor
    eps: float


def _kernel_call(linear: Any) -> tuple[Any, ...] | None:
    """The linear's prepared kernel call (GGUFBlockLinearMethod), or None if it has another path."""
    if not isinstance(getattr(linear, "linear_method", None), GGUFBlockLinearMethod) or linear.bias is not None:
        return None
    parallel = getattr(linear, "parallel", None)
    if parallel is not None and parallel.tp_size != 1:
        return None
    call = linear.__dict__.get("gguf_decode_args")
    return call if call else None


def _layer_plan(layer: Gemma3DecoderLayer) -> _LayerPlan | None:
    attn, mlp = layer.self_attn, layer.mlp
    calls = [_kernel_call(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm]
    if (any(call is None for call in calls) or mlp.act.activation not in fused.ACTIVATION_KINDS
            or any(norm.weight.dtype != torch.bfloat16 or norm.eps != norms[0].eps for norm in norms)
            or attn.q_norm.weight.dtype != torch.bfloat16 or attn.k_norm.weight.dtype != torch.bfloat16
            or attn.q_norm.eps != attn.k_norm.eps):
        return None
    qkv_call, o_call, gate_up_call, down_call = calls
    assert qkv_call is not None and o_call is not None and gate_up_call is not None and down_call is not None
    return _LayerPlan(
        input_norm=layer.input_layernorm.weight, qkv_call=qkv_call, split_sizes=list(attn.qkv_proj.output_sizes),
        num_heads=attn.qkv_proj.num_heads, num_kv_heads=attn.qkv_proj.num_kv_heads,
        head_dim=attn.qkv_proj.head_dim, rotary=attn.rotary_emb, q_norm=attn.q_norm.weight,
        k_norm=attn.k_norm.weight, head_eps=attn.q_norm.eps, attention=attn.attn, o_call=o_call,
        post_attention_norm=layer.post_attention_layernorm.weight,
        pre_feedforward_norm=layer.pre_feedforward_layernorm.weight, gate_up_call=gate_up_call,
        activation_kind=fused.ACTIVATION_KINDS[mlp.act.activation], down_call=down_call,
        post_feedforward_norm=layer.post_feedforward_layernorm.weight, eps=layer.input_layernorm.eps)


class DecodePlan:
    """Every held layer's ``_LayerPlan`` (None when one layer cannot take the flat path): ``applies``
    says whether a forward can, ``run`` computes it."""

    def __init__(self, layers: list[Gemma3DecoderLayer]) -> None:
        plans = [_layer_plan(layer) for layer in layers]
        self.layers: list[_LayerPlan] | None = (
            None if not plans or any(plan is None for plan in plans) else plans)  # type: ignore[assignment]
        self._probe = layers[0].self_attn.qkv_proj if layers else None
        """A module whose forward hooks (benchmarks/profile_decode.py's op timers) send the step
        through the modules, so that the hooks see every op."""

    def max_rows(self) -> int:
        """Most rows every layer's prepared calls take (``decode_rows``: 4 for the VNNI kernel, up to
        48 for the rows kernel's GEMM)."""
        assert self.layers is not None
        plan = self.layers[0]
        return min(decode_rows(call) for call in (plan.qkv_call, plan.o_call, plan.gate_up_call, plan.down_call))

    def applies(self, hidden: torch.Tensor, batch: ForwardBatch) -> bool:
        return (self.layers is not None and hidden.dtype == torch.bfloat16 and hidden.dim() == 2
                and not (self._probe is not None and (self._probe._forward_hooks or self._probe._forward_pre_hooks))
                and hidden.shape[0] <= self.max_rows() and hidden.is_contiguous() and not batch.lora
                and fused.applies(hidden))

    def run(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layers' output for ``hidden`` [T, hidden] (``applies`` checked by the caller)."""
        assert self.layers is not None
        ops = fused.load_kernel()   # the fused ops' own calls: 2-D rows need none of the wrappers' reshapes
        assert ops is not None
        rope_cache = batch.rope_cache
        attention = batch.attention
        group = _paged_decode_group(batch, self.layers[0])
        num_tokens = hidden.shape[0]
        rotations: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}   # rope key -> cos, sin [T, D]
        windows: dict[int | None, tuple[torch.Tensor, torch.Tensor] | None] = {}   # -> slots [T, C], spans
        for plan in self.layers:
            kernel, codes, scales, offsets, block = plan.qkv_call
            qkv = kernel(ops.rms_norm(hidden, plan.input_norm, plan.eps, True, None), codes, scales, offsets, block,
                         True)
            q, k, v = qkv.split(plan.split_sizes, dim=-1)
            q = q.view(-1, plan.num_heads, plan.head_dim)        # [T, H, D]
            k = k.view(-1, plan.num_kv_heads, plan.head_dim)     # [T, Hkv, D]
            v = v.view(-1, plan.num_kv_heads, plan.head_dim)     # [T, Hkv, D]
            rotary = plan.rotary
            key = (rotary.cache_key, q.dtype)
            rotation = rotations.get(key)
            if rotation is None:   # as RotaryEmbedding.forward: cos/sin once per step per rope
                cos_sin = rope_cache.get(key) if rope_cache is not None else None
                if cos_sin is None:
                    cos_sin = rotary.cos_sin(batch.positions, q.dtype)
                    if rope_cache is not None:
                        rope_cache[key] = cos_sin
                cos, sin = cos_sin
                rotation = rotations[key] = (cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
            ops.norm_rope_(q, k, rotation[0], rotation[1], plan.q_norm, plan.k_norm, plan.head_eps, True)
            layer = plan.attention
            window = layer.sliding_window
            if window not in windows:
                view = group.view(window, True) if group is not None else None
                windows[window] = (None if view is None or view.spans is None
                                   else (view.slots.view(num_tokens, view.num_columns), view.spans))
            paged = windows[window]
            if paged is not None:   # the backend's decode, without its dispatch
                k_cache, v_cache = batch.kv_cache.layer(layer.layer_id)
                k_cache.index_copy_(0, batch.slot_mapping, k)
                v_cache.index_copy_(0, batch.slot_mapping, v)
                attended = paged_decode.attend(q, k_cache, v_cache, paged[0], paged[1],
                                               layer.scale).view(num_tokens, -1)   # [T, H * D]
            else:
                attended = attention.forward(q, k, v, layer, batch).contiguous()   # [T, H * D]
            kernel, codes, scales, offsets, block = plan.o_call
            hidden = ops.rms_norm(kernel(attended, codes, scales, offsets, block, True), plan.post_attention_norm,
                                  plan.eps, True, hidden)
            kernel, codes, scales, offsets, block = plan.gate_up_call
            gate_up = kernel(ops.rms_norm(hidden, plan.pre_feedforward_norm, plan.eps, True, None), codes, scales,
                             offsets, block, True)
            kernel, codes, scales, offsets, block = plan.down_call
            down = kernel(ops.act_and_mul(gate_up, plan.activation_kind), codes, scales, offsets, block, True)
            hidden = ops.rms_norm(down, plan.post_feedforward_norm, plan.eps, True, hidden)
        return hidden


def _paged_decode_group(batch: ForwardBatch, first: _LayerPlan) -> Any | None:
    """The batch's one attention group where every row of the batch is a decode that
    TorchNativeAttention would send to the paged decode kernel as one identity group (a bf16 pool,
    no draft trees, causal layers): ``run`` then writes K/V and calls ``paged_decode.attend`` itself
    with the group's own views (the same slots and spans); None where the backend must decide."""
    metadata = batch.attn_metadata
    if (type(batch.attention) is not TorchNativeAttention or not isinstance(metadata, TorchNativeMetadata)
            or batch.trees is not None or len(metadata.groups) != 1 or batch.kv_cache is None
            or batch.kv_cache.dtype != torch.bfloat16 or not first.attention.is_causal):
        return None
    group = metadata.groups[0]
    if not group.is_identity or group.max_query != 1 or group.trees is not None:
        return None
    k_cache, v_cache = batch.kv_cache.layer(first.attention.layer_id)
    q_like = torch.empty(0, first.head_dim, dtype=torch.bfloat16)
    if v_cache.shape[-1] != first.head_dim or not paged_decode.supports(q_like, k_cache):
        return None
    return group
