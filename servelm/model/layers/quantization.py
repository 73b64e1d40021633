"""Requantization of a loaded model (``--quantization``) and the W8A8 dynamic int8 method.

Modes (``QUANTIZATION_METHODS``): ``w8a8_int8`` (this file), ``int8wo`` and ``int4wo-<group>``
(weight-only, servelm/model/layers/weight_only.py), and ``experts_int8`` (vLLM's name: int8wo on the
routed experts of a mixture-of-experts model only, ``quantize_experts``). The model is built and loaded in float32 as
usual (HF, GGUF -- dequantized at load -- or dummy weights) and then ``quantize_model`` requantizes
it in place, so every checkpoint format gets the same treatment.

W8A8 scheme: weights are int8, symmetric, one scale per output channel (``amax / 127``);
activations are quantized to 8 bits at every call, from their own range, and the int32 accumulator
is scaled back to float32.

Kernels (measured on the 2-core AVX512-VNNI dev box, Gemma 3 270M shapes, min of 40 runs, ms;
the full table with the weight-only kernels is benchmarks/RESULTS.md, "Linear kernels"):

    shape (K x N)     M   fp32    fbgemm dynamic   _int_mm per-token
    640 x 1536        1   0.053   0.022            ~8 (stall)
    2048 x 640        8   0.211   0.029            0.072
    640 x 4096       32   1.125   0.119            0.235
    640 x 262144      1   42.6    7.9              47.9
    640 x 262144     32   281     92.6             87.8

fbgemm's dynamic quantized linear (one fused op: quantize activations, int8 GEMM, dequantize)
wins or ties at every shape, so it is the W8A8 CPU kernel for the layers and the head. fbgemm
quantizes activations per tensor (asymmetric uint8; full 8 bits where the CPU has VNNI); ``apply``
first scales each row to amax 1, which makes the activation range per token (Gemma's first token
has activations orders of magnitude larger than the rest, and a shared range flattened every other
token: perplexity +13% before, see benchmarks/quant_quality.py). Measured relative logits error of
a tiny random Qwen2 against fp32: 2.9%, the same as per-token ``_int_mm``. Where fbgemm is not
available (CUDA), the per-token ``_int_mm`` path runs instead.

Invariants:
- After ``quantize_model`` no LinearBase holds a float weight. The LM head holds its own quantized
  copy; the embedding keeps its float weight (w8a8_int8) or looks rows up from an int8/int4 copy
  (weight-only modes; shared with a tied int8 head), see ``default_embedding``.
- ``apply`` returns the input dtype, so bf16 models keep working.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.layers.linear import LinearBase
from servelm.model.layers.moe import FusedMoE
from servelm.model.layers.weight_only import (INT4_GROUP_SIZES, Int4Rows, Int4WeightOnlyLinearMethod,
                                              Int8Rows, Int8WeightOnlyLinearMethod)

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("auto", "none", "gguf", "gguf_a8", "w8a8_int8", "int8wo", *(f"int4wo-{group}" for group in INT4_GROUP_SIZES),
                        "experts_int8")
"""Every ``--quantization`` value (ModelConfig's choices list the same names). ``auto`` and ``gguf``
are resolved before ``quantize_model`` (servelm/model/gguf/gguf_weights.py)."""

EMBEDDING_MODES = ("none", "int8", *(f"int4-{group}" for group in INT4_GROUP_SIZES))
"""How ``quantize_model`` may store an embedding: float, int8 rows, or int4 rows of a group size."""


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

    name = "w8a8_int8"

    def process(self, layer: nn.Module, keep_weight: bool = False) -> int:
        """Quantize ``layer.weight`` [N, K] into this method's packed form, stored on the layer;
        returns the bytes now stored (int8 weights and float32 scales)."""
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
        return quantized.nbytes + scale.nbytes

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: Any = None) -> torch.Tensor:
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


LinearMethodWithProcess = Int8DynamicLinearMethod | Int8WeightOnlyLinearMethod | Int4WeightOnlyLinearMethod


def quantize_experts(model: nn.Module) -> int:
    """``experts_int8``: every routed expert's gate_up and down projections become int8 weights with
    one scale per output channel (``int8wo``'s method, on each expert's own linears:
    ``FusedMoE.split_experts``); routers, shared experts, attention, head and embedding stay as
    loaded. Returns the bytes of the experts' weights after. Raises ValueError for a model with no
    MoE layer (the flag would change nothing)."""
    layers = [module for module in model.modules() if isinstance(module, FusedMoE)]
    if not layers:
        raise ValueError(f"--quantization experts_int8 quantizes the routed experts of a mixture-of-experts "
                         f"model; {type(model).__name__} has no MoE layer (--quantization int8wo quantizes "
                         "every linear)")
    method = Int8WeightOnlyLinearMethod()
    float_bytes = stored = 0
    with torch.no_grad():
        for moe in layers:
            float_bytes += moe.gate_up_proj.nbytes + moe.down_proj.nbytes
            moe.split_experts()
            assert moe.expert_layers is not None
            for expert in moe.expert_layers:
                stored += method.process(expert.gate_up_proj) + method.process(expert.down_proj)
            moe.drop_stacked()
    logger.info("quantization experts_int8: %d MoE layers' experts int8 per output channel (%.1f MiB, "
                "%.1f MiB before); every other weight as loaded", len(layers), stored / 2 ** 20,
                float_bytes / 2 ** 20)
    return stored


def make_linear_method(name: str) -> LinearMethodWithProcess | None:
    """``--quantization`` value -> the method that requantizes a loaded layer (None for ``none``)."""
    if name == "none":
        return None
    if name == "w8a8_int8":
        return Int8DynamicLinearMethod()
    if name == "int8wo":
        return Int8WeightOnlyLinearMethod()
    if name.startswith("int4wo-") and name in QUANTIZATION_METHODS:
        return Int4WeightOnlyLinearMethod(int(name.removeprefix("int4wo-")))
    raise ValueError(f"unknown quantization method {name!r}; choose from {', '.join(QUANTIZATION_METHODS)}")


def default_embedding(method: str) -> str:
    """How the embedding is stored under ``method``: ``none`` (float), ``int8`` or ``int4-<group>``.

    w8a8_int8 keeps the float embedding (its numbers in benchmarks/RESULTS.md predate embedding
    quantization); the weight-only modes store it like their head, rows dequantized at lookup.
    """
    if method.startswith("int4wo-"):
        return "int4-" + method.removeprefix("int4wo-")
    return "int8" if method == "int8wo" else "none"


def _process_linear(method: LinearMethodWithProcess, module: nn.Module, fallback: LinearMethodWithProcess,
                    fallbacks: list[str]) -> int:
    if isinstance(method, Int4WeightOnlyLinearMethod) and not method.supports(module.weight):
        fallbacks.append(f"{tuple(module.weight.shape)}")
        return fallback.process(module)
    return method.process(module)


def _quantize_embedding(module: VocabEmbedding, mode: str, head: LMHead | None) -> tuple[int, str]:
    """Replace ``module``'s float weight by quantized rows; returns (bytes newly stored -- 0 when
    the rows are the int8 copy of the tied ``head`` --, what the rows are, for the log)."""
    weight = module.weight.data
    size = 0
    if mode == "int8" and head is not None and isinstance(head.linear_method, Int8WeightOnlyLinearMethod):
        module.quantized_rows = Int8Rows(head.int8_weight, head.int8_scale, weight.dtype)
        kind = "int8 rows shared with the tied head"
    elif mode.startswith("int4-") and weight.shape[1] % int(mode.removeprefix("int4-")) == 0:
        module.quantized_rows = Int4Rows(weight, int(mode.removeprefix("int4-")))
        size, kind = module.quantized_rows.nbytes, f"{mode} rows"
    else:   # int8, or int4 rows that do not split into whole groups
        module.quantized_rows = Int8Rows.from_weight(weight)
        size, kind = module.quantized_rows.nbytes, "int8 rows"
    del module.weight
    module.register_parameter("weight", None)
    return size, kind


def quantize_model(model: nn.Module, method: str, *, head: str | None = None,
                   embedding: str | None = None) -> int:
    """Requantize ``model`` in place; returns the bytes of its linear, head and embedding weights after.

    ``method`` quantizes every LinearBase; ``head`` (default: ``method``) the LM head, ``none``
    keeping it float; ``embedding`` (default: ``default_embedding(method)``) is ``none``, ``int8`` or
    ``int4-<group>``. The two overrides exist to measure mixed precision (benchmarks/quant_quality.py).
    """
    if method == "experts_int8":
        return quantize_experts(model)
    head_name = method if head is None else head
    linear = make_linear_method(method)
    head_method = make_linear_method(head_name)
    embedding_mode = default_embedding(method) if embedding is None else embedding
    if embedding_mode not in EMBEDDING_MODES:
        raise ValueError(f"unknown embedding storage {embedding_mode!r}; choose from {', '.join(EMBEDDING_MODES)}")
    if linear is None and head_method is None and embedding_mode == "none":
        return 0
    int8_fallback = Int8WeightOnlyLinearMethod()
    fallbacks: list[str] = []
    modules = list(model.modules())
    weights = {id(m.weight): m.weight for m in modules
               if isinstance(m, (LinearBase, LMHead, VocabEmbedding)) and m.weight is not None}
    float_bytes = sum(weight.nbytes for weight in weights.values())
    stored = 0
    embedding_kinds: set[str] = set()
    with torch.no_grad():
        for module in modules:
            if isinstance(module, LinearBase):
                stored += (module.weight.nbytes if linear is None
                           else _process_linear(linear, module, int8_fallback, fallbacks))
        heads = {id(module.weight): module for module in modules if isinstance(module, LMHead)}
        for module in heads.values():
            # A tied head keeps the float weight only where the embedding stays float.
            if head_method is None:   # a float head tied to a float embedding is counted there
                stored += 0 if module.is_tied and embedding_mode == "none" else module.weight.nbytes
            elif isinstance(head_method, Int8DynamicLinearMethod):
                stored += head_method.process(module, keep_weight=module.is_tied and embedding_mode == "none")
            else:
                stored += _process_linear(head_method, module, int8_fallback, fallbacks)
        for module in modules:
            if isinstance(module, VocabEmbedding):
                if embedding_mode == "none":
                    stored += module.weight.nbytes
                    embedding_kinds.add("float")
                else:
                    tied = heads.get(id(module.weight))
                    size, kind = _quantize_embedding(module, embedding_mode,
                                                     tied if tied is not None and tied.is_tied else None)
                    stored += size
                    embedding_kinds.add(kind)
    if fallbacks:
        logger.info("int4: %d layers whose input size is not a multiple of the group use int8wo: %s",
                    len(fallbacks), ", ".join(sorted(set(fallbacks))))
    kernel = " (fbgemm kernel)" if isinstance(linear, Int8DynamicLinearMethod) and linear.use_fbgemm else ""
    logger.info("quantization %s: linears %s%s, LM head %s, embedding %s; linear, head and embedding "
                "weights %.1f MiB (%.1f MiB before)", method, method, kernel, head_name,
                ", ".join(sorted(embedding_kinds)) or "none",
                stored / 2 ** 20, float_bytes / 2 ** 20)
    return stored
