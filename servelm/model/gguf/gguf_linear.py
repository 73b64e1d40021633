"""Linear layers, LM head and embedding that run GGUF weights in the blocks the file stores.

``GGUFBlockLinearMethod`` holds a ``BlockWeight`` (int8 codes + a float scale, and an offset for
some types, per 16 or 32 inputs; the lossless repack of gguf_blocks.py) and computes each call on
one of the routes of gguf_routes.py:

- ``block``: the block kernel (gguf_kernel.cpp, or any build with its API). ``activations="int16"``
  (``--quantization gguf``, the default for GGUF files): activations rounded to 16 bits per 32 inputs
  (2e-5 relative error per layer); ``"int8"`` (``--quantization gguf_a8``): to int8 per 32 inputs as
  llama.cpp does (5e-3); ``"float"``: unrounded (the exactness reference). The AVX2 build reads the
  codes packed at their own bit width (``PackedCodes``: 4-6 bits per weight instead of 8, the same
  products bit for bit) for rounded activations; the int8 codes are then dropped after load. It also
  reads the scales and offsets compact (``BlockWeight.with_compact``: fp16, or the K-quants' int8
  sub-scales times a float32 per 256 inputs; the same float32 values in the kernel).
- ``tiles``: the AVX2 build's float-activation tiles on the block route's codes (``packed_float``, no
  copy of its own): activations unrounded, weight rows dequantized per call into an L2-sized float32
  tile, then register-blocked FMAs; held beside a block route that rounds activations (int16, int8).
- ``rows``: the rows kernel's GEMM (gguf_rows.cpp ``rows_gemm``, AVX512-BF16) on a copy of the codes
  packed at load (1 byte per weight), bf16 activations unrounded, scales applied in float32.
- ``packed``: the same GEMM on a copy at the codes' bit width (Q4_0/Q4_1/Q4_K/Q5_0: 0.5-0.63 bytes per
  weight; ``gguf_bits``): the same products, fewer bytes, more instructions to widen them.
- ``int8``: the int8 GEMM (gguf_i8gemm.cpp) on its own copy, activations rounded to int8 per block:
  prompt rows only, never the KV projections or the head (gguf_routes.py ``allowed``).
- ``dense``: oneDNN's GEMM on a copy dequantized once at load (bf16 where the CPU has a native bf16
  GEMM, else float32; dequantizing per call cost 40% of a 32-stream server's throughput).
- ``amx``: the dense copy's product on AMX tiles (gguf_rows.cpp ``amx_gemm``), the weights widened per call
  from the ``packed`` copy (or the ``rows`` one for a type without a bit form), never from 2 bytes a weight:
  batched decode is bound by the bytes it reads (a CPU with AMX tiles; ``AMX_FIRST_ROW`` to ``AMX_LAST_ROW`` rows).

Which route each row count takes is resolved once per layer shape at load (``LayerRoutes``) from a
ranking: measured on this machine (servelm/model/routes.py) or, without a measurement, earlier
sessions' Zen 5 constants (``default_ranking``); the quality rules filter it. The copies a layer
keeps are those its model dtype's routes use. A layer's prepared decode call (``gguf_decode_args``,
a ``PreparedCall``) is its 1-row route's kernel for rows in the model's dtype (bf16, or float32 on a
CPU without a native bf16 GEMM) where that is ``block``, ``rows`` or ``packed`` (bf16 only), with how many rows it
reaches; the flat decode paths (architectures/*_decode.py) call it directly.

The pass's facts (which rows are generation rows) come with each call as a ``PassRows`` from the
forward batch. In a mixed pass whose route at its row count is not the one a pass of only its
generation rows takes (or is not row-independent: oneDNN, the int8 GEMM), the generation rows are
computed again as that pass computes them, so a stream's results do not depend on the prompt chunk
sharing its step (~1-3% of a mixed pass's GEMM time).

Invariants: ``apply`` returns x's dtype, except on the LM head (float32, so the kernel's logits are
not rounded to a bf16 model's dtype: rounded, they tie and flip greedy choices, 62% instead of 88%
identical outputs on Qwen2.5-Coder 0.5B) and on a layer marked ``float_residual_output``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from servelm.model.gguf import gguf_i8gemm
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_routes import (BF16_KERNEL_MAX_ROWS, GENERATION_ONLY, I8_GEMM_FIRST_ROW, I8_GEMM_LEAD,
                                            I8_GEMM_SKIPPED, KERNEL_MAX_ROWS, ROW_INDEPENDENT, LayerRoutes,
                                            LinearShape, PassRows, Ranking, Route, default_ranking)
from servelm.model.gguf import gguf_rows
from servelm.model.gguf.gguf_rows import PACKED_KINDS, pack
from servelm.model.layers import fused
from servelm.model.layers.linear import dense_linear

__all__ = ["BF16_KERNEL_MAX_ROWS", "I8_GEMM_FIRST_ROW", "I8_GEMM_LEAD", "I8_GEMM_SKIPPED", "KERNEL_MAX_ROWS", "BlockRows",
           "GGUFBlockLinearMethod", "GateUpAct", "PreparedCall", "decode_rows", "gate_up_act"]


class PreparedCall(tuple):  # type: ignore[type-arg]
    """``(kernel, codes, scales, offsets, block)``: a layer's decode call, prepared once at load, with
    how far it reaches (from its ``LayerRoutes``). Called as ``kernel(x, codes, scales, offsets, block,
    round_out[, bias])``: x [M, K] in ``dtype``; ``round_out`` (bf16 only) rounds the result to bf16,
    else it is float32. ``codes`` is what ``kernel`` reads: the int8 codes, the rows kernel's copy, or
    the ``PackedCodes`` bytes (the AVX2 build's ``packed_*`` functions)."""

    dtype: torch.dtype
    """The rows' dtype it takes (the model's): bf16, or float32 (the block kernel only)."""

    generation_rows: int
    """Calls of 1..n generation rows (a decode pass) take this kernel."""
    prompt_rows: int
    """Calls of 1..n rows of any kind take it (prompt rows may take the int8 GEMM sooner)."""
    takes_bias: bool
    """Whether it takes a bias as its last argument (the block kernel at one row; the rows kernel's
    ``rows_call``)."""

    @classmethod
    def of(cls, args: tuple[object, ...], dtype: torch.dtype, generation_rows: int, prompt_rows: int,
           takes_bias: bool) -> PreparedCall:
        call = cls(args)
        call.dtype, call.generation_rows, call.prompt_rows, call.takes_bias = (dtype, generation_rows, prompt_rows,
                                                                               takes_bias)
        return call

    @property
    def rounds(self) -> bool:
        """Whether its outputs may be rounded to bf16 (``round_out``): a bf16 model's rows."""
        return self.dtype == torch.bfloat16


ROWS_KERNEL_ROUTES = frozenset({Route.ROWS, Route.PACKED})
"""The rows kernel's two routes: the same ``rows_gemm`` on the byte copy or the bit-width one."""

KERNEL_BIAS_ROUTES = ROWS_KERNEL_ROUTES | {Route.INT8, Route.AMX}
"""Routes whose kernel adds a bias itself (in float32, before its rounding to bf16)."""


def takes_kernel_bias(bias: torch.Tensor | None) -> bool:
    """Whether ``bias`` is one those kernels add (float32 or bf16)."""
    return bias is not None and bias.dtype in (torch.float32, torch.bfloat16)


def lead_rest(state: dict[str, object], rows: int, is_bf16: bool) -> Route | None:
    """Where a call of ``rows`` prompt rows takes a merged layer's lead on the int8 GEMM (``gguf_lead``,
    ``GGUFBlockLinearMethod.run_lead``): the route of its other outputs (the layer's own pick for the
    call, one that computes them apart), else None. ``state``: the layer's ``__dict__``."""
    lead = state.get("gguf_lead")
    if lead is None or lead[1].pick(rows, is_bf16, True) is not Route.INT8:   # type: ignore[index]
        return None
    rest = state["gguf_routes"].pick(rows, is_bf16, True)   # type: ignore[attr-defined]
    return rest if rest in lead[2] else None   # type: ignore[index]


class RowsCopies:
    """A prepared decode call's kernel where a layer holds both of the rows kernel's copies:
    ``rows_call`` on the copy its route table gives an m-row call (``by_rows[m - 1]``), whatever
    copy the call passes (the plan's arguments are the 1-row route's)."""

    __slots__ = ("gemm", "by_rows")

    def __init__(self, gemm: Callable[..., torch.Tensor], by_rows: tuple[tuple[torch.Tensor, ...], ...]) -> None:
        self.gemm, self.by_rows = gemm, by_rows

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 block: int, round_out: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.gemm(x, *self.copy_for(x.shape[0]), block, round_out, bias)

    def copy_for(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The copy an m-row call reads (the two copies' floats differ: their codes are biased
        differently)."""
        return self.by_rows[min(rows, len(self.by_rows)) - 1]


class GateUpAct:
    """A gated MLP's gate_up prepared call and act(gate) * up in one call of the rows kernel
    (gguf_rows.cpp ``rows_act``: each gate tile with the up tile of the same outputs, the [M, N] gate_up
    never written): the bits that the call's bf16 output then fused_ops' ``act_and_mul`` give. Made by
    ``gate_up_act`` where the call is the rows kernel's."""

    __slots__ = ("rows_act", "call", "kind")

    def __init__(self, rows_act: Callable[..., torch.Tensor], call: PreparedCall, kind: int) -> None:
        self.rows_act, self.call, self.kind = rows_act, call, kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel, codes, scales, offsets, block = self.call
        if isinstance(kernel, RowsCopies):
            codes, scales, offsets = kernel.copy_for(x.shape[0])
        return self.rows_act(x, codes, scales, offsets, block, self.kind)


def gate_up_act(call: PreparedCall, kind: int) -> GateUpAct | None:
    """``GateUpAct`` for a gate_up layer's prepared call and its activation's fused kind (SiLU 0, GELU
    tanh 1), or None where the call is not the rows kernel's on bf16 rows (then gate_up, then
    act_and_mul): the call reads every packed output (its reach ends before padded ones) and its gate
    half ends on a tile."""
    kernel = call[0]
    gemm = kernel.gemm if isinstance(kernel, RowsCopies) else kernel
    module = gguf_rows.load_kernel()
    if module is None or gemm is not module.rows_call or not call.rounds or kind not in (0, 1):
        return None
    tile_outputs = module.GEMM_COLS * 16
    outputs = call[1].shape[0] * tile_outputs
    return GateUpAct(module.rows_act, call, kind) if outputs % (2 * tile_outputs) == 0 else None


def rows_kernel_copy(layer: nn.Module, route: Route) -> tuple[torch.Tensor, ...]:
    """The copy ``route`` (one of ROWS_KERNEL_ROUTES, or ``amx``) reads: the byte copy or the bit-width one
    (``amx``: the bit-width one where the weight's type has it, else the byte copy)."""
    if route is Route.AMX:
        return layer.gguf_bits if amx_reads_bits(layer.gguf_weight) else layer.gguf_packed
    return layer.gguf_packed if route is Route.ROWS else layer.gguf_bits


def amx_reads_bits(weight: BlockWeight) -> bool:
    """Whether the ``amx`` route reads ``weight``'s bit-width copy (its type packs: ``PACKED_KINDS``), not the byte copy."""
    return weight.kind in PACKED_KINDS


def decode_rows(call: tuple[object, ...], generation_only: bool = True) -> int:
    """Most rows a layer's prepared decode call takes (of a generation-only pass, or of any pass)."""
    if not isinstance(call, PreparedCall):
        return 0
    return call.generation_rows if generation_only else call.prompt_rows


ACTIVATION_MODES = ("int16", "int8", "float")
_KERNELS = {"int16": "block_linear_a16", "int8": "block_linear", "float": "block_linear_float"}
_PACKED_KERNELS = {("int16", False): "packed_a16", ("int16", True): "packed_a16_centered",
                   ("int8", False): "packed_a8", ("int8", True): "packed_a8_centered"}
"""The block kernel's functions on ``PackedCodes`` (by activation mode and ``centered``): the AVX2
build's; a build without them (AVX-512) reads the int8 codes."""
_TILES_KERNELS = {False: "packed_float", True: "packed_float_centered"}
"""The ``tiles`` route's functions on ``PackedCodes`` (by ``centered``; int8 codes: ``block_linear_float``)."""


class GGUFBlockLinearMethod:
    """Computes ``x @ W.T`` from a ``BlockWeight`` (see the module docstring)."""

    name = "gguf"

    def __init__(self, kernel: object | None, dense_dtype: torch.dtype, activations: str = "int16",
                 rows_kernel: object | None = None, i8_kernel: object | None = None,
                 ranking: Ranking | None = None) -> None:
        assert activations in ACTIVATION_MODES, activations
        self.kernel = kernel
        """The block kernel's module (``block_linear_a16``/``block_linear``/``block_linear_float``), or None."""
        self.rows_kernel = rows_kernel if dense_dtype == torch.bfloat16 else None
        """The rows kernel (gguf_rows.py's module), or None; only beside a bf16 dense dtype (a CPU with
        a native bf16 GEMM: it serves bf16 rows)."""
        self.amx = self.rows_kernel is not None and gguf_rows.amx_ready(self.rows_kernel)
        """Whether the ``amx`` route runs here (the rows kernel's ``amx_gemm``: a CPU with AMX tiles)."""
        self.i8_kernel = i8_kernel if activations != "float" else None
        """The int8 GEMM (a build of gguf_i8gemm.py's: VNNI or AVX2), or None; never with ``float`` activations."""
        self.dense_dtype = dense_dtype
        """Dtype of the dequantized copy (bf16 with a native bf16 GEMM)."""
        self.activations = activations
        """How the block kernel takes activations: ``int16`` rounds them to 16 bits per 32 inputs,
        ``int8`` to 8 bits as llama.cpp does, ``float`` multiplies them unrounded."""
        self.packs = kernel is not None and hasattr(kernel, _PACKED_KERNELS.get((activations, False), ""))
        """Whether the block route reads the codes packed at their bit width (``PackedCodes``; the AVX2
        build, rounded activations): ``process`` packs each weight whose codes fit."""
        self.compact_scales = kernel is not None and getattr(kernel, "COMPACT_SCALES", False)
        """Whether the block kernel takes the compact scales and offsets (the AVX2 build)."""
        self.tiles = kernel is not None and activations != "float" and hasattr(kernel, _TILES_KERNELS[False])
        """Whether the ``tiles`` route is built (the AVX2 build) beside a block route that rounds the
        activations (with ``float`` activations the block route is that function already)."""
        self.ranking: Ranking = ranking or self.default_ranking
        """(shape, x is bf16, rows) -> routes fastest first: measured (model/routes.py) or the defaults."""
        self._resolved: dict[tuple[LinearShape, bool], LayerRoutes] = {}

    def default_ranking(self, shape: LinearShape, x_bf16: bool, rows: int) -> tuple[Route, ...]:
        return default_ranking(shape, x_bf16, rows, self.activations, self.dense_dtype == torch.bfloat16,
                               int8_built=self.i8_kernel is not None)

    def shape(self, weight: BlockWeight, float_output: bool = False, int8_rows: bool = True) -> LinearShape:
        """The route table's key for a layer with ``weight`` (``process``'s arguments)."""
        return LinearShape(weight.shape[1], weight.shape[0], weight.kind, float_output,
                           int8_rows and not float_output and self.activations != "float"
                           and self.int8_fits(weight))

    def int8_fits(self, *weights: BlockWeight) -> bool:
        """Whether the int8 GEMM's build takes the codes of ``weights`` (a merged layer's parts; the AVX2 build:
        spanning at most 127); True where no int8 GEMM is built (the shape's role stays what the layer is)."""
        return self.i8_kernel is None or gguf_i8gemm.fits(self.i8_kernel, *weights)

    def available(self, shape: LinearShape, block: int) -> frozenset[Route]:
        """The routes whose kernel is built and takes this shape (before the quality rules)."""
        routes = {Route.DENSE}
        if self.kernel is not None and shape.in_features % 64 == 0:
            routes.add(Route.BLOCK)
            if self.tiles:
                routes.add(Route.TILES)
        if self.rows_kernel is not None and shape.in_features % 64 == 0:
            routes.add(Route.ROWS)
            if shape.kind in PACKED_KINDS:
                routes.add(Route.PACKED)
            if self.amx:
                routes.add(Route.AMX)
        if self.i8_kernel is not None and shape.may_int8 and block in (16, 32):
            routes.add(Route.INT8)
        return frozenset(routes)

    def routes(self, shape: LinearShape, block: int, model_dtype: torch.dtype) -> LayerRoutes:
        """The layer's resolved routes (one per shape and model dtype)."""
        key = (shape, model_dtype == torch.bfloat16)
        if key not in self._resolved:
            self._resolved[key] = LayerRoutes.resolve(shape, self.available(shape, block), self.ranking, key[1],
                                                      self.activations, self.dense_dtype == torch.bfloat16)
        return self._resolved[key]

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("GGUF block layers are made from loaded layers by apply_gguf_blocks")

    def process(self, layer: nn.Module, weight: BlockWeight, float_output: bool = False,
                int8_rows: bool = True, model_dtype: torch.dtype | None = None,
                int8_lead: BlockWeight | None = None) -> int:
        """Give ``layer`` its block weight in place of the float one, and the copies its routes use;
        returns the bytes stored. ``float_output``: the LM head (float32 logits). ``int8_rows``:
        whether the layer may take the int8 GEMM (``I8_GEMM_SKIPPED``). ``model_dtype``: the rows'
        dtype (default: the float weight's, else the dense copy's). ``int8_lead``: the block weight of
        the layer's leading outputs that may take the int8 GEMM on their own (``I8_GEMM_LEAD``:
        the query projection of a merged QKV; ``run_lead``)."""
        old = getattr(layer, "weight", None)
        dtype = model_dtype or (old.dtype if old is not None else self.dense_dtype)
        routes = self.routes(self.shape(weight, float_output, int8_rows), weight.block, dtype)
        rests = self.lead_rests(routes, int8_lead.shape[0]) if int8_lead is not None and not float_output else frozenset()
        lead_routes = self.routes(self.shape(int8_lead), int8_lead.block, dtype) if rests else None  # type: ignore[union-attr]
        layer.gguf_lead = ((int8_lead.shape[0], lead_routes, rests)   # type: ignore[union-attr]
                           if lead_routes is not None and Route.INT8 in lead_routes.held else None)
        """(leading outputs, their routes, the routes that compute the rest apart) where the leading
        outputs may take the int8 GEMM apart from the rest (``run_lead``), else None."""
        layer.gguf_weight = weight
        layer.gguf_routes = routes
        if self.packs and Route.BLOCK in routes.held:
            weight.with_packed()
        if self.compact_scales and Route.BLOCK in routes.held:
            weight.with_compact()
        amx_bits = Route.AMX in routes.held and amx_reads_bits(weight)
        layer.gguf_packed = self.rows_copy(weight, Route.ROWS in routes.held or (Route.AMX in routes.held and not amx_bits))
        layer.gguf_bits = self.rows_copy(weight, Route.PACKED in routes.held or amx_bits, bits=True)
        # where only the lead takes the int8 GEMM, only its outputs are packed
        layer.gguf_i8 = (gguf_i8gemm.pack_for(self.i8_kernel, weight) if Route.INT8 in routes.held
                         else gguf_i8gemm.pack_for(self.i8_kernel, int8_lead)  # type: ignore[arg-type]
                         if layer.gguf_lead is not None else None)
        layer.gguf_dense = weight.dequantize(dtype=self.dense_dtype) if Route.DENSE in routes.held else None
        layer.gguf_decode_args = self._decode_args(layer, routes, dtype)
        if old is not None:
            del layer.weight
            layer.register_parameter("weight", None)
        layer.linear_method = self
        return held_bytes(layer, weight)

    def lead_rests(self, routes: LayerRoutes, lead: int) -> frozenset[Route]:
        """The routes of ``routes.held`` that compute a merged layer's outputs after its first ``lead``
        on their own (``run_lead``): the dense copy's rows, the block kernel's float tiles on the
        weight's rows after ``lead``, the rows kernel's tiles where ``lead`` ends on a tile."""
        rests = routes.held & {Route.DENSE, Route.TILES}
        if self.rows_kernel is not None and lead % (self.rows_kernel.GEMM_COLS * 16) == 0:  # type: ignore[attr-defined]
            rests |= routes.held & ROWS_KERNEL_ROUTES
        return rests

    def prepare_all(self, layer: nn.Module, weight: BlockWeight, shape: LinearShape) -> int:
        """Give a bare module ``weight`` and the copy of every route ``available`` for ``shape``, so
        that ``run_route`` can force each (route timing, tests); returns the bytes it holds."""
        available = self.available(shape, weight.block)
        layer.gguf_weight = weight
        if self.packs and Route.BLOCK in available:
            weight.with_packed()
        layer.gguf_packed = self.rows_copy(weight, Route.ROWS in available)   # the amx route's copies too
        layer.gguf_bits = self.rows_copy(weight, Route.PACKED in available, bits=True)
        layer.gguf_i8 = gguf_i8gemm.pack_for(self.i8_kernel, weight) if Route.INT8 in available else None
        layer.gguf_dense = weight.dequantize(dtype=self.dense_dtype) if Route.DENSE in available else None
        return held_bytes(layer, weight)

    def rows_copy(self, weight: BlockWeight, held: bool, bits: bool = False) -> tuple[torch.Tensor, ...] | None:
        """The rows kernel's copy of ``weight`` where ``held``: a byte a code (the ``rows`` route), or
        at their bit width (``bits``: the ``packed`` route; a K-quant's scales as its sub-scales)."""
        if not held:
            return None
        return pack(weight.codes, weight.scales, weight.offsets, self.rows_kernel.GEMM_COLS,  # type: ignore[attr-defined]
                    bits=bits, factors=(weight.scale_factors, weight.offset_factors))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: PassRows | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype; in float32, unrounded, for the LM head and a layer whose
        output joins a float32 residual stream (``float_residual_output``). ``rows``: the pass's
        generation rows (None: a call outside a pass, every row a prompt row)."""
        state = layer.__dict__   # plain attributes: no nn.Module lookup on the decode path
        decode = state["gguf_decode_args"]
        unrounded = state.get("float_residual_output", False)
        generation_only = rows is not None and rows.generation_only
        if (decode and x.dtype == decode.dtype and x.dim() == 2
                and x.shape[0] <= (decode.generation_rows if generation_only else decode.prompt_rows)
                and (bias is None or decode.takes_bias)
                and x.is_contiguous() and x.device.type == "cpu"
                and (generation_only or lead_rest(state, x.shape[0], x.dtype == torch.bfloat16) is None)):
            kernel, codes, scales, offsets, block = decode
            round_out = decode.rounds and not unrounded
            # rounded to bf16 by the kernel, or float32; a bias added in float32 before any bf16
            # rounding, as ``run_route``'s ``out + bias`` (or the rows kernel there) does it
            out = kernel(x, codes, scales, offsets, block, round_out, bias)
            generation = rows.mixed_generation_rows(x.shape[0]) if rows is not None else None
            if (generation is not None and isinstance(kernel, RowsCopies)
                    and kernel.copy_for(x.shape[0]) is not kernel.copy_for(len(generation))):
                # a mixed pass on another copy than its generation rows alone would read: those
                # rows as a pass of only them computes them (as below for the routes)
                out.index_copy_(0, generation, self.apply(layer, x.index_select(0, generation), bias,
                                                          GENERATION_ONLY))
            return out
        routes: LayerRoutes = state["gguf_routes"]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        is_bf16 = x2.dtype == torch.bfloat16
        route = routes.pick(x2.shape[0], is_bf16, not generation_only)
        if x2.device.type != "cpu" and route is not Route.DENSE and Route.DENSE in routes.held:
            route = Route.DENSE
        led = not generation_only and x2.device.type == "cpu" and lead_rest(state, x2.shape[0], is_bf16) is route
        if led:
            out = self.run_lead(layer, x2, bias, state["gguf_lead"][0], route, routes.shape.is_head or unrounded)
        else:
            out = self.run_route(route, layer, x2, bias, routes.shape.is_head or unrounded)
        generation = rows.mixed_generation_rows(x2.shape[0]) if rows is not None else None
        if generation is not None and (led or route not in ROW_INDEPENDENT
                                       or routes.pick(len(generation), is_bf16, False) is not route):
            # a mixed pass: its decode/verify rows as a pass of only those rows computes them
            out.index_copy_(0, generation, self.apply(layer, x2.index_select(0, generation), bias, GENERATION_ONLY))
        return out.reshape(*shape[:-1], out.shape[-1])

    def routed_call(self, layer: nn.Module) -> PreparedCall | None:
        """The layer's rows of a generation-only pass at any count, as ``apply`` computes them (its
        prepared call where that reaches, else the route its table gives the row count), in the
        prepared-call form: the flat decode path past its prepared calls' reach (a 32-stream step).
        None for the LM head and a layer without a prepared call (then no flat path)."""
        decode = layer.__dict__.get("gguf_decode_args")
        routes: LayerRoutes | None = layer.__dict__.get("gguf_routes")
        if not isinstance(decode, PreparedCall) or routes is None or routes.shape.is_head:
            return None
        return PreparedCall.of((_generation_apply, layer, None, None, 0), decode.dtype, ROUTED_ROWS, 0, takes_bias=True)

    def run_route(self, route: Route, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None,
             float_out: bool) -> torch.Tensor:
        """Rows [M, K] on ``route``: bf16 rows come back rounded by the kernel (no torch op around it)
        unless a bias the kernel does not add (added after it, in float32) or a float32 output follows;
        float32 for ``float_out``."""
        weight: BlockWeight = layer.gguf_weight
        is_bf16 = x2.dtype == torch.bfloat16
        # the rows kernel and the int8 GEMM add a float32 or bf16 bias themselves, in float32 before their
        # rounding (as ``out + bias`` then ``.to`` below)
        kernel_bias = bias if route in KERNEL_BIAS_ROUTES and takes_kernel_bias(bias) else None
        bf16_out = is_bf16 and (bias is None or kernel_bias is not None) and not float_out
        if route in (Route.BLOCK, Route.TILES):
            kernel, codes, scales, offsets = self.block_call(weight, tiles=route is Route.TILES)
            out = kernel(x2.contiguous() if is_bf16 else x2.float().contiguous(), codes, scales, offsets,
                         weight.block, bf16_out)
        elif route in (Route.ROWS, Route.PACKED):   # float32 rows go in as bf16 (above the exact rows' rule)
            out = self.rows_kernel.rows_gemm(  # type: ignore[attr-defined]
                x2.to(torch.bfloat16).contiguous(), *rows_kernel_copy(layer, route), weight.block, bf16_out,
                weight.shape[0], kernel_bias)
        elif route is Route.AMX:
            out = self.rows_kernel.amx_gemm(  # type: ignore[attr-defined]
                x2.to(torch.bfloat16).contiguous(), *rows_kernel_copy(layer, route), weight.block, bf16_out,
                weight.shape[0], kernel_bias)
        elif route is Route.INT8:
            out = gguf_i8gemm.gemm(self.i8_kernel, x2.contiguous() if is_bf16 else x2.float().contiguous(),
                                   layer.gguf_i8, weight.block, bf16_out, weight.shape[0], bias=kernel_bias)
        else:   # in the dense copy's dtype: a bf16 model's activations meet a bf16 copy unconverted
            routes = layer.__dict__.get("gguf_routes")   # none on ``prepare_all``'s modules: one call
            out = dense_calls(x2.to(layer.gguf_dense.dtype).contiguous(), layer.gguf_dense,
                              0 if routes is None else routes.dense_rows)
        if bias is not None and kernel_bias is None:   # type promotion: float32 whenever either side is
            out = out + bias
        return out.float() if float_out else out.to(x2.dtype)

    def run_lead(self, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None, lead: int, rest: Route,
                 float_out: bool) -> torch.Tensor:
        """Prompt rows [M, K] of a merged layer whose first ``lead`` outputs (``I8_GEMM_LEAD``: the
        queries) take the int8 GEMM and the rest (K and V, which the cache keeps) ``rest``, the layer's
        own route for the call (one of ``gguf_lead``'s rests): the dense copy's rows, or the rows
        kernel's tiles after the lead's, which give those outputs the bits the whole layer's call gives
        them, or the block kernel's float tiles on the weight's rows after the lead (each output's floats
        are its own row's: those of the whole layer's call). Both parts are written into one result (the
        dense copy's dtype beside it, else bf16 rows stay bf16); the kernels add the bias in float32 before
        their rounding (the tiles' part as ``run_route`` adds it to their float32 result), the dense part as
        ``run_route``'s dense route does."""
        weight: BlockWeight = layer.gguf_weight
        is_bf16 = x2.dtype == torch.bfloat16
        if rest is Route.DENSE:
            dtype = layer.gguf_dense.dtype
        else:
            dtype = torch.bfloat16 if is_bf16 and not float_out else torch.float32
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=dtype)
        kernel_bias = bias if takes_kernel_bias(bias) else None
        gguf_i8gemm.gemm(self.i8_kernel, x2.contiguous() if is_bf16 else x2.float().contiguous(), layer.gguf_i8,
                         weight.block, dtype == torch.bfloat16, lead, out[:, :lead],
                         bias=None if kernel_bias is None else kernel_bias[:lead])
        if rest is Route.DENSE:
            out[:, lead:] = dense_linear(x2.to(dtype).contiguous(), layer.gguf_dense[lead:])
        elif rest is Route.TILES:   # the rest's rows of the weight (row-major: views); no bias of its own
            kernel, codes, scales, offsets = self.block_call(weight, tiles=True)
            part = kernel(x2.contiguous() if is_bf16 else x2.float().contiguous(), codes[lead:], scales[lead:],
                          None if offsets is None else offsets[lead:], weight.block,
                          dtype == torch.bfloat16 and kernel_bias is None)
            out[:, lead:] = part if kernel_bias is None else part + kernel_bias[lead:]
        else:
            tiles = lead // (self.rows_kernel.GEMM_COLS * 16)  # type: ignore[attr-defined]
            copy = [None if part is None else part[tiles:] for part in rows_kernel_copy(layer, rest)]
            out[:, lead:] = self.rows_kernel.rows_gemm(  # type: ignore[attr-defined]
                x2.to(torch.bfloat16).contiguous(), *copy, weight.block, dtype == torch.bfloat16,
                weight.shape[0] - lead, None if kernel_bias is None else kernel_bias[lead:])
        if bias is not None and (kernel_bias is None or rest is Route.DENSE):   # as ``out + bias``
            late = slice(0 if kernel_bias is None else lead, None)   # the outputs no kernel added it to
            out[:, late] += bias[late]
        return out.float() if float_out else out.to(x2.dtype)

    def block_call(self, weight: BlockWeight, tiles: bool = False) -> tuple[Callable[..., torch.Tensor], torch.Tensor,
                                                                          torch.Tensor, torch.Tensor | None]:
        """The block route's kernel function (``tiles``: the tiles route's) and what it reads: the packed
        codes where the weight has them (``process`` packed it), else the int8 codes; the compact scales
        and offsets where the kernel takes them, else the float32 ones."""
        scales, offsets = weight.with_compact() if self.compact_scales else (weight.scales, weight.offsets)
        if weight.packed is not None and self.packs:
            name = (_TILES_KERNELS[weight.packed.centered] if tiles
                    else _PACKED_KERNELS[self.activations, weight.packed.centered])
            return getattr(self.kernel, name), weight.packed.data, scales, offsets
        return getattr(self.kernel, _KERNELS["float" if tiles else self.activations]), weight.codes, scales, offsets

    def _decode_args(self, layer: nn.Module, routes: LayerRoutes, model_dtype: torch.dtype) -> tuple[object, ...]:
        """The kernel and its weight arguments of the layer's 1-row generation route for rows in
        ``model_dtype`` where that is a kernel taking them (a ``PreparedCall``: the block kernel, or
        the rows kernel for bf16 rows), else (); never the LM head (float32 logits go through apply)."""
        weight: BlockWeight = layer.gguf_weight
        x_bf16 = model_dtype == torch.bfloat16
        if not x_bf16 and model_dtype != torch.float32:
            return ()
        route = routes.pick(1, x_bf16, False)
        if routes.shape.is_head or route not in ROW_INDEPENDENT or (route is not Route.BLOCK and not x_bf16):
            return ()
        if route in ROWS_KERNEL_ROUTES:   # either copy, by row count: one prepared call reaches both
            generation = routes.same_route_rows(x_bf16, False, ROWS_KERNEL_ROUTES)
            # a prompt pass through it takes the generation rows' copy: only where the prompt's route is that one
            prompt = next((m - 1 for m in range(1, generation + 1)
                           if routes.pick(m, x_bf16, True) is not routes.pick(m, x_bf16, False)), generation)
            reach = (generation, prompt)
            copies = {candidate: rows_kernel_copy(layer, candidate)
                      for candidate in ROWS_KERNEL_ROUTES if candidate in routes.held}
            tile_outputs = self.rows_kernel.GEMM_COLS * 16  # type: ignore[attr-defined]
            if any(weight.shape[0] != copy[0].shape[0] * tile_outputs for copy in copies.values()):
                return ()   # padded outputs: via apply (any packed form)
            gemm = self.rows_kernel.rows_call  # type: ignore[attr-defined]
            codes, scales, offsets = copies[route]
            if len(copies) > 1:
                by_rows = tuple(copies[routes.pick(m, x_bf16, False)] for m in range(1, max(reach) + 1))
                gemm = RowsCopies(gemm, by_rows)
            return PreparedCall.of((gemm, codes, scales, offsets, weight.block), model_dtype, *reach, takes_bias=True)
        reach = (routes.same_route_rows(x_bf16, prompt_too=False), routes.same_route_rows(x_bf16, prompt_too=True))
        kernel, codes, scales, offsets = self.block_call(weight)
        return PreparedCall.of((kernel, codes, scales, offsets, weight.block), model_dtype, *reach, takes_bias=True)


ROUTED_ROWS = 1 << 20
"""How many rows a ``routed_call`` reaches (any: its route is picked per call)."""


def dense_calls(x: torch.Tensor, weight: torch.Tensor, call_rows: int) -> torch.Tensor:
    """``dense_linear(x, weight)``, in even calls of at most ``call_rows`` rows where x has more (0: one
    call). oneDNN's bf16 GEMM on AMX ran a 1,019 x 2,048 x 640 product at half the rate of two calls of
    ~510 rows (benchmarks/RESULTS.md, session 46). A row's result may differ in its last bits, as between
    any two row counts of oneDNN's GEMM (the dense route is not ``ROW_INDEPENDENT``)."""
    rows = x.shape[0]
    if not call_rows or rows <= call_rows:
        return dense_linear(x, weight)
    calls = -(-rows // call_rows)
    step = -(-rows // calls)
    out = torch.empty(rows, weight.shape[0], dtype=torch.promote_types(x.dtype, weight.dtype))
    for start in range(0, rows, step):
        out[start:start + step] = dense_linear(x[start:start + step], weight)
    return out


def _generation_apply(x: torch.Tensor, layer: nn.Module, _scales: None, _offsets: None, _block: int,
                      _round_out: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``routed_call``'s kernel: ``apply`` on a generation-only pass (it rounds, or not, by the layer's
    own ``float_residual_output``, as the module path does; the flat path's ``round_out`` says the same)."""
    method: GGUFBlockLinearMethod = layer.__dict__["linear_method"]
    return method.apply(layer, x, bias, GENERATION_ONLY)


def held_bytes(layer: nn.Module, weight: BlockWeight) -> int:
    """Bytes ``layer`` holds for ``weight``: its blocks (packed and compact forms included) and the
    copies its routes read (``process``, ``prepare_all``)."""
    stored = [layer.gguf_dense, *(layer.gguf_packed or ()), *(layer.gguf_bits or ()), *(layer.gguf_i8 or ())]
    return weight.nbytes + sum(t.numel() * t.element_size() for t in stored if t is not None)


class BlockRows:
    """Embedding lookup from a BlockWeight: dequantizes only the looked-up rows."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` rows in the dtype of the float weight they replace."""
        w = self.weight
        ids = input_ids.reshape(-1)
        packed = w.packed
        if w.stored_codes is None and packed is not None:   # one native call (the same floats), where built
            rows = fused.packed_rows(packed.data, packed.bits, packed.centered, ids, w.scales, w.offsets, w.block)
            if rows is not None:
                return rows.reshape(*input_ids.shape, -1).to(self.dtype)
        codes = w.row_codes(ids)
        values = codes.view(len(ids), -1, w.block).float().mul_(w.scales[ids][..., None])
        if w.offsets is not None:
            values.add_(w.offsets[ids][..., None])
        return values.reshape(*input_ids.shape, -1).to(self.dtype)
