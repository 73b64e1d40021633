"""What every flat decode path shares (gemma3_decode.py, llama_decode.py): a decode step of a few rows
(a bf16 model's, or a float32 model's where the CPU has no native bf16 GEMM) through the same kernels
as the layer modules, without the ~14 module calls per layer.

A decode step of one row spends a few microseconds of Python per module call (nn.Module dispatch,
attribute lookups, each op's own "does the fused path apply" checks) around a few microseconds of
work. A family's plan (``FlatDecodePlan`` subclass) checks once per model that every layer can take
the flat path (``kernel_call``: GGUF block weights on the block kernel, or float32 dense weights on
their measured routes; one tensor-parallel rank; the fused ops' kernel; every weight in the model's
dtype, the plan's ``dtype``) and holds each layer's weights and kernel arguments; ``applies`` checks
once per forward that the batch can (the residual stream float32 or ``dtype``, at most ``max_rows``
rows, no LoRA, no forward hooks on a layer, the fused ops on); ``run`` then calls, per layer, the
kernels the modules would call, in the same order, with a ``DecodeStep`` giving the per-step parts:
cos/sin once per rope, and attention. For an all-decode
batch on the torch_native backend, attention is the backend's own decode (K/V written at the
batch's slots, the paged decode kernel over the group's views, built once per step and window), in one
native call on the QKV projection's rows (``paged_decode.write_and_attend_qkv``: no split or views, no q
copy, no per-layer ``index_copy_``; the q/k norms and RoPE likewise, ``norm_rope_qkv_``);
otherwise the backend is called. The results are bit-identical to the module path (the same kernels
on the same tensors); only the Python around them is gone. A float32 model's one-row step on the AVX2
block kernel goes further: every layer in one native call (``decode_stack``: the kernel's ``DecodeStack``
runs each layer's QKV call, q/k norm + RoPE, K/V write and attention through the fused-ops and
paged-decode builds' own functions, then its ``DecodeMlp``, in one parallel region).

Invariant: a layer's plan reads only weights fixed at load (norm weights, BlockWeight tensors, dense
weights), so it is built once; anything decided per batch (LoRA, rows, dtype) is checked in ``applies``
every forward.
A float32 plan rounds nothing (its calls' ``round_out`` is False, cos/sin and K/V are float32), as the
modules compute float32 rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from servelm.model.attention import paged_decode
from servelm.model.attention.torch_native import TorchNativeAttention, TorchNativeMetadata
from servelm.model.layers import fused
from servelm.model.layers.f32_rows import MAX_ROWS as F32_DENSE_ROWS
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod, PreparedCall, RowsCopies, decode_rows, gate_up_act
from servelm.model.huge_pages import gather_on_huge_pages
from servelm.model.layers.linear import UnquantizedLinearMethod, dense_linear
from servelm.model.layers.norm import RMSNorm
from servelm.model.gguf import gguf_kernel

if TYPE_CHECKING:
    from servelm.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

KernelCall = PreparedCall
"""A linear's prepared kernel call: (kernel, codes, scales, offsets, block), called with x, those,
``round_out`` [, bias]."""


@dataclass(slots=True)
class LayerPlan:
    """What every family's layer plan holds: weights and kernel arguments (``*_call``: KernelCall)
    that its ``run`` uses in the order of the layer's forward; a family adds its own norms."""

    input_norm: torch.Tensor
    qkv_call: KernelCall
    split_sizes: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: Any            # RotaryEmbedding: cos/sin from the step's rope cache
    q_norm: torch.Tensor | None   # per-head q/k norms (Gemma 3, Qwen3), or None
    k_norm: torch.Tensor | None
    head_eps: float
    attention: Any         # the Attention module (the backend reads its layer id, scale, window)
    o_call: KernelCall
    post_attention_norm: torch.Tensor
    gate_up_call: KernelCall
    activation_kind: int   # fused.ACTIVATION_KINDS[the activation]
    down_call: KernelCall
    eps: float
    gate_up_act: Any = field(default=None, kw_only=True)
    """gate_up and act * up in one rows-kernel call (``gate_up_act``), or None: gate_up, then act_and_mul."""
    next_input_norm: torch.Tensor | None = field(default=None, kw_only=True)
    """The next layer's input norm weight (None: the last layer); its eps ``next_eps``."""
    next_eps: float = field(default=0.0, kw_only=True)
    mlp_run: Any = field(default=None, kw_only=True)
    """One row, float32: o .. down and the next layer's input norm in one call (``decode_mlp``), or None."""

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, Hkv, D]``: views of the QKV projection's output."""
        q, k, v = qkv.split_with_sizes(self.split_sizes, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


def kernel_call(linear: Any, allow_bias: bool = False, routed: bool = False) -> KernelCall | None:
    """The linear's prepared kernel call (GGUFBlockLinearMethod's ``gguf_decode_args``, or with
    ``routed`` its ``routed_call``; a float32 dense weight's ``dense_call``), or None where it has
    another path (another method, tensor parallel, a bias unless ``allow_bias``, a bias in another
    dtype than the call's rows)."""
    method = getattr(linear, "linear_method", None)
    parallel = getattr(linear, "parallel", None)
    if parallel is not None and parallel.tp_size != 1:
        return None
    if isinstance(method, GGUFBlockLinearMethod):
        call = method.routed_call(linear) if routed else linear.__dict__.get("gguf_decode_args")
    elif type(method) is UnquantizedLinearMethod:
        call = dense_call(linear)
    else:
        return None
    if not isinstance(call, PreparedCall):
        return None
    if linear.bias is not None and not (allow_bias and call.takes_bias and linear.bias.dtype == call.dtype):
        return None
    return call


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, linear: Any, _offsets: None, _block: int,
                  _round_out: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 dense linear in the prepared-call form: the module path's own ``dense_linear`` with the
    layer's measured routes (oneDNN or the few-rows kernel per row class, layers/f32_rows.py), read at
    each call (they are measured after the model is built)."""
    return dense_linear(x, weight, bias, linear.dense_routes)


def dense_call(linear: Any) -> PreparedCall | None:
    """A float32 dense linear's prepared call (``_dense_linear``) for up to ``F32_DENSE_ROWS`` rows of
    any kind (the same function as ``UnquantizedLinearMethod.apply``: no rows of its own), else None."""
    weight = linear.weight
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return PreparedCall.of((_dense_linear, weight, linear, None, 0), torch.float32, F32_DENSE_ROWS, F32_DENSE_ROWS,
                           takes_bias=True)


def call_dtype(calls: Sequence[KernelCall]) -> torch.dtype | None:
    """The rows' dtype that all of a layer's prepared calls take, or None where they differ."""
    dtypes = {call.dtype for call in calls}
    return dtypes.pop() if len(dtypes) == 1 else None


def norms_fuse(norms: Sequence[Any], dtype: torch.dtype | None) -> bool:
    """Whether these RMSNorms all run the fused call with ``dtype`` weights (the model's) and one eps
    (the plan passes one)."""
    return dtype is not None and all(norm.weight.dtype == dtype and norm.eps == norms[0].eps for norm in norms)


class DecodeStep:
    """One forward's shared parts: the fused ops' module, cos/sin per rope, attention per window.

    ``rotation`` computes cos/sin as RotaryEmbedding.forward does (once per step per rope, kept in
    the batch's rope cache); ``attend`` writes K/V and runs the paged decode kernel where the whole
    batch is one decode group that TorchNativeAttention would send there, else calls the backend."""

    __slots__ = ("ops", "batch", "num_tokens", "dtype", "group", "rotations", "windows", "write_and_attend")

    def __init__(self, batch: ForwardBatch, num_tokens: int, first_attention: Any, head_dim: int,
                 dtype: torch.dtype) -> None:
        ops = fused.load_kernel()   # the fused ops' own calls: 2-D rows need none of the wrappers' reshapes
        assert ops is not None
        self.ops: ModuleType = ops
        self.batch = batch
        self.num_tokens = num_tokens
        self.dtype = dtype
        """The q/k/v rows' dtype (the model's): cos/sin's and the pool's for the paged decode."""
        self.group = _paged_decode_group(batch, first_attention, head_dim, dtype)
        self.rotations: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}   # rope key -> cos, sin [T, D]
        self.windows: dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        """Sliding window -> slot_mapping [T], slots [T, C], spans [T] of the paged decode (None: the backend's)."""
        self.write_and_attend = paged_decode.qkv_call()
        """``paged_decode.write_and_attend_qkv`` (the build's own function where nothing replaced it)."""

    def rotation(self, rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, D]`` in the rows' dtype for ``rotary`` (a RotaryEmbedding)."""
        key = (rotary.cache_key, self.dtype)
        rotation = self.rotations.get(key)
        if rotation is None:
            rope_cache = self.batch.rope_cache
            cos_sin = rope_cache.get(key) if rope_cache is not None else None
            if cos_sin is None:
                cos_sin = rotary.cos_sin(self.batch.positions, self.dtype)
                if rope_cache is not None:
                    rope_cache[key] = cos_sin
            cos, sin = cos_sin
            rotation = self.rotations[key] = (cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
        return rotation

    def rope_and_attend(self, plan: LayerPlan, qkv: torch.Tensor, offset: bool) -> torch.Tensor:
        """``attend`` after the q/k norms (``offset``: Gemma's (1 + w)) and RoPE of ``qkv`` in place (cos
        and sin looked up once a step per rope: ``rotation``)."""
        cos, sin = self.rotation(plan.rotary)
        self.ops.norm_rope_qkv_(qkv, plan.num_heads, plan.num_kv_heads, cos, sin, plan.q_norm, plan.k_norm,
                                plan.head_eps, offset)
        return self.attend(plan.attention, qkv, plan)

    def attend(self, layer: Any, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """``[T, H * D]``: attention of the q heads of ``qkv`` (the QKV projection's rows, rope applied;
        ``plan.heads`` gives its q, k, v) over the cache with its k and v written at the batch's slots
        (``layer``: the Attention module)."""
        paged = self.paged(layer.sliding_window)
        if paged is None:
            q, k, v = plan.heads(qkv)
            attended: torch.Tensor = self.batch.attention.forward(q, k, v, layer, self.batch)
            return attended.contiguous()
        k_cache, v_cache = self.batch.kv_cache.layer(layer.layer_id)   # the backend's decode, without its dispatch
        slot_mapping, slots, spans = paged
        return self.write_and_attend(qkv, plan.num_heads, k_cache, v_cache, slot_mapping, slots, spans, layer.scale)

    def paged(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The paged decode's tensors for layers of ``window`` (slot_mapping [T], slots [T, C], spans
        [T]), built once a step; None where the backend computes them."""
        paged: Any = self.windows.get(window, False)
        return self._window(window) if paged is False else paged

    def _window(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The paged decode's tensors for layers of ``window`` (kept in ``windows``), None where the
        backend computes them."""
        view = self.group.view(window, True) if self.group is not None else None
        paged = self.windows[window] = (None if view is None or view.spans is None else (
            self.batch.slot_mapping, view.slots.view(self.num_tokens, view.num_columns), view.spans))
        return paged


class FlatDecodePlan:
    """Every held layer's plan (``layer_plan``; None when one layer cannot take the flat path):
    ``applies`` says whether a forward can, ``run`` (the family's) computes it."""

    def __init__(self, layers: Sequence[Any], routed: bool = False) -> None:
        self.routed = routed
        """Whether the GGUF layers' calls are their ``routed_call``s: generation-only passes of any row
        count (each call picks its route), none with prompt rows; else their prepared calls (a few rows)."""
        plans = [self.layer_plan(layer) for layer in layers]
        self.layers: list[Any] | None = None if not plans or any(plan is None for plan in plans) else plans
        if self.layers is not None and not routed:   # the routed plan reads the same copies, or its own
            # a native part that keeps its weights' addresses (LlamaDecodePlan's DecodeMlp) is made after this
            moved, moved_bytes = gather_on_huge_pages(list(self.weights()))
            if moved:
                logger.info("flat decode: %d weight copies (%.1f MiB) gathered onto huge pages in step order",
                            moved, moved_bytes / 2**20)
        calls = [call for plan in self.layers or () for call in (plan.qkv_call, plan.o_call, plan.gate_up_call,
                                                                   plan.down_call)]
        dtype = call_dtype(calls)
        if dtype is None:   # no layers, or layers in different dtypes
            self.layers, calls = None, []
        for plan in self.layers or ():
            plan.gate_up_act = gate_up_act(plan.gate_up_call, plan.activation_kind)
        for plan, following in zip(self.layers or (), (self.layers or [])[1:]):
            plan.next_input_norm, plan.next_eps = following.input_norm, following.eps
        self.dtype = dtype or torch.bfloat16
        """The model's dtype: every prepared call's rows, the norms' weights, q/k/v and cos/sin."""
        self.rounds = self.dtype == torch.bfloat16
        """Whether the calls round their outputs to bf16 (``round_out``): a bf16 model's rows."""
        self.generation_rows = min((decode_rows(call, True) for call in calls), default=0)
        """Most rows of a generation-only pass every layer's prepared calls take (``decode_rows``: how far
        each layer's 1-row route reaches in its route table)."""
        self.prompt_rows = min((decode_rows(call, False) for call in calls), default=0)
        """The same for a pass with prompt rows (which may take the int8 GEMM sooner)."""
        self._by_rows_calls = [call[0] for call in calls if isinstance(call[0], RowsCopies)]
        """The calls whose copy depends on the pass's rows (``RowsCopies``; the copies' floats differ)."""
        self.stack: NativeStack | None = None
        """Every layer of a one-row float32 step in one native call (``decode_stack``; the family sets it
        once its layers have their ``mlp_run``), or None."""
        self.round_updates = self.rounds and not (layers and getattr(layers[0].self_attn.o_proj,
                                                                     "float_residual_output", False))
        """Whether the o and down projections round their outputs to bf16 (False: a float32 model's, or
        they join a float32 residual stream unrounded, as ``GGUFBlockLinearMethod.apply`` gives them on
        the module path)."""
        probe: list[nn.Module] = [layers[0].self_attn.qkv_proj] if self.layers else []   # no plan: no probe
        self._hooks: list[dict[int, Any]] = [hooks for module in (*layers, *probe)
                                             for hooks in (module._forward_pre_hooks, module._forward_hooks)]
        """The hook dicts (filled in place by ``register_forward_*hook``) of every layer module and of one
        probe op: a hook on a layer (``HiddenCapture``: EAGLE-3 reads the layers' inputs) or on the probe
        (benchmarks/profile_decode.py's op timers) sends the step through the modules, which call it."""

    def weights(self) -> Iterator[torch.Tensor]:
        """The tensors the layers' calls read, in the order a step reads them (layer by layer: QKV, O,
        gate_up, down; each call's own copy, then the rows kernel's copies for other row counts). The
        plan gathers them onto huge pages (``gather_on_huge_pages``). Against the same copies on fresh
        4-KiB pages, alternated in one process with the same tokens (AMD Zen 4 VM): Gemma 3 270M's
        one-row step 9.71 -> 9.50 ms (7 of 10 runs faster), Qwen2.5-Coder 0.5B's 16.45 -> 15.72 (9 of
        10), Gemma at 32 rows 54.1 -> 51.8 (4 of 6), Qwen at 8 rows within noise (4 of 8)."""
        for plan in self.layers or ():
            for call in (plan.qkv_call, plan.o_call, plan.gate_up_call, plan.down_call):
                yield from (item for item in call[1:4] if isinstance(item, torch.Tensor))
                if isinstance(call[0], RowsCopies):
                    yield from (item for copy in call[0].by_rows for item in copy if isinstance(item, torch.Tensor))

    def layer_plan(self, layer: Any) -> Any | None:
        raise NotImplementedError

    final_norm_type: type[nn.Module] = RMSNorm
    """The final norm ``fuses_final_norm`` takes: the family's RMSNorm."""

    def mlp_in_one_call(self, plan: LayerPlan, num_tokens: int, attended: torch.Tensor, hidden: torch.Tensor,
                        final_norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The layer's MLP half through ``plan.mlp_run`` where it applies (one row, and a next layer or a
        final norm it computes): (the next layer's input norm, the residual stream), or (the final norm's
        output, None) after the last layer; None: ``run`` makes the separate calls."""
        if plan.mlp_run is None or num_tokens != 1:
            return None
        if plan.next_input_norm is not None:
            normed, summed = plan.mlp_run(attended, hidden, plan.next_input_norm, plan.next_eps)
            return normed, summed
        if final_norm is not None and self.fuses_final_norm(final_norm):
            return plan.mlp_run(attended, hidden, final_norm.weight, final_norm.eps)[0], None
        return None

    def in_one_call(self, step: DecodeStep, normed: torch.Tensor, hidden: torch.Tensor,
                    final_norm: nn.Module | None) -> torch.Tensor | None:
        """The whole step through ``stack`` where it applies (one row, a final norm it computes, the
        paged decode's attention): the final norm's output; else None (``run`` calls the layers)."""
        if (self.stack is None or step.num_tokens != 1 or final_norm is None
                or not self.fuses_final_norm(final_norm)):
            return None
        return self.stack.run(step, normed, hidden, final_norm)

    def fuses_final_norm(self, norm: nn.Module | None) -> bool:
        """Whether ``run`` computes ``norm`` (the model's final norm) with the last layer's calls: the
        family's RMSNorm with its weight in the plan's dtype and no hooks (a tensor dump's)."""
        return (type(norm) is self.final_norm_type and norms_fuse([norm], self.dtype)
                and not (norm._forward_hooks or norm._forward_pre_hooks))

    def acted(self, plan: LayerPlan, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the MLP's input ``x``: one rows-kernel call where the layer has one
        (``gate_up_act``: bf16 rows on AVX512-BF16, the same bits without the [T, 2I] gate_up in
        memory or act_and_mul's call), else its gate_up call, then act_and_mul."""
        if plan.gate_up_act is not None:
            return plan.gate_up_act(x)
        kernel, codes, scales, offsets, block = plan.gate_up_call
        return ops.act_and_mul(kernel(x, codes, scales, offsets, block, self.rounds), plan.activation_kind)

    def call_of(self, linear: Any, allow_bias: bool = False) -> KernelCall | None:
        """``kernel_call`` of one of a layer's linears, routed where this plan is."""
        return kernel_call(linear, allow_bias, self.routed)

    def run(self, hidden: torch.Tensor, batch: ForwardBatch, final_norm: nn.Module | None = None) -> torch.Tensor:
        """The layers' output for ``hidden`` [T, hidden] (``applies`` checked by the caller), through
        ``final_norm`` where given."""
        raise NotImplementedError

    def max_rows(self, batch: ForwardBatch | None = None) -> int:
        """Most rows of ``batch`` every layer's prepared calls take (``generation_rows`` where every
        row of it is a generation row, else ``prompt_rows``)."""
        rows = batch.rows if batch is not None else None
        return self.generation_rows if rows is not None and rows.generation_only else self.prompt_rows

    def applies(self, hidden: torch.Tensor, batch: ForwardBatch) -> bool:
        return (self.layers is not None and hidden.dtype in (torch.float32, self.dtype) and hidden.dim() == 2
                and not any(self._hooks)
                and hidden.shape[0] <= self.max_rows(batch) and hidden.is_contiguous() and not batch.lora
                and fused.applies(hidden) and self._same_copies(hidden.shape[0], batch))

    def _same_copies(self, num_rows: int, batch: ForwardBatch) -> bool:
        """Whether a mixed pass of ``num_rows`` rows reads the copies its generation rows alone would
        (else the module path, which computes those rows as a pass of their own: their results do not
        depend on the prompt rows beside them, ``GGUFBlockLinearMethod.apply``)."""
        generation = batch.rows.mixed_generation_rows(num_rows) if batch.rows is not None else None
        return generation is None or all(kernel.copy_for(num_rows) is kernel.copy_for(len(generation))
                                         for kernel in self._by_rows_calls)

    def step(self, hidden: torch.Tensor, batch: ForwardBatch) -> DecodeStep:
        """The forward's ``DecodeStep`` (``applies`` checked by the caller)."""
        assert self.layers is not None
        first = self.layers[0]
        return DecodeStep(batch, hidden.shape[0], first.attention, first.head_dim, self.dtype)


def run_layers(model: Any, plan_type: type[FlatDecodePlan], hidden: torch.Tensor,
               batch: ForwardBatch, final_norm: nn.Module | None = None) -> torch.Tensor:
    """``model``'s held layers (``model.layers[i]`` for ``model.held_layers``) over ``hidden`` in its
    residual stream's dtype (``model.residual_dtype``, ``--residual-dtype``; None: as it comes): through
    its flat plan (a ``plan_type``, built at the first forward, when the GGUF block weights are in
    place) where the plan applies, else module by module; then ``final_norm`` where given (the plan
    may fuse it with the last residual add)."""
    if model.residual_dtype is not None:   # the embedding's rows join the stream (a later stage's are in it)
        hidden = hidden.to(model.residual_dtype)
    plan: FlatDecodePlan | None = model.__dict__.get("decode_plan")
    if plan is None:
        plan = model.__dict__["decode_plan"] = plan_type([model.layers[index] for index in model.held_layers])
    if plan.applies(hidden, batch):   # a few rows on block weights: the same kernels, less Python
        return plan.run(hidden, batch, final_norm)
    routed: FlatDecodePlan | None = model.__dict__.get("routed_decode_plan")
    if routed is None:
        routed = model.__dict__["routed_decode_plan"] = plan_type([model.layers[index] for index in model.held_layers],
                                                                  routed=True)
    if routed.applies(hidden, batch):   # more generation rows: each linear as its route for them, less Python
        return routed.run(hidden, batch, final_norm)
    for index in model.held_layers:
        hidden = model.layers[index](hidden, batch)
    return hidden if final_norm is None else final_norm(hidden)


def _paged_decode_group(batch: ForwardBatch, attention: Any, head_dim: int, dtype: torch.dtype) -> Any | None:
    """The batch's one attention group where every row of the batch is a decode that
    TorchNativeAttention would send to the paged decode kernel as one identity group (a pool in the
    rows' ``dtype``,
    no draft trees, causal layers): ``attend`` then writes K/V and calls ``paged_decode.attend`` itself
    with the group's own views (the same slots and spans); None where the backend must decide."""
    metadata = batch.attn_metadata
    if (type(batch.attention) is not TorchNativeAttention or not isinstance(metadata, TorchNativeMetadata)
            or batch.trees is not None or len(metadata.groups) != 1 or batch.kv_cache is None
            or batch.kv_cache.dtype != dtype or not attention.is_causal):
        return None
    group = metadata.groups[0]
    if not group.is_identity or group.max_query != 1 or group.trees is not None:
        return None
    k_cache, v_cache = batch.kv_cache.layer(attention.layer_id)
    q_like = torch.empty(0, head_dim, dtype=dtype)
    if v_cache.shape[-1] != head_dim or not paged_decode.supports(q_like, k_cache):
        return None
    return group


MLP_KINDS = ("block_linear_a16", "block_linear", "packed_a16", "packed_a16_centered", "packed_a8", "packed_a8_centered")
"""The block kernel's one-row functions ``DecodeMlp`` takes, by its ``kind`` (their index)."""
MLP_ACTIVATIONS = (fused.ACTIVATION_KINDS["silu"], fused.ACTIVATION_KINDS["gelu_pytorch_tanh"])
"""The activations ``DecodeMlp`` computes (its ``activation``: SiLU 0, GELU tanh 1, fused_ops' kinds)."""


def decode_mlp(plan: LayerPlan, dtype: torch.dtype, norms: list[torch.Tensor]) -> Any:
    """``plan``'s MLP half in one native call (the AVX2 block kernel's ``DecodeMlp.run``: o, the norms,
    gate_up, act * up, down and the next layer's input norm, the same kernels' floats in one parallel
    region) where it applies: a float32 model (nothing rounded to bf16), the three projections on that
    kernel's integer-activation functions without a bias, SiLU or GELU tanh, the hidden size a multiple of
    16, the intermediate of 8, float32 norms; else None (``run`` makes the separate calls). ``norms``:
    [post-attention] (Llama: its add + norm) or the three of Gemma 3 (post-attention, pre- and
    post-feedforward: (1 + w) norms, the post-norms' adds after them)."""
    module = gguf_kernel.load_kernel()
    mlp_type = getattr(module, "DecodeMlp", None)
    if mlp_type is None or dtype != torch.float32 or plan.activation_kind not in MLP_ACTIVATIONS:
        return None
    kinds = {getattr(module, name): kind for kind, name in enumerate(MLP_KINDS)}
    calls = (plan.o_call, plan.gate_up_call, plan.down_call)
    if any(kinds.get(call[0]) is None for call in calls):
        return None
    o, gate_up, down = calls
    hidden, inner = o[1].shape[0], gate_up[1].shape[0] // 2
    if (hidden % 16 or inner % 8 or down[1].shape[0] != hidden
            or any(norm.dtype != torch.float32 or norm.shape != (hidden,) for norm in norms)):
        return None
    o_k = plan.num_heads * plan.head_dim
    return mlp_type(kinds[o[0]], o[1], o[2], o[3], o[4], o_k, norms, plan.eps,
                    kinds[gate_up[0]], gate_up[1], gate_up[2], gate_up[3], gate_up[4],
                    kinds[down[0]], down[1], down[2], down[3], down[4], plan.activation_kind).run


@dataclass(slots=True)
class NativeStack:
    """Every layer of a plan's one-row float32 step in one native call (the AVX2 block kernel's
    ``DecodeStack``: per layer the QKV call, q/k norms + RoPE, K/V written and attention through the
    loaded fused-ops and paged-decode builds' own functions, then the layer's ``DecodeMlp``): the
    same floats as the per-layer calls, without their Python and their parallel regions."""

    native: Any
    rotaries: list[Any]
    """One RotaryEmbedding per rope the layers read (the native layer's ``rope`` index)."""
    windows: list[int | None]
    """The sliding windows the layers read (the native layer's ``window`` index)."""
    layer_ids: list[int]
    attend: Any
    """The paged decode build's ``write_and_attend_qkv``: the stack runs only where a step would call it."""

    def run(self, step: DecodeStep, normed: torch.Tensor, hidden: torch.Tensor,
            final_norm: nn.Module) -> torch.Tensor | None:
        """The final norm of the last layer's output for one row (``FlatDecodePlan.in_one_call`` checks
        the rows; ``normed``: the first layer's input norm of ``hidden``), or None where the step's
        attention is not the paged decode's own call."""
        if step.write_and_attend is not self.attend:
            return None
        paged = []
        for window in self.windows:
            views = step.paged(window)
            if views is None:
                return None
            paged.append(views)
        rotations = [step.rotation(rotary) for rotary in self.rotaries]
        kv_cache = step.batch.kv_cache
        pools = [kv_cache.layer(layer_id) for layer_id in self.layer_ids]
        return self.native.run(normed, hidden, [cos for cos, _ in rotations], [sin for _, sin in rotations],
                               paged[0][0], [views[1] for views in paged], [views[2] for views in paged],
                               [k for k, _ in pools], [v for _, v in pools], final_norm.weight, final_norm.eps)[0]


def decode_stack(plans: Sequence[LayerPlan], offset: bool) -> NativeStack | None:
    """``plans``' one-row float32 step as one ``DecodeStack`` call where every layer has its MLP half in
    one call (``decode_mlp``: the AVX2 block kernel, a float32 model) and a QKV call of that kernel's
    integer-activation functions (a float32 bias or none), and the fused ops' and paged decode's builds
    give their one-row functions; else None. ``offset``: Gemma's (1 + w) q/k norms."""
    module = gguf_kernel.load_kernel()
    stack_type = getattr(module, "DecodeStack", None)
    ops, attention = fused.load_kernel(), paged_decode.load_kernel()
    norm_rope = getattr(ops, "NORM_ROPE_QKV_ROW_F32", None)
    attend = getattr(attention, "ROW_ATTENTION_F32", None)
    if stack_type is None or norm_rope is None or attend is None or not plans:
        return None
    mlps = [getattr(plan.mlp_run, "__self__", None) for plan in plans]
    if any(type(mlp) is not module.DecodeMlp for mlp in mlps):
        return None
    kinds = {getattr(module, name): kind for kind, name in enumerate(MLP_KINDS)}
    ropes: dict[Any, int] = {}
    rotaries: list[Any] = []
    windows: dict[int | None, int] = {}
    native = stack_type(norm_rope, attend)
    for plan, mlp in zip(plans, mlps):
        kernel, codes, scales, offsets, block = plan.qkv_call
        bias = getattr(plan, "qkv_bias", None)
        heads, kv_heads, head_dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
        if (kinds.get(kernel) is None or (bias is not None and bias.dtype != torch.float32)
                or heads % kv_heads or head_dim % 2 or codes.shape[0] != (heads + 2 * kv_heads) * head_dim):
            return None   # what DecodeStack.add_layer would refuse
        if plan.rotary.cache_key not in ropes:
            ropes[plan.rotary.cache_key] = len(rotaries)
            rotaries.append(plan.rotary)
        window = windows.setdefault(plan.attention.sliding_window, len(windows))
        native.add_layer(kinds[kernel], codes, scales, offsets, block, bias, heads, kv_heads, head_dim, plan.q_norm,
                         plan.k_norm, plan.head_eps, offset, ropes[plan.rotary.cache_key], window,
                         plan.attention.scale, plan.input_norm, plan.eps, mlp)
    return NativeStack(native, rotaries, list(windows), [plan.attention.layer_id for plan in plans],
                       attention.write_and_attend_qkv)
