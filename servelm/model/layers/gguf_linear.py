"""Linear layers, LM head and embedding that run GGUF weights in the blocks the file stores.

``GGUFBlockLinearMethod`` holds a ``BlockWeight`` (int8 codes + a float scale, and an offset for
some types, per 16 or 32 inputs; the lossless repack of gguf_blocks.py) and computes:

- M <= ``KERNEL_MAX_ROWS`` rows: the AVX512-VNNI kernel (gguf_kernel.cpp), which quantizes the
  activations to int8 per 32 inputs as llama.cpp does (so the result is llama.cpp's arithmetic:
  the file's weights exactly, activations rounded to 8 bits per block; about 0.4% relative error
  per layer on random data, far below the weights' own). benchmarks/gguf_kernels.py: 0.3-0.45x the
  time of float32 at M=1 on Gemma 3 / Qwen2.5 shapes, the LM heads included.
- more rows (prefill): the weight dequantized to bfloat16 (where the CPU has a native bf16 GEMM,
  else float32) in row chunks inside the call, then a dense GEMM: at M=1024 the dequantization is
  amortised and oneDNN's GEMM is 2-3x faster than the int8 kernel.
- no kernel (CPU without AVX512-VNNI, no compiler): every call takes the dequantized path.

Invariants: the layer holds no float weight after ``process``; ``apply`` returns x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model.layers.gguf_blocks import BlockWeight
from servelm.model.layers.linear import dense_linear

KERNEL_MAX_ROWS = 32
"""Rows up to which the int8 kernel runs; above, dequantize + dense GEMM (benchmarks/gguf_kernels.py:
at M=32 the kernel is 0.4-0.5x float32 and level with dequantize-to-bf16, at M=1024 the bf16 GEMM
takes 0.2-0.27x float32 and the kernel 0.5-0.66x)."""

DEQUANT_CHUNK_ELEMENTS = 1 << 22
"""Weights dequantized at once on the large-M path (8 MiB in bf16): the 262,144-row head is not
materialised whole."""


class GGUFBlockLinearMethod:
    """Computes ``x @ W.T`` from a ``BlockWeight`` (see the module docstring)."""

    name = "gguf"

    def __init__(self, kernel: object | None, dense_dtype: torch.dtype) -> None:
        self.kernel = kernel
        self.dense_dtype = dense_dtype
        """Dtype of the dequantized weight on the large-M path (bf16 with a native bf16 GEMM)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("GGUF block layers are made from loaded layers by apply_gguf_blocks")

    def process(self, layer: nn.Module, weight: BlockWeight) -> int:
        """Give ``layer`` its block weight in place of the float one; returns the bytes stored."""
        layer.gguf_weight = weight
        layer.gguf_uses_kernel = self.kernel is not None and weight.codes.shape[1] % 64 == 0
        if getattr(layer, "weight", None) is not None:
            del layer.weight
            layer.register_parameter("weight", None)
        layer.linear_method = self
        return weight.nbytes

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight: BlockWeight = layer.gguf_weight
        if layer.gguf_uses_kernel and x2.shape[0] <= KERNEL_MAX_ROWS and x2.device.type == "cpu":
            out = self.kernel.block_linear(x2.float().contiguous(), weight.codes, weight.scales,  # type: ignore[attr-defined]
                                           weight.offsets, weight.block)
        else:
            out = dequantized_linear(x2, weight, self.dense_dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


def dequantized_linear(x: torch.Tensor, weight: BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """``x [M, K] @ W.T`` with W dequantized to ``dtype`` in row chunks (float32 out)."""
    rows, cols = weight.codes.shape
    chunk = max(1, DEQUANT_CHUNK_ELEMENTS // cols)
    x = x.to(dtype).contiguous()
    if chunk >= rows:
        return dense_linear(x, weight.dequantize(dtype=dtype)).float()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        out[:, start:stop] = F.linear(x, weight.dequantize(slice(start, stop), dtype))
    return out


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
