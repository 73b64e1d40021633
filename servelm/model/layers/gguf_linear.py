"""Linear layers, LM head and embedding that run GGUF weights in the blocks the file stores.

``GGUFBlockLinearMethod`` holds a ``BlockWeight`` (int8 codes + a float scale, and an offset for
some types, per 16 or 32 inputs; the lossless repack of gguf_blocks.py) and computes:

- M <= ``KERNEL_MAX_ROWS`` rows: the AVX-512 kernel (gguf_kernel.cpp) with VNNI integer dot
  products. ``activations="int16"`` (``--quantization gguf``, the default for GGUF files):
  activations rounded to 16 bits per 32 inputs and split into two int8 halves (2e-5 relative
  error per layer on random data: the float32 dequantized layer's results to 4-5 digits; ~1.25x
  the time of the int8 mode, 0.3-0.6x float32 at M=1). ``activations="int8"``
  (``--quantization gguf_a8``): activations rounded to int8 per 32 inputs as llama.cpp does
  (llama.cpp's arithmetic: 5e-3 relative error; 0.3-0.45x float32 at M=1). ``float`` (codes
  converted to float in registers, unrounded activations) is kept as the exactness reference.
- more rows (batched decode, prefill): a dense GEMM on a copy of
  the weight dequantized once at load to bfloat16 (where the CPU has a native bf16 GEMM, else
  float32): oneDNN's GEMM is 1.6-4x faster than the kernels at M=32 and 2-3x at M=1024. The copy
  costs memory (2 bytes per weight in bf16, on top of the ~1.1 of the blocks); dequantizing per
  call instead cost 40% of a 32-stream server's throughput.
- a bf16 model on a CPU with AVX512-BF16, ``ROWS_KERNEL_ROWS``: the rows kernel's GEMM
  (gguf_rows.cpp ``rows_gemm``) for layers at 1-48 rows and the LM head at every M, on a copy of
  the codes packed at load in VNNI order (1 byte per weight): vdpbf16ps on 8 rows x 32 outputs of
  accumulators, the scales applied in float32 once per block (the weight exactly code x scale, the
  activations unrounded); 0.33-0.85 of the dense copy's time up to 48 rows. The head keeps no dense
  copy then, and a layer's prepared decode call is this GEMM (``decode_rows``).
- the int8 GEMM (gguf_i8gemm.cpp, AVX512-VNNI; ``I8_GEMM_FIRST_ROW``): activations rounded to int8
  per block as llama.cpp does and ``vpdpbusd`` on a copy of the codes packed at load (1 byte per
  weight), for a layer's prompt rows from 49 on (prefill chunks; decode, verify and the LM head keep
  the rows kernel at any batch size: ``prompt_rows``): 0.57 of the rows kernel's time and 0.65 of the dense bf16 copy's at 512 rows. Where the rows kernel takes 1-48
  rows the layers then keep no dense copy, but for the KV-cached projections (``I8_GEMM_SKIPPED``);
  a float32 model's rows above the VNNI kernel's limit then take the rows kernel as bf16 (its prompt
  rows from 49 on the int8 GEMM). In a mixed pass whose row count takes a path fewer rows would not
  (the int8 GEMM, a dense copy, a float32 model's rows kernel) the generation rows are computed again
  as a pass of only them computes them (their count decides), for bf16 and float32 rows alike: a
  stream's results do not depend on the prompt chunk sharing its step (~1-3% of a mixed pass's GEMM
  time, the KV projections' generation rows computed twice).
  Not with ``float`` activations (the exact mode).
- no kernel (CPU without AVX512-VNNI, no compiler; only with an explicit ``--quantization gguf``,
  ``auto`` then dequantizes the file instead): every call takes the dense copy.

Invariants: after ``process`` the layer's only float weight is that dense copy (none on a head
routed to the GEMM at every M, none where the int8 GEMM is built); ``apply`` returns
x's dtype, except on a layer marked ``gguf_float_output`` (the LM head): float32, so the kernel's
logits are not rounded to a bf16 model's dtype (rounded, they tie and flip greedy choices: 62%
instead of 88% identical outputs on Qwen2.5-Coder 0.5B).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from servelm.model.layers import gguf_i8gemm
from servelm.model.layers.gguf_blocks import BlockWeight
from servelm.model.layers.gguf_rows import pack
from servelm.model.layers.linear import dense_linear

KERNEL_MAX_ROWS = {"int16": 16, "int8": 32, "float": 16}
"""Rows up to which the kernel runs, per activation mode; above, the dense copy's GEMM
(benchmarks/gguf_kernels.py, 1 thread: at M=8 every kernel beats dequantize-to-bf16 2-3x; at M=32
the int8 kernel (0.4-0.5x float32) is level with it and the int16 (0.6-1.1x) and float (0.65-0.9x)
ones behind; at M=1024 the bf16 GEMM takes 0.2-0.27x float32). The LM head too."""

BF16_KERNEL_MAX_ROWS = {"int16": 4, "int8": 6, "float": 4}
"""Rows up to which the kernel runs when the activations are bf16 and the dense copy is bf16 (a bf16
model on a CPU with a native bf16 GEMM); above, the dense copy. The kernel's time grows with M
while oneDNN's bf16 GEMM barely moves up to M=32 (benchmarks/gguf_rows.py, Gemma 3 270M's four
decoder shapes, 1 thread, conversions included: int16 kernel / dense = 0.6 at M=2, 0.86-0.97 at 4,
1.2 at 6, 1.4-1.6 at 8, 2.0 at 16; int8: 0.93 at 6, 1.12 at 8). A float32 model keeps
``KERNEL_MAX_ROWS``: its rows would be rounded to bf16 on the dense copy, and its greedy tokens stay
those of earlier releases. Layers with ``gguf_float_output`` (the LM head) keep it too."""

ROWS_KERNEL_ROWS: dict[str, tuple[int, int | None]] = {"layers": (1, 48), "head": (1, None)}
"""Rows (first, last; None: no limit) for which a bf16 model's layers and LM head
(``gguf_float_output``) run the rows kernel's GEMM (``rows_gemm`` of gguf_rows.cpp, on the copy
packed at load) when it is built; outside, the paths above. From benchmarks/gguf_rows.py (Gemma 3
270M's shapes, 1 thread, thread clock, interleaved medians, noisy shared machine; benchmarks/RESULTS.md
"A GEMM micro-kernel for 1-48 rows"): the four decoder shapes together take 0.72 of the int16 VNNI
kernel's time at M=1, 0.44 at 4 and 0.31-0.36 from 5 rows on; against the dense bf16 copy (oneDNN)
0.33 at M=1, 0.52 at 8, 0.69 at 16, 0.84 at 32, 0.85 at 48, 0.96 at 64 and 1.06 at 128, so layers up to
48 rows (prefill chunks above take oneDNN). The head: 0.8 of the int16 kernel at M=1, 0.3-0.45 from
6 rows; 0.24 of the dense copy at M=1, 0.44 at 16, 0.73 at 32, 0.78 at 64 and 0.86 at 128: every row
count, so the head keeps no dense copy (``process``). A layer's prepared decode call is this GEMM
too (``decode_rows``), so Gemma 3's flat decode path (gemma3_decode.py) takes up to 48 rows."""
I8_GEMM_FIRST_ROW = 49
"""Rows from which a layer's prompt rows run the int8 x int8 GEMM (gguf_i8gemm.cpp, activations
rounded to int8 per block: llama.cpp's arithmetic) where it is built, bf16 and float32 rows alike.
From benchmarks/gguf_rows.py (Gemma 3 270M's shapes, 1 thread, thread clock, noisy shared machine;
benchmarks/RESULTS.md "An int8 GEMM for prefill"): the four decoder shapes take
0.57 of rows_gemm's time at 512 rows and 0.65 of the dense bf16 copy (oneDNN). It also beats rows_gemm
at 1-48 rows (0.6-0.8) and on the LM head (0.8 from 16 rows), but int8 activations on generation rows
cost quality: on every decode row 50-62% of the greedy outputs stay identical to float32
(``--quantization gguf_a8``, RESULTS.md), on the head's rows alone 75% at 32 streams against 88%, both
at or under issue 16's 75%. So decode, verify and the head keep the rows kernel at every batch size
(``prompt_rows``), and only prompt rows (prefill chunks above 48 rows) round to int8."""
I8_GEMM_SKIPPED = ("qkv_proj", "k_proj", "v_proj")
"""Layers (by their module name's last part) that never take the int8 GEMM: the projections whose
results the KV cache keeps. Their prefill rows, rounded to int8, reach every later token's
attention; off the int8 GEMM (their dense bf16 copy in prefill) Gemma 3 keeps 88% of
benchmarks/quant_quality.py's greedy outputs identical to float32 instead of 75% (Qwen2.5-Coder
0.5B: see RESULTS.md), for ~0.9 ms of 1 thread per 512-row chunk and layer."""
DECODE_ROWS = 4
"""Rows up to which a layer whose prepared decode call (``_decode_args``) is the VNNI kernel (a bf16
model without the rows kernel) takes that call: the least of the row limits above. A bf16 layer
without bias called with that few rows (decode) goes straight to the kernel with arguments prepared
once, as a decode step makes 72 such calls. Where the rows kernel is built the call is its GEMM, up to
``ROWS_KERNEL_ROWS["layers"]``'s last row (``decode_rows``)."""


def _is_rows_gemm(call: tuple[object, ...]) -> bool:
    """Whether a layer's prepared decode call (``_decode_args``) is the rows kernel's GEMM (else the
    VNNI kernel)."""
    return getattr(call[0], "__name__", "") == "rows_gemm"


def decode_rows(call: tuple[object, ...]) -> int:
    """Most rows a layer's prepared decode call (``gguf_decode_args``) takes: the rows kernel's GEMM
    as many as ``ROWS_KERNEL_ROWS["layers"]`` gives it, the VNNI kernel ``DECODE_ROWS``."""
    return (ROWS_KERNEL_ROWS["layers"][1] or 0) if _is_rows_gemm(call) else DECODE_ROWS


def decode_takes_bias(call: tuple[object, ...]) -> bool:
    """Whether a layer's prepared decode call takes a bias as its last argument (the VNNI kernel
    does, for one row; the rows kernel's GEMM does not: a biased layer goes through ``apply``)."""
    return not _is_rows_gemm(call)


class _RowScope(threading.local):
    """Which rows of the forward pass running on this thread may take the int8 GEMM (``prompt_rows``);
    per thread, as two engines in one process (tests, a draft model) may run passes side by side."""

    generation_only = False
    """Every row is a generation row: none takes the int8 GEMM."""
    generation_rows: torch.Tensor | None = None
    """The generation rows' indices when the pass mixes them with prompt rows, else None."""
    num_rows = 0
    """Rows of that mixed pass: a call with as many computes its every row (the LM head's scope counts
    the pass's logit rows: model/runner.py)."""


_SCOPE = _RowScope()


@contextmanager
def prompt_rows(row_counts: list[int], generation: list[bool]) -> Iterator[None]:
    """While a forward pass runs: only its prompt rows may take the int8 GEMM.

    ``row_counts[i]`` rows of the pass belong to sequence i, a generation sequence where
    ``generation[i]`` (a decode step, a speculative verify, prompt logprobs: rows whose own logits are
    read). Generation rows keep unrounded bf16 activations at every batch size (the rows kernel), so
    that a stream's tokens do not depend on how many others share its step: with int8 activations on
    every decode row Gemma 3 keeps 62% of quant_quality's outputs identical at 64 streams, 88% without.
    In a mixed pass they come out as a pass of only them computes them (``apply``). Outside this
    scope (a layer called directly) the row count alone decides."""
    previous = (_SCOPE.generation_only, _SCOPE.generation_rows, _SCOPE.num_rows)
    _SCOPE.num_rows = sum(row_counts)
    if all(generation):
        _SCOPE.generation_only, _SCOPE.generation_rows = True, None
    elif any(generation):
        starts = [0]
        for count in row_counts[:-1]:
            starts.append(starts[-1] + count)
        index = [row for start, count, is_generation in zip(starts, row_counts, generation) if is_generation
                 for row in range(start, start + count)]
        _SCOPE.generation_only, _SCOPE.generation_rows = False, torch.tensor(index, dtype=torch.long)
    else:
        _SCOPE.generation_only, _SCOPE.generation_rows = False, None
    try:
        yield
    finally:
        _SCOPE.generation_only, _SCOPE.generation_rows, _SCOPE.num_rows = previous


def _mixed_generation_rows(num_rows: int) -> torch.Tensor | None:
    """The generation rows' indices where a call computes every row of a mixed pass (the LM head's
    scope counts the logit rows), else None."""
    generation = _SCOPE.generation_rows
    return generation if generation is not None and num_rows == _SCOPE.num_rows else None


ACTIVATION_MODES = ("int16", "int8", "float")
_KERNELS = {"int16": "block_linear_a16", "int8": "block_linear", "float": "block_linear_float"}


class GGUFBlockLinearMethod:
    """Computes ``x @ W.T`` from a ``BlockWeight`` (see the module docstring)."""

    name = "gguf"

    def __init__(self, kernel: object | None, dense_dtype: torch.dtype, activations: str = "int16",
                 rows_kernel: object | None = None, i8_kernel: object | None = None) -> None:
        assert activations in ACTIVATION_MODES, activations
        self.kernel = kernel
        self.rows_kernel = rows_kernel
        """The AVX512-BF16 rows kernel (gguf_rows.py's module), or None: used on bf16 rows only
        (``ROWS_KERNEL_ROWS``)."""
        self.i8_kernel = i8_kernel if activations != "float" else None
        """The int8 GEMM (gguf_i8gemm.py's module), or None: prompt rows from ``I8_GEMM_FIRST_ROW`` on, never
        generation rows. Not with ``float`` activations (the exact mode)."""
        self.dense_dtype = dense_dtype
        """Dtype of the dequantized weight on the large-M path (bf16 with a native bf16 GEMM)."""
        self.activations = activations
        """How the kernel takes activations: ``int16`` rounds them to 16 bits per 32 inputs (two int8
        halves, VNNI; 2e-5 relative error), ``int8`` to 8 bits as llama.cpp does (VNNI; 5e-3),
        ``float`` multiplies them unrounded (codes converted in registers; slowest)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("GGUF block layers are made from loaded layers by apply_gguf_blocks")

    def process(self, layer: nn.Module, weight: BlockWeight, float_output: bool = False,
                int8_rows: bool = True) -> int:
        """Give ``layer`` its block weight in place of the float one; returns the bytes stored.
        ``float_output``: the LM head (float32 logits, ``gguf_float_output``). ``int8_rows``: whether
        the layer may take the int8 GEMM (``I8_GEMM_SKIPPED``)."""
        layer.gguf_weight = weight
        if float_output:
            layer.gguf_float_output = True
        layer.gguf_uses_kernel = self.kernel is not None and weight.codes.shape[1] % 64 == 0
        layer.gguf_uses_rows_kernel = (self.rows_kernel is not None and self.dense_dtype == torch.bfloat16
                                       and weight.codes.shape[1] % 64 == 0)
        layer.gguf_kernel_max_rows = KERNEL_MAX_ROWS[self.activations]
        # the rows kernel's GEMM reads the codes packed in its own order (1 byte per weight)
        layer.gguf_packed = (pack(weight.codes, weight.scales, weight.offsets,
                                  self.rows_kernel.GEMM_COLS)  # type: ignore[attr-defined]
                             if layer.gguf_uses_rows_kernel else None)
        layer.gguf_decode_args = self._decode_args(layer)
        # the int8 GEMM reads its own copy (codes + 128, 1 byte per weight, scales tiled)
        # (never the LM head: its rows are generation rows, ``I8_GEMM_FIRST_ROW``)
        layer.gguf_i8 = (gguf_i8gemm.pack(weight) if int8_rows and not float_output and self.i8_kernel is not None
                         and weight.block in (16, 32) else None)
        # Batched decode and prefill rows run a dense GEMM on a copy dequantized once: dequantizing
        # per call cost 40% of a 32-stream server's throughput (benchmarks/RESULTS.md), and at
        # M=32 the kernel takes 1.7x a bf16 GEMM even on the LM head. A head whose every row count
        # from ROWS_KERNEL_ROWS's first on takes the rows kernel (below it, the VNNI kernel) keeps none.
        first, last = ROWS_KERNEL_ROWS["head"]
        needs_dense = not (float_output and layer.gguf_uses_rows_kernel and last is None
                           and layer.gguf_uses_kernel and first <= layer.gguf_kernel_max_rows + 1)
        # A layer with the rows kernel (bf16 rows at any count but prompt rows from 49 on, which take
        # the int8 GEMM) needs no dense copy: a float32 model's rows above the VNNI kernel's limit
        # that are not such prompt rows go through the rows kernel as bf16 (apply), as a bf16 dense
        # copy would take them. Without the rows kernel (a CPU without AVX512-BF16: a float32 dense
        # copy) the copy stays for those rows, unrounded.
        needs_dense = needs_dense and not (layer.gguf_i8 is not None and layer.gguf_uses_rows_kernel)
        layer.gguf_dense = weight.dequantize(dtype=self.dense_dtype) if needs_dense else None
        if getattr(layer, "weight", None) is not None:
            del layer.weight
            layer.register_parameter("weight", None)
        layer.linear_method = self
        stored = [layer.gguf_dense] + list(layer.gguf_packed or ()) + list(layer.gguf_i8 or ())
        return weight.nbytes + sum(t.numel() * t.element_size() for t in stored if t is not None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype; in float32, unrounded, for the LM head and a layer whose
        output joins a float32 residual stream (``float_residual_output``)."""
        state = layer.__dict__   # plain attributes: no nn.Module lookup on the decode path
        decode = state.get("gguf_decode_args")
        unrounded = state.get("float_residual_output", False)
        if (decode and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= decode_rows(decode)
                and (bias is None or x.shape[0] == 1 and decode_takes_bias(decode))
                and x.is_contiguous() and x.device.type == "cpu" and not state.get("gguf_float_output", False)):
            kernel, codes, scales, offsets, block = decode
            if bias is None:   # rounded to bf16 by the kernel, or float32
                return kernel(x, codes, scales, offsets, block, not unrounded)
            # one row of a biased layer on the VNNI kernel: the bias added in float32 before the bf16
            # rounding, as the routing below does it
            return kernel(x, codes, scales, offsets, block, not unrounded, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight: BlockWeight = layer.gguf_weight
        is_head = getattr(layer, "gguf_float_output", False)
        float_out = is_head or unrounded
        i8 = state.get("gguf_i8")
        int8_allowed = i8 is not None and not _SCOPE.generation_only
        if int8_allowed and x2.shape[0] >= I8_GEMM_FIRST_ROW:
            out = self._i8_gemm(layer, x2, bias, float_out)
            generation = _mixed_generation_rows(x2.shape[0])
            if generation is not None:
                # a mixed pass: its decode/verify rows as a pass of only those rows computes them
                out.index_copy_(0, generation, self._generation_pass(layer, x2.index_select(0, generation), bias))
            return out.reshape(*shape[:-1], out.shape[-1])
        if (layer.gguf_uses_rows_kernel and x2.dtype == torch.bfloat16 and x2.device.type == "cpu"
                and (self._rows_kernel_takes(x2.shape[0], is_head) or (i8 is not None and layer.gguf_dense is None))):
            # generation rows above the rows kernel's routing on a layer whose only other copy is
            # the int8 one take the rows kernel too (it computes any row count)
            out = self._rows_gemm(layer, x2, bias, float_out)
            return out.reshape(*shape[:-1], out.shape[-1])
        max_rows = layer.gguf_kernel_max_rows
        by_count = True   # whether fewer rows could take another kernel (the dense copy's paths)
        if x2.dtype == torch.bfloat16 and self.dense_dtype == torch.bfloat16 and not is_head:
            max_rows = BF16_KERNEL_MAX_ROWS[self.activations]
        if layer.gguf_uses_kernel and x2.shape[0] <= max_rows and x2.device.type == "cpu":
            kernel = getattr(self.kernel, _KERNELS[self.activations])
            # bf16 rows go in as they are and come back rounded by the kernel (no torch op around it)
            # unless a bias (added in float32) or a float32 output (the LM head) follows
            is_bf16 = x2.dtype == torch.bfloat16
            out = kernel(x2.contiguous() if is_bf16 else x2.float().contiguous(), weight.codes, weight.scales,
                         weight.offsets, weight.block, is_bf16 and bias is None and not float_out)
            by_count = False   # fewer rows take it too
        elif layer.gguf_dense is None:
            # a head or a layer without a dense copy (process): rows the routing above did not take
            # (float32 rows above the VNNI kernel's limit: a float32 model's batched decode, its prompt
            # chunks under I8_GEMM_FIRST_ROW) go through the rows kernel as bf16, as the dense bf16
            # copy would take them; never the int8 GEMM, as a bf16 model's generation rows
            codes, scales, offsets = layer.gguf_packed
            out = self.rows_kernel.rows_gemm(  # type: ignore[attr-defined]
                x2.to(torch.bfloat16).contiguous(), codes, scales, offsets, weight.block, False,
                weight.codes.shape[0])
        else:
            # in the dense copy's dtype: a bf16 model's activations meet a bf16 copy unconverted
            out = dense_linear(x2.to(layer.gguf_dense.dtype).contiguous(), layer.gguf_dense)
        if bias is not None:   # type promotion: float32 whenever either side is
            out = out + bias
        out = out.float() if float_out else out.to(x.dtype)
        generation = _mixed_generation_rows(x2.shape[0]) if by_count else None
        if generation is not None:
            # a mixed pass above the VNNI kernel's or the rows kernel's rows (a KV projection's dense
            # copy, a float32 model's rows): its decode/verify rows as a pass of only them computes them
            out.index_copy_(0, generation, self._generation_pass(layer, x2.index_select(0, generation), bias))
        return out.reshape(*shape[:-1], out.shape[-1])

    def _generation_pass(self, layer: nn.Module, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``apply`` on a mixed pass's generation rows [G, K] routed as a pass of only those rows routes
        them (G decides: a bf16 model's rows kernel; a float32 model's VNNI kernel up to its limit, above
        it the dense copy or, without one, the rows kernel), so that a stream's results do not depend on
        the prompt rows that share its pass."""
        with prompt_rows([rows.shape[0]], [True]):
            return self.apply(layer, rows, bias)

    def _rows_gemm(self, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None,
                   float_out: bool) -> torch.Tensor:
        """``apply`` on the rows kernel for bf16 rows [M, K]: float32 out where ``float_out`` (the head's
        logits, a float32 residual stream's update) or before a bias, else bf16 rounded by the kernel."""
        codes, scales, offsets = layer.gguf_packed
        out = self.rows_kernel.rows_gemm(  # type: ignore[attr-defined]
            x2.contiguous(), codes, scales, offsets, layer.gguf_weight.block, bias is None and not float_out,
            layer.gguf_weight.codes.shape[0])
        if bias is not None:
            out = out + bias
        return out.float() if float_out else out.to(x2.dtype)

    def _i8_gemm(self, layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None,
                 float_out: bool) -> torch.Tensor:
        """``apply`` on the int8 GEMM for rows [M, K]: bf16 out for bf16 rows (rounded by the kernel)
        unless a bias (added in float32) or ``float_out`` (as ``_rows_gemm``)."""
        codes, scales, offsets = layer.gguf_i8
        weight: BlockWeight = layer.gguf_weight
        is_bf16 = x2.dtype == torch.bfloat16
        out = self.i8_kernel.i8_gemm(  # type: ignore[attr-defined]
            x2.contiguous() if is_bf16 else x2.float().contiguous(), codes, scales, offsets, weight.block,
            is_bf16 and bias is None and not float_out, weight.codes.shape[0])
        if bias is not None:
            out = out + bias
        return out.float() if float_out else out.to(x2.dtype)

    @staticmethod
    def _rows_kernel_takes(rows: int, is_head: bool) -> bool:
        first, last = ROWS_KERNEL_ROWS["head" if is_head else "layers"]
        return first <= rows and (last is None or rows <= last)


    def _decode_args(self, layer: nn.Module) -> tuple[object, ...]:
        """The kernel and its weight arguments for ``apply``'s decode call, or () where the layer
        has no kernel."""
        weight: BlockWeight = layer.gguf_weight
        rows_gemm = getattr(self.rows_kernel, "rows_gemm", None)
        if layer.gguf_packed is not None and rows_gemm is not None and weight.codes.shape[0] == (
                layer.gguf_packed[0].shape[0] * layer.gguf_packed[0].shape[2] * 16):   # no padded outputs
            codes, scales, offsets = layer.gguf_packed
            return (rows_gemm, codes, scales, offsets, weight.block)
        if not layer.gguf_uses_kernel:
            return ()
        return (getattr(self.kernel, _KERNELS[self.activations]), weight.codes, weight.scales, weight.offsets,
                weight.block)


class BlockRows:
    """Embedding lookup from a BlockWeight: dequantizes only the looked-up rows."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` rows in the dtype of the float weight they replace."""
        w = self.weight
        ids = input_ids.reshape(-1)
        codes = w.codes[ids]
        values = codes.view(len(ids), -1, w.block).float().mul_(w.scales[ids][..., None])
        if w.offsets is not None:
            values.add_(w.offsets[ids][..., None])
        return values.reshape(*input_ids.shape, -1).to(self.dtype)
