"""W8A8 dynamic int8 quantization of every linear layer and of the LM head (``--quantization w8a8_int8``).

Scheme: weights are int8, symmetric, one scale per output channel (``amax / 127``); activations
are quantized to 8 bits at every call, from their own range, and the int32 accumulator is scaled
back to float32. The model is built and loaded in float32 as usual (HF, GGUF -- dequantized at load --
or dummy weights) and then ``quantize_model`` requantizes it in place, so every checkpoint format
gets the same treatment.

Kernels (measured on the 2-core AVX512-VNNI dev box, Gemma 3 270M shapes, min of 40 runs, ms):

    shape (K x N)     M   fp32    fbgemm dynamic   _int_mm per-token   _weight_int8pack_mm
    640 x 1536        1   0.053   0.022            ~8 (stall)          ~7
    2048 x 640        8   0.211   0.029            0.072               7.8
    640 x 4096       32   1.125   0.119            0.235               59
    640 x 262144      1   42.6    7.9              47.9                15.9
    640 x 262144     32   281     92.6             87.8                496

fbgemm's dynamic quantized linear (one fused op: quantize activations, int8 GEMM, dequantize)
wins or ties at every shape, so it is the CPU kernel for the layers and the head. fbgemm quantizes
activations per tensor (asymmetric uint8; full 8 bits where the CPU has VNNI); ``apply`` first
scales each row to amax 1, which makes the activation range per token (Gemma's first token has
activations orders of magnitude larger than the rest, and a shared range flattened every other
token: perplexity +13% before, see benchmarks/quant_quality.py). Measured relative logits error of
a tiny random Qwen2 against fp32: 2.9%, the same as per-token ``_int_mm``. Where fbgemm is not
available (CUDA), the per-token ``_int_mm`` path runs instead. ``_weight_int8pack_mm`` (int8
weight-only) was slower than fp32 at every shape here, which is why ``int8wo`` is refused.

Invariants:
- After ``quantize_model`` no LinearBase holds a float weight; the LM head holds an int8 copy and
  keeps its float weight only when it is tied to the embedding (the lookup stays exact).
- ``apply`` returns the input dtype, so bf16 models keep working.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from servelm.model.layers.embedding import LMHead
from servelm.model.layers.linear import LinearBase

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("none", "w8a8_int8")


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``[N, K]``, float32 scale ``[N]``) with ``w ~= q * scale[:, None]``."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scale


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


_REDUCE_RANGE = not _cpu_has_vnni()
"""fbgemm's 7-bit activation range avoids int16 saturation in the AVX2 (vpmaddubsw) kernel; with
VNNI the full 8 bits are exact and halve the error (tiny Qwen2: 6.4% -> 3.6% relative logits error)."""


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8DynamicLinearMethod:
    """A LinearMethod over packed int8 weights; built from a loaded float layer by ``process``."""

    def __init__(self, use_fbgemm: bool | None = None) -> None:
        self.use_fbgemm = _has_fbgemm() if use_fbgemm is None else use_fbgemm

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError("int8 layers are made from loaded float layers by quantize_model")

    def process(self, layer: nn.Module, keep_weight: bool = False) -> None:
        """Quantize ``layer.weight`` [N, K] into this method's packed form, stored on the layer."""
        weight = layer.weight.data
        quantized, scale = quantize_weight_per_channel(weight)
        if self.use_fbgemm and weight.device.type == "cpu":
            zero_points = torch.zeros(quantized.shape[0], dtype=torch.int64)
            with warnings.catch_warnings():   # quantized tensors are deprecated but fbgemm needs one
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch._make_per_channel_quantized_tensor(quantized, scale.double(), zero_points, 0)
            layer.int8_packed = torch.ops.quantized.linear_prepack(qweight, None)
        else:
            layer.int8_weight_t = quantized.t().contiguous()    # [K, N] for _int_mm
            layer.int8_scale = scale
        layer.int8_fbgemm = self.use_fbgemm and weight.device.type == "cpu"
        if not keep_weight:
            del layer.weight
            layer.register_parameter("weight", None)
        layer.linear_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if layer.int8_fbgemm and x2.shape[0] > 1:
            # fbgemm quantizes the whole tensor with one range; scaling each row to amax 1 first
            # makes that range per-token (one outlier token, like Gemma's first, cannot flatten
            # the others), and linearity lets the row scale come back out of the product.
            row_scale = x2.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)    # [M, 1]
            out = torch.ops.quantized.linear_dynamic(x2 / row_scale, layer.int8_packed, _REDUCE_RANGE)
            out.mul_(row_scale)
        elif layer.int8_fbgemm:
            out = torch.ops.quantized.linear_dynamic(x2, layer.int8_packed, _REDUCE_RANGE)
        else:
            out = _per_token_int_mm(x2, layer.int8_weight_t, layer.int8_scale)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


def _per_token_int_mm(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 activations times per-channel int8 weights (``torch._int_mm``)."""
    x_scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)   # [M, 1]
    x_q = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    rows = x_q.shape[0]
    if x.device.type == "cuda" and rows <= 16:   # cuBLAS int8 GEMM needs M > 16
        x_q = torch.nn.functional.pad(x_q, (0, 0, 0, 17 - rows))
    accumulated = torch._int_mm(x_q, weight_t)[:rows]                      # [M, N] int32
    return accumulated.float() * x_scale * weight_scale


def quantize_model(model: nn.Module, method: str) -> int:
    """Requantize ``model``'s linears and LM head in place; returns the weight bytes saved."""
    if method == "none":
        return 0
    if method != "w8a8_int8":
        raise ValueError(f"unknown quantization method {method!r}; choose from {QUANTIZATION_METHODS}")
    int8 = Int8DynamicLinearMethod()
    saved = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase):
                saved += module.weight.numel() * (module.weight.element_size() - 1)
                int8.process(module)
            elif isinstance(module, LMHead):
                if not module.is_tied:
                    saved += module.weight.numel() * (module.weight.element_size() - 1)
                int8.process(module, keep_weight=module.is_tied)
    logger.info("quantized linears and LM head to int8 (W8A8 dynamic, %s kernel); weights %.1f MiB smaller",
                "fbgemm" if int8.use_fbgemm else "torch._int_mm per-token", saved / 2 ** 20)
    return saved
