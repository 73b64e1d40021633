"""Weight-only int8 and int4 quantization: ``--quantization int8wo`` and ``int4wo-<group>``.

Weights are stored in few bits and activations stay in float: every call multiplies float
activations by the low-bit weights through torch's CPU kernels, dequantizing inside the kernel.

- int8wo: symmetric int8, one scale per output channel (``w ~= q * scale[n]``).
- int4wo-G: asymmetric 4-bit, one (scale, zero) pair per group of G consecutive inputs of an
  output channel: ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15 (the affine form of torch's
  int4 kernels; ``zero`` is the value of the group's middle code, so min and max are exact).

Kernels (see benchmarks/linear_kernels.py; table in benchmarks/RESULTS.md, "Linear kernels"): on
CPU both modes call torch's packed kernels at every M -- ``torch._weight_int8pack_mm`` and
``torch._weight_int4pack_mm_for_cpu`` -- with the activations cast to bfloat16: the kernels'
vectorised paths are bf16-only, and float32 activations take a scalar reference loop 10-100x
slower than float32 ``F.linear`` (which is why int8wo was once measured "slower than fp32"). With
bf16 activations they beat float32 at every measured shape and M (1 to 1,024 rows; prefill
included), so there is no per-M switch; the output is bf16 rounded (2^-9 relative), below the
weights' own rounding. Elsewhere (CUDA) and for int4 layers whose output size is not a multiple
of 16 (the kernel packs 16 channels together), weights are dequantized in row chunks into a
float32 matmul. The embedding looks up int8 rows, or int4 rows from a plain nibble-packed copy
(the kernel's packed layout is blocked and private), and dequantizes only the looked-up rows.

Invariants:
- After ``process`` the layer holds no float weight (a tied embedding that stays float keeps the
  shared Parameter alive through its own attribute; see quantize_model).
- ``apply`` returns the input's dtype; on CPU the kernels see bf16 activations and return bf16
  results, which are cast back; the chunked path computes in float32.
- int4 needs ``K % group == 0``; quantize_model falls back to int8wo for layers that do not
  divide (logged).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP_SIZES = (32, 64, 128, 256)

DEQUANT_CHUNK_ELEMENTS = 1 << 20
"""Weights dequantized per chunk (4 MiB of float32): big enough for a GEMM that amortises the
dequantization, small enough to stay near the cache instead of materialising a 671 MB head."""


# --- int8 --------------------------------------------------------------------------------------

def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``[N, K]``, float32 scale ``[N]``) with ``w ~= q * scale[:, None]``."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scale


def dequantize_int8(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows ``[R, K]`` with scales ``[R]`` -> float32 ``[R, K]``."""
    return quantized.float().mul_(scale[:, None])


# --- int4 --------------------------------------------------------------------------------------

def quantize_int4_groupwise(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (codes uint8 ``[N, K]`` in 0..15, scale ``[N, K/group]``, zero ``[N, K/group]``).

    ``w ~= (q - 8) * scale + zero`` per group; asymmetric (min/max) so skewed groups use all 16 codes.
    """
    rows, cols = weight.shape
    assert cols % group == 0, f"K={cols} is not a multiple of the int4 group size {group}"
    grouped = weight.float().reshape(rows, cols // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-8)
    codes = torch.round((grouped - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    zero = low + 8.0 * scale
    return codes.reshape(rows, cols), scale, zero


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[R, K]`` (0..15, K even) -> ``[R, K/2]``, even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nibble-packed rows ``[R, K/2]`` with ``[R, K/group]`` scales and zeros -> float32 ``[R, K]``."""
    rows, groups = scale.shape
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(rows, groups, -1)
    values = (codes.float() - 8.0).mul_(scale[..., None]).add_(zero[..., None])
    return values.reshape(rows, -1)


def pack_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``_weight_int4pack_mm_for_cpu`` weight, scales+zeros ``[K/group, N, 2]``)."""
    codes, scale, zero = quantize_int4_groupwise(weight, group)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scale_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    return packed, scale_zeros


# --- matmul over dequantized chunks --------------------------------------------------------------

def dequant_chunked_linear(x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor,
                           zero: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W.T`` with W dequantized ``DEQUANT_CHUNK_ELEMENTS`` at a time (float32 out).

    ``zero is None``: int8 rows and per-row scales; else nibble-packed int4 rows (see above).
    """
    rows = quantized.shape[0]
    cols = x.shape[-1]
    chunk = max(1, DEQUANT_CHUNK_ELEMENTS // cols)
    if chunk >= rows:
        weight = dequantize_int8(quantized, scale) if zero is None else dequantize_int4(quantized, scale, zero)
        return F.linear(x, weight)
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        if zero is None:
            weight = dequantize_int8(quantized[start:stop], scale[start:stop])
        else:
            weight = dequantize_int4(quantized[start:stop], scale[start:stop], zero[start:stop])
        torch.matmul(x, weight.t(), out=out[:, start:stop])
    return out


# --- linear methods ------------------------------------------------------------------------------

def _drop_float_weight(layer: nn.Module) -> None:
    del layer.weight
    layer.register_parameter("weight", None)


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` bfloat16: the packed CPU kernels vectorise only bf16 activations
    (float32 ones take a scalar reference loop, 10-100x slower; see benchmarks/linear_kernels.py)."""
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16)


class Int8WeightOnlyLinearMethod:
    """int8 weights with one scale per output channel; float activations (``int8wo``)."""

    name = "int8wo"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("int8wo layers are made from loaded float layers by quantize_model")

    def process(self, layer: nn.Module) -> int:
        """Quantize ``layer.weight`` [N, K] in place; returns the bytes now stored."""
        quantized, scale = quantize_int8_per_channel(layer.weight.data)
        layer.int8_weight = quantized                    # [N, K] int8
        layer.int8_scale = scale                         # [N] float32
        layer.int8_scale_bf16 = scale.to(torch.bfloat16)
        _drop_float_weight(layer)
        layer.linear_method = self
        return quantized.nbytes + scale.nbytes + layer.int8_scale_bf16.nbytes

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: Any = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        if x.device.type == "cpu":
            out = torch._weight_int8pack_mm(_kernel_input(x), layer.int8_weight, layer.int8_scale_bf16)
        else:
            out = dequant_chunked_linear(x.reshape(-1, shape[-1]).float(), layer.int8_weight,
                                         layer.int8_scale, None)
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


class Int4WeightOnlyLinearMethod:
    """Group-wise asymmetric int4 weights; float activations (``int4wo-<group>``)."""

    def __init__(self, group: int) -> None:
        assert group in INT4_GROUP_SIZES, f"int4 group size must be one of {INT4_GROUP_SIZES}"
        self.group = group
        self.name = f"int4wo-{group}"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("int4wo layers are made from loaded float layers by quantize_model")

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``[N, K]`` splits into whole groups (else the layer falls back to int8wo)."""
        return weight.shape[1] % self.group == 0 and weight.shape[1] % 2 == 0

    def uses_packed_kernel(self, weight: torch.Tensor) -> bool:
        """The CPU int4 kernel packs output channels in blocks of 16; other layers dequantize chunks."""
        return weight.device.type == "cpu" and weight.shape[0] % 16 == 0

    def process(self, layer: nn.Module) -> int:
        """Quantize ``layer.weight`` [N, K] in place; returns the bytes now stored."""
        weight = layer.weight.data
        if self.uses_packed_kernel(weight):
            packed, scale_zeros = pack_int4(weight, self.group)
            layer.int4_packed = packed                                  # kernel layout, K/2 bytes a row
            layer.int4_scale_zeros = scale_zeros.to(torch.bfloat16)     # [K/group, N, 2]
            stored = packed.nbytes + layer.int4_scale_zeros.nbytes
        else:
            codes, scale, zero = quantize_int4_groupwise(weight, self.group)
            layer.int4_packed = None
            layer.int4_nibbles, layer.int4_scale, layer.int4_zero = pack_nibbles(codes), scale, zero
            stored = layer.int4_nibbles.nbytes + scale.nbytes + zero.nbytes
        _drop_float_weight(layer)
        layer.linear_method = self
        return stored

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: Any = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        if layer.int4_packed is not None:
            out = torch._weight_int4pack_mm_for_cpu(_kernel_input(x), layer.int4_packed, self.group,
                                                    layer.int4_scale_zeros)
        else:
            out = dequant_chunked_linear(x.reshape(-1, shape[-1]).float(), layer.int4_nibbles,
                                         layer.int4_scale, layer.int4_zero)
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


# --- embedding rows --------------------------------------------------------------------------------

class Int8Rows:
    """Embedding lookup from int8 rows (per-row scale), dequantizing only the looked-up rows."""

    def __init__(self, quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.quantized, self.scale, self.dtype = quantized, scale, dtype

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Rows:
        return cls(*quantize_int8_per_channel(weight), weight.dtype)

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes + self.scale.nbytes

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` rows in the dtype of the float weight they replace."""
        return dequantize_int8(self.quantized[input_ids], self.scale[input_ids]).to(self.dtype)


class Int4Rows:
    """Embedding lookup from nibble-packed int4 rows (group-wise scale and zero)."""

    def __init__(self, weight: torch.Tensor, group: int) -> None:
        codes, self.scale, self.zero = quantize_int4_groupwise(weight, group)
        self.nibbles = pack_nibbles(codes)
        self.dtype = weight.dtype

    @property
    def nbytes(self) -> int:
        return self.nibbles.nbytes + self.scale.nbytes + self.zero.nbytes

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(self.nibbles[input_ids], self.scale[input_ids],
                               self.zero[input_ids]).to(self.dtype)
