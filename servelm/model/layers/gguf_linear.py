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
- a bf16 model on a CPU with AVX512-BF16, ``ROWS_KERNEL_ROWS``: the rows kernel (gguf_rows.cpp)
  for a few rows (batched decode, speculative verify, the LM head at M > 2): each weight's codes
  widened to bf16 once per call and multiplied with every row by vdpbf16ps, the scales applied in
  float32 (the weight exactly code x scale, the activations unrounded); about 1.1 bytes read per
  weight instead of the dense copy's 2; its cost grows slowly up to 4 rows, then linearly
  (compute-bound: one vdpbf16ps per 32 multiply-adds as oneDNN, plus the scale FMAs).
- no kernel (CPU without AVX512-VNNI, no compiler; only with an explicit ``--quantization gguf``,
  ``auto`` then dequantizes the file instead): every call takes the dense copy.

Invariants: after ``process`` the layer's only float weight is that dense copy; ``apply`` returns
x's dtype, except on a layer marked ``gguf_float_output`` (the LM head): float32, so the kernel's
logits are not rounded to a bf16 model's dtype (rounded, they tie and flip greedy choices: 62%
instead of 88% identical outputs on Qwen2.5-Coder 0.5B).
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.model.layers.gguf_blocks import BlockWeight
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

ROWS_KERNEL_ROWS = {"layers": (2, 8), "head": (3, 16)}
"""Rows (first, last) for which a bf16 model's layers and LM head (``gguf_float_output``) run the
rows kernel (gguf_rows.cpp) when it is built; outside, the paths above. From benchmarks/gguf_rows.py
(Gemma 3 270M's shapes, 1 thread, thread clock, interleaved medians, noisy shared machine;
benchmarks/RESULTS.md): the four decoder shapes together take 0.60 of the dense copy's time at M=2,
0.78 at 4, 0.92 at 6, 0.88 at 8 and 1.13 at 16, so layers from 2 to 8 rows (the int16 kernel takes
0.95 of the rows kernel's time at 2 and 1.2-1.45 from 4 to 8; M=1 stays its own: 0.9). The head: 0.31
of the dense copy at 2 rows, 0.5 at 6, 0.71 at 8, 1.29 at 16, and 0.55-0.9 of the int16 kernel (the
head's path up to 16 rows: float32 logits, which the dense copy cannot give) at every M up to 16;
it starts at 3 rows because greedy steps of 1 or 2 rows take the LM-head screen (lm_head_screen.py),
whose candidate logits are the int16 kernel's, and a screened row that falls back takes the full
head at the same M. (In a step of 3 or more rows of which at most 2 are screened, the screened rows'
tokens are the int16 kernel's argmax and the rest come from this kernel: the two differ only where
two logits are within the int16 kernel's 2e-5 relative rounding.)"""
DECODE_ROWS = 4
"""Rows up to which every mode runs the kernel whatever the dense copy's dtype (the least of the row
limits above): a bf16 layer without bias called with that few rows (decode) goes straight to the
kernel with arguments prepared once (``_decode_args``), as a decode step makes 72 such calls. This
path comes before ``ROWS_KERNEL_ROWS``: a bias-free bf16 decoder layer meets the rows kernel from 5
rows on, a layer with a bias (Qwen's QKV) from 2."""

ACTIVATION_MODES = ("int16", "int8", "float")
_KERNELS = {"int16": "block_linear_a16", "int8": "block_linear", "float": "block_linear_float"}


class GGUFBlockLinearMethod:
    """Computes ``x @ W.T`` from a ``BlockWeight`` (see the module docstring)."""

    name = "gguf"

    def __init__(self, kernel: object | None, dense_dtype: torch.dtype, activations: str = "int16",
                 rows_kernel: object | None = None) -> None:
        assert activations in ACTIVATION_MODES, activations
        self.kernel = kernel
        self.rows_kernel = rows_kernel
        """The AVX512-BF16 rows kernel (gguf_rows.py's module), or None: used on bf16 rows only
        (``ROWS_KERNEL_ROWS``)."""
        self.dense_dtype = dense_dtype
        """Dtype of the dequantized weight on the large-M path (bf16 with a native bf16 GEMM)."""
        self.activations = activations
        """How the kernel takes activations: ``int16`` rounds them to 16 bits per 32 inputs (two int8
        halves, VNNI; 2e-5 relative error), ``int8`` to 8 bits as llama.cpp does (VNNI; 5e-3),
        ``float`` multiplies them unrounded (codes converted in registers; slowest)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("GGUF block layers are made from loaded layers by apply_gguf_blocks")

    def process(self, layer: nn.Module, weight: BlockWeight) -> int:
        """Give ``layer`` its block weight in place of the float one; returns the bytes stored."""
        layer.gguf_weight = weight
        layer.gguf_uses_kernel = self.kernel is not None and weight.codes.shape[1] % 64 == 0
        layer.gguf_uses_rows_kernel = (self.rows_kernel is not None and self.dense_dtype == torch.bfloat16
                                       and weight.codes.shape[1] % 64 == 0)
        layer.gguf_decode_args = self._decode_args(layer)
        layer.gguf_kernel_max_rows = KERNEL_MAX_ROWS[self.activations]
        # Batched decode and prefill rows run a dense GEMM on a copy dequantized once: dequantizing
        # per call cost 40% of a 32-stream server's throughput (benchmarks/RESULTS.md), and at
        # M=32 the kernel takes 1.7x a bf16 GEMM even on the LM head.
        layer.gguf_dense = weight.dequantize(dtype=self.dense_dtype)
        if getattr(layer, "weight", None) is not None:
            del layer.weight
            layer.register_parameter("weight", None)
        layer.linear_method = self
        dense = layer.gguf_dense
        return weight.nbytes + (dense.numel() * dense.element_size() if dense is not None else 0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        state = layer.__dict__   # plain attributes: no nn.Module lookup on the decode path
        decode = state.get("gguf_decode_args")
        if (decode and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= DECODE_ROWS
                and (bias is None or x.shape[0] == 1) and x.is_contiguous() and x.device.type == "cpu" and not state.get("gguf_float_output", False)):
            kernel, codes, scales, offsets, block = decode
            # rounded to bf16 by the kernel, after the bias (one row of a biased layer: the kernel the
            # routing below gives it, with the bias added in float32 before the rounding as below)
            return kernel(x, codes, scales, offsets, block, True, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight: BlockWeight = layer.gguf_weight
        is_head = getattr(layer, "gguf_float_output", False)
        if (layer.gguf_uses_rows_kernel and x2.dtype == torch.bfloat16 and x2.device.type == "cpu"
                and self._rows_kernel_takes(x2.shape[0], is_head)):
            # float32 out for the head (logits never rounded to bf16) or before a bias
            rows_linear = self.rows_kernel.rows_linear  # type: ignore[attr-defined]
            out = rows_linear(x2.contiguous(), weight.codes, weight.scales, weight.offsets, weight.block,
                              bias is None and not is_head)
            if bias is not None:
                out = out + bias
            out = out.float() if is_head else out.to(x.dtype)
            return out.reshape(*shape[:-1], out.shape[-1])
        max_rows = layer.gguf_kernel_max_rows
        if (x2.dtype == torch.bfloat16 and self.dense_dtype == torch.bfloat16
                and not getattr(layer, "gguf_float_output", False)):
            max_rows = BF16_KERNEL_MAX_ROWS[self.activations]
        if layer.gguf_uses_kernel and x2.shape[0] <= max_rows and x2.device.type == "cpu":
            kernel = getattr(self.kernel, _KERNELS[self.activations])
            # bf16 rows go in as they are and come back rounded by the kernel (no torch op around it)
            # unless a bias (added in float32) or a float32 output (the LM head) follows
            is_bf16 = x2.dtype == torch.bfloat16
            out = kernel(x2.contiguous() if is_bf16 else x2.float().contiguous(), weight.codes, weight.scales,
                         weight.offsets, weight.block,
                         is_bf16 and bias is None and not getattr(layer, "gguf_float_output", False))
        else:
            # in the dense copy's dtype: a bf16 model's activations meet a bf16 copy unconverted
            out = dense_linear(x2.to(layer.gguf_dense.dtype).contiguous(), layer.gguf_dense)
        if bias is not None:   # type promotion: float32 whenever either side is
            out = out + bias
        out = out.float() if getattr(layer, "gguf_float_output", False) else out.to(x.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def _rows_kernel_takes(rows: int, is_head: bool) -> bool:
        first, last = ROWS_KERNEL_ROWS["head" if is_head else "layers"]
        return first <= rows <= last


    def _decode_args(self, layer: nn.Module) -> tuple[object, ...]:
        """The kernel and its weight arguments for ``apply``'s decode call, or () where the layer
        has no kernel."""
        if not layer.gguf_uses_kernel:
            return ()
        weight: BlockWeight = layer.gguf_weight
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
