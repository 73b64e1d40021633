"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ, FP8, compressed-tensors and bitsandbytes.

The format is read from config.json's ``quantization_config`` (``detect``); ``--quantization``, when
given, must name the same format (``resolve``), and a scheme this module cannot reproduce exactly is
refused at start-up with its name (``UnsupportedQuantization``).

Loading (``dequantizing_weights``) wraps the checkpoint's tensor stream: the tensors of one
quantized module (GPTQ ``qweight``/``qzeros``/``scales``/``g_idx``, AWQ ``qweight``/``qzeros``/
``scales``, FP8 ``weight`` + ``weight_scale_inv``/``weight_scale``, compressed-tensors
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``/``weight_g_idx`` or an
int8/fp8 ``weight`` + ``weight_scale``, bitsandbytes int8 ``weight`` + ``SCB`` or 4-bit ``weight`` +
``weight.absmax``/``weight.quant_map``/``weight.nested_*``/``weight.quant_state.bitsandbytes__<type>``)
are gathered and replaced by one float32 ``<module>.weight``,
dequantized exactly as the format's own library does it in float32:

    GPTQ    w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]   z = stored + 1 (the v1 checkpoint
            format's off-by-one; ``checkpoint_format: gptq_v2`` stores z itself); g = g_idx
    AWQ     w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], columns packed in the order
            0 2 4 6 1 3 5 7 inside each int32 (GEMM layout)
    FP8     w = float(e4m3) * scale, the scale per tensor, per output row or per 128x128 block
    CT int  w[n, k] = (q[n, k] - zp[n, g(k)]) * s[n, g(k)], q signed (unsigned code - 2^(b-1)),
            densely bit-packed little-endian into int32 along the input (zero points along the
            output); CT float: as FP8.
    bnb 8   w[n, k] = q[n, k] * SCB[n] / 127 (LLM.int8 row-wise absmax)
    bnb 4   w.flat[i] = quant_map[c(i)] * absmax[i // blocksize], c(i) the high nibble of byte i/2
            for even i, the low one for odd i (nf4/fp4: a 16-entry table); with double quant
            absmax = nested_quant_map[absmax_code] * nested_absmax[j // nested_blocksize] + offset;
            the result cast to the quant_state's dtype, as bitsandbytes returns it.

Everything downstream (tensor parallel sharding, fused QKV and gate_up, LoRA, the flat decode paths)
then sees an ordinary float checkpoint. The integer formats (GPTQ, AWQ, CT int with whole groups)
also keep each module's codes as a ``BlockWeight`` (int8 codes ``q - z``, a scale per group, the
group split to 32-input blocks): where ``serve_blocks`` allows (CPU, --dtype auto, the block kernel
built; at tp 1 or under DP attention every such module, at tp > 1 a MoE model's routed experts only:
a rank's whole experts under --ep-size = --tp-size, else its intermediate columns where they are whole
groups), ``apply_block_weights`` replaces the float weights by them and the GGUF block routes
(AVX2 or AVX512-VNNI kernel, measured route table) run them at the checkpoint's own precision; the
float weight each replaces was built from the same codes, and is checked against them. FP8 has no
integer codes: it always runs dequantized (to --dtype) -- this CPU path has no FP8 GEMM; neither has
bitsandbytes 4-bit (table values, not integers); bitsandbytes int8 (one group per row) runs on the
block routes.

Invariants:
- The emitted float weight is ``BlockWeight.dequantize()`` where there is a block weight, so a
  served block weight equals the dequantized weight it replaces bit for bit (float32).
- Tensors of non-quantized modules (embeddings, norms, an unquantized LM head, biases) pass through.
- Static activation scales (``input_scale`` and the like) are dropped with a log line: activations
  stay float (the weight-only part of a W8A8 scheme, more exact than the scheme itself).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from servelm.config import REFUSED_QUANTIZATION
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.layers.moe import canonical_expert_name

logger = logging.getLogger(__name__)

PREQUANTIZED_METHODS = ("gptq", "awq", "fp8", "fbgemm_fp8", "compressed-tensors", "bitsandbytes")
"""``--quantization`` values that name a pre-quantized checkpoint's format."""

FLAG_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
"""vLLM's kernel-specific names for the same checkpoint formats (Marlin is a CUDA kernel; on CPU
the format runs on servelm's own routes)."""

REFUSED_FLAG_VALUES = REFUSED_QUANTIZATION
"""Other engines' ``--quantization`` values that servelm refuses, with the reason."""

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""AWQ GEMM packs the 8 columns of an int32 in the order 0 2 4 6 1 3 5 7 (nibble j holds column
[0, 2, 4, 6, 1, 3, 5, 7][j]); column m is therefore in nibble ``_AWQ_REVERSE_ORDER[m]``."""
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "dense")
_CT_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
_FP8_DROPPED = ("input_scale", "activation_scale", "input_scale_ub")
_BNB_4BIT_PARTS = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
                   "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4")
_BNB_INT8_SCALE = 1 / 127


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization scheme that servelm cannot serve; the message names it."""


@dataclass
class QuantSpec:
    """One checkpoint's quantization, as ``detect`` read it."""

    method: str                          # one of PREQUANTIZED_METHODS
    bits: int | None = None              # gptq/awq
    group: int | None = None             # gptq/awq; -1: one group per row
    desc_act: bool = False               # gptq
    zero_plus_one: bool = False          # gptq v1 checkpoint format
    fp8_block: tuple[int, int] | None = None   # fp8 weight_block_size / CT block_structure
    needs_zero_point: bool = False       # compressed-tensors: a group is asymmetric
    needs_g_idx: bool = False            # compressed-tensors: activation ordering
    description: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def integer(self) -> bool:
        """Whether the format stores integer codes (served on the block routes where allowed)."""
        return self.method in ("gptq", "awq", "compressed-tensors") or (self.method, self.bits) == ("bitsandbytes", 8)


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict (None without one)."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        value = getattr(config, "quantization_config", None) if config is not None else None
        if value is None:
            continue
        if not isinstance(value, dict):
            value = value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))
        return value
    return None


def detect(hf_config: Any) -> QuantSpec | None:
    """The checkpoint's quantization from its config (None: not pre-quantized).

    Raises UnsupportedQuantization naming a scheme servelm does not serve."""
    config = quantization_config(hf_config)
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower().replace("_", "-") if config.get("quant_method") else ""
    if not method:
        if config.get("load_in_4bit") or config.get("load_in_8bit"):
            method = "bitsandbytes"
        else:
            raise UnsupportedQuantization(f"config.json has a quantization_config without quant_method: {config}")
    if method == "gptq":
        return _detect_gptq(config)
    if method == "awq":
        return _detect_awq(config)
    if method in ("fp8", "fbgemm-fp8"):
        return _detect_fp8(config, "fp8" if method == "fp8" else "fbgemm_fp8")
    if method == "compressed-tensors":
        return _detect_compressed_tensors(config)
    if method == "bitsandbytes":
        return _detect_bitsandbytes(config)
    raise UnsupportedQuantization(f"quantization_config quant_method {config.get('quant_method')!r} is not "
                                  f"supported (supported: {', '.join(PREQUANTIZED_METHODS)})")


def _bits_and_group(config: dict[str, Any], name: str, allowed_bits: tuple[int, ...]) -> tuple[int, int]:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    if bits not in allowed_bits:
        raise UnsupportedQuantization(f"{name} with {bits}-bit weights is not supported "
                                      f"(supported: {', '.join(map(str, allowed_bits))} bits)")
    if group != -1 and group <= 0:
        raise UnsupportedQuantization(f"{name} group_size {group} is not supported")
    return bits, group


def _detect_gptq(config: dict[str, Any]) -> QuantSpec:
    bits, group = _bits_and_group(config, "GPTQ", (2, 4, 8))
    checkpoint_format = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                                      "(supported: gptq, gptq_v2)")
    desc_act = bool(config.get("desc_act", False))
    sym = bool(config.get("sym", True))
    return QuantSpec("gptq", bits, group, desc_act=desc_act, zero_plus_one=checkpoint_format == "gptq",
                     description=f"GPTQ int{bits}, group {group}, {'sym' if sym else 'asym'}"
                                 f"{', desc_act (g_idx)' if desc_act else ''}, {checkpoint_format} format")


def _detect_awq(config: dict[str, Any]) -> QuantSpec:
    bits, group = _bits_and_group(config, "AWQ", (4,))
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedQuantization(f"AWQ version {version!r} is not supported (supported: gemm)")
    if not config.get("zero_point", True):
        raise UnsupportedQuantization("AWQ without zero points (zero_point: false) is not supported")
    return QuantSpec("awq", bits, group, description=f"AWQ int{bits} GEMM, group {group}, zero points")


def _detect_fp8(config: dict[str, Any], method: str) -> QuantSpec:
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"FP8 fmt {fmt!r} is not supported (supported: e4m3)")
    block = config.get("weight_block_size")
    notes = []
    if str(config.get("activation_scheme", "dynamic")) == "static":
        notes.append("static activation scales dropped: activations stay unquantized")
    spec = QuantSpec(method, fp8_block=tuple(block) if block else None, notes=notes,  # type: ignore[arg-type]
                     description=("FP8 e4m3, " + (f"{block[0]}x{block[1]} blocks" if block else
                                                  "per-channel scales" if method == "fbgemm_fp8"
                                                  else "per-tensor scales")))
    return spec


def _detect_bitsandbytes(config: dict[str, Any]) -> QuantSpec:
    if config.get("load_in_4bit"):
        kind = str(config.get("bnb_4bit_quant_type", "fp4"))
        storage = str(config.get("bnb_4bit_quant_storage") or "uint8").replace("torch.", "")
        if kind not in ("nf4", "fp4"):
            raise UnsupportedQuantization(f"bitsandbytes 4-bit quant type {kind!r} is not supported (nf4, fp4)")
        if storage != "uint8":
            raise UnsupportedQuantization(f"bitsandbytes 4-bit quant storage {storage!r} is not supported (uint8)")
        double = ", double quant" if config.get("bnb_4bit_use_double_quant") else ""
        return QuantSpec("bitsandbytes", 4, description=f"bitsandbytes {kind}{double}")
    if config.get("load_in_8bit"):
        return QuantSpec("bitsandbytes", 8, -1, description="bitsandbytes int8 (LLM.int8 row-wise absmax)")
    raise UnsupportedQuantization("bitsandbytes quantization_config with neither load_in_4bit nor load_in_8bit")


def _detect_compressed_tensors(config: dict[str, Any]) -> QuantSpec:
    global_format = config.get("format")
    sparsity = config.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") not in ("dense", None):
        raise UnsupportedQuantization(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not "
                                      "supported")
    if config.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (quantized KV cache scales) is not "
                                      "supported; use --kv-cache-dtype")
    if config.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors transform_config (rotations) is not supported")
    schemes: list[str] = []
    spec = QuantSpec("compressed-tensors")
    for name, group in (config.get("config_groups") or {}).items():
        fmt = group.get("format") or global_format or "dense"
        if fmt not in _CT_FORMATS:
            raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} ({name}) is not supported "
                                          f"(supported: {', '.join(_CT_FORMATS)})")
        weights = group.get("weights") or {}
        if weights:
            kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
            strategy = weights.get("strategy", "tensor")
            if kind == "int" and not 2 <= bits <= 8:
                raise UnsupportedQuantization(f"compressed-tensors int{bits} weights ({name}) are not supported")
            if kind == "float" and bits != 8:
                raise UnsupportedQuantization(f"compressed-tensors float{bits} weights ({name}) are not "
                                              "supported (FP8 only)")
            if kind not in ("int", "float"):
                raise UnsupportedQuantization(f"compressed-tensors weight type {kind!r} ({name}) is not supported")
            if strategy not in ("tensor", "channel", "group", "block"):
                raise UnsupportedQuantization(f"compressed-tensors weight strategy {strategy!r} ({name}) is not "
                                              "supported")
            if weights.get("dynamic"):
                raise UnsupportedQuantization(f"compressed-tensors dynamic weight quantization ({name}) is not "
                                              "supported")
            if not weights.get("symmetric", True):
                spec.needs_zero_point = True
            if weights.get("actorder") in ("group", "dynamic"):
                spec.needs_g_idx = True
            if strategy == "block" and weights.get("block_structure"):
                spec.fp8_block = tuple(weights["block_structure"])  # type: ignore[assignment]
            detail = f"{kind}{bits} {strategy}" + (f" {weights.get('group_size')}" if strategy == "group" else "")
            detail += "" if weights.get("symmetric", True) else " asym"
        else:
            detail = "no weights"
        activations = group.get("input_activations")
        if activations:
            detail += f", activations {activations.get('type', 'int')}{activations.get('num_bits', '')} dropped"
            if "activations stay unquantized" not in " ".join(spec.notes):
                spec.notes.append("input activation quantization dropped: activations stay unquantized")
        schemes.append(f"{name}: {fmt} {detail}")
    spec.description = "compressed-tensors (" + "; ".join(schemes) + ")"
    return spec


_NO_QUANTIZING_AT_LOAD = {
    "fp8": "FP8 quantization at load needs an FP8 GEMM, which this CPU path lacks",
    "fbgemm_fp8": "FP8 quantization at load needs an FP8 GEMM, which this CPU path lacks",
    "bitsandbytes": "servelm does not quantize with bitsandbytes at load",
}


def resolve(flag: str, spec: QuantSpec | None, load_format: str = "auto") -> tuple[str, str]:
    """(--quantization to apply, why) for ``flag`` and the checkpoint's ``spec``.

    A pre-quantized checkpoint runs in its own format (``auto``, or the format's own name); any other
    flag value is an error naming both. A format name without a pre-quantized checkpoint is an error,
    and so is ``--load-format bitsandbytes`` without a bitsandbytes checkpoint."""
    named = FLAG_ALIASES.get(flag, flag)
    if named in REFUSED_FLAG_VALUES:
        raise ValueError(f"--quantization {flag}: {REFUSED_FLAG_VALUES[named]}")
    if load_format == "bitsandbytes" and (spec is None or spec.method != "bitsandbytes"):
        raise ValueError("--load-format bitsandbytes loads a bitsandbytes checkpoint (config.json "
                         "quantization_config with load_in_8bit or load_in_4bit); this model has "
                         f"{spec.description if spec else 'none'} ({_NO_QUANTIZING_AT_LOAD['bitsandbytes']}; "
                         "drop --load-format, or quantize at load with int8wo or int4wo-<group>)")
    if spec is None:
        if named in PREQUANTIZED_METHODS:
            hint = _NO_QUANTIZING_AT_LOAD.get(named, "servelm does not run GPTQ/AWQ calibration")
            raise ValueError(f"--quantization {flag} loads a pre-quantized checkpoint (config.json "
                             f"quantization_config with quant_method {named!r}); this model has none ({hint}; "
                             "to quantize at load use w8a8_int8, int8wo or int4wo-<group>)")
        return flag, ""
    method = "fp8" if spec.method == "fbgemm_fp8" and named == "fp8" else spec.method
    if named == "none":
        return spec.method, (f"--quantization none: the checkpoint's quantization_config ({spec.description}) "
                             "dequantized exactly to the model dtype at load")
    if named in ("auto", method, spec.method):
        return spec.method, (f"{'auto' if named == 'auto' else '--quantization ' + flag}: the checkpoint's "
                             f"quantization_config: {spec.description}")
    raise ValueError(f"--quantization {flag} disagrees with the checkpoint's quantization_config "
                     f"(quant_method {spec.method!r}: {spec.description}); drop --quantization or pass "
                     f"--quantization {spec.method}")


# --- bit unpacking ---------------------------------------------------------------------------------

def unpack_dense(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """int32 words packed along ``dim`` -> unsigned codes int32, ``count`` along ``dim``: element i
    is bits ``i*bits .. i*bits+bits-1`` of the little-endian bit stream of the words (GPTQ, AWQ
    before its column reorder, compressed-tensors' pack_to_int32)."""
    words = packed.to(torch.int32)
    if dim == 0:
        words = words.t()
    words = words.contiguous()
    rows, num_words = words.shape
    if 32 % bits == 0:   # no code crosses a word: shifts
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        codes = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
        codes = codes.reshape(rows, num_words * (32 // bits))
    else:
        stream = torch.stack([(words >> bit) & 1 for bit in range(32)], dim=-1).reshape(rows, -1)
        usable = stream.shape[1] // bits * bits
        weights = (1 << torch.arange(bits, dtype=torch.int32))
        codes = (stream[:, :usable].reshape(rows, -1, bits) * weights).sum(-1, dtype=torch.int32)
    if codes.shape[1] < count:
        raise ValueError(f"packed tensor holds {codes.shape[1]} codes per row, {count} expected")
    codes = codes[:, :count]
    return codes.t().contiguous() if dim == 0 else codes


# --- per-format dequantization ---------------------------------------------------------------------

def _groups_of(g_idx: torch.Tensor | None, columns: int, group: int) -> tuple[torch.Tensor, bool]:
    """(group of each input column, whether that is the plain ``k // group``)."""
    plain = torch.arange(columns) // (columns if group == -1 else group)
    if g_idx is None:
        return plain, True
    g_idx = g_idx.to(torch.int64).reshape(-1)
    return g_idx, bool(torch.equal(g_idx, plain))


def block_weight(codes: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
                 kind: str) -> BlockWeight | None:
    """Integer codes [N, K] (int32), zero points [N, G] (or None) and scales [N, G] -> a BlockWeight
    with block K / G whose ``dequantize()`` is ``(codes - zero) * scale`` (None when G does not divide
    K). int8 codes are ``codes - zero`` where that fits, else the codes (shifted into int8) with an
    offset ``-(zero - shift) * scale`` per group (int8 with arbitrary zero points)."""
    n, k = codes.shape
    groups = scales.shape[1]
    if k % groups:
        return None
    block = k // groups
    scales = scales.float().contiguous()
    if zeros is None:
        zeros = torch.zeros(n, groups, dtype=torch.int32)
    zeros = zeros.to(torch.int32)
    expanded = zeros.repeat_interleave(block, dim=1)
    difference = codes - expanded
    if difference.min() >= -128 and difference.max() <= 127:
        return BlockWeight(difference.to(torch.int8).contiguous(), scales, None, block, kind)
    shift = 0 if codes.min() >= -128 and codes.max() <= 127 else 128
    offsets = -(zeros - shift).float() * scales
    return BlockWeight((codes - shift).to(torch.int8).contiguous(), scales, offsets.contiguous(), block, kind)


def _dequantize_columns(codes: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
                        groups: torch.Tensor) -> torch.Tensor:
    """codes [N, K], zeros/scales [N, G], column groups [K] -> float32 [N, K] (any column order)."""
    values = codes.float()
    if zeros is not None:
        values = values - zeros.float()[:, groups]
    return values * scales.float()[:, groups]


def _gptq(parts: dict[str, torch.Tensor], spec: QuantSpec, name: str,
          report: LoadReport | None = None) -> tuple[torch.Tensor, BlockWeight | None]:
    bits = spec.bits or 4
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    columns = qweight.shape[0] * 32 // bits
    outputs = scales.shape[1]
    codes = unpack_dense(qweight, bits, columns, dim=0).t()      # [N, K]
    zeros = unpack_dense(qzeros, bits, outputs, dim=1).t()       # [N, G]
    if spec.zero_plus_one:
        zeros = zeros + 1
    scales_t = scales.float().t().contiguous()                  # [N, G]
    groups, plain = _groups_of(parts.get("g_idx"), columns, spec.group or -1)
    if plain:
        weight = block_weight(codes.contiguous(), zeros.contiguous(), scales_t, f"GPTQ-int{bits}")
        if weight is not None:
            return weight.dequantize(), weight
    dense = _dequantize_columns(codes, zeros, scales_t, groups)
    order = contiguous_order(groups, scales_t.shape[1])
    if order is not None and report is not None:   # desc_act: the inputs sorted by group
        weight = block_weight(codes[:, order].contiguous(), zeros.contiguous(), scales_t, f"GPTQ-int{bits}-act")
        if weight is not None:
            report.orders[name] = order
            return weight.dequantize()[:, torch.argsort(order)], weight
    return dense, None


def contiguous_order(groups: torch.Tensor, num_groups: int) -> torch.Tensor | None:
    """The input order that makes each group's inputs contiguous (group 0's first), where every group
    has the same number of inputs (GPTQ's act-order g_idx); else None."""
    columns = groups.numel()
    if num_groups <= 0 or columns % num_groups:
        return None
    order = torch.argsort(groups, stable=True)
    if not torch.equal(groups[order], torch.arange(columns) // (columns // num_groups)):
        return None
    return order


def _awq(parts: dict[str, torch.Tensor], spec: QuantSpec, name: str,
         report: LoadReport | None = None) -> tuple[torch.Tensor, BlockWeight | None]:
    bits = spec.bits or 4
    per_word = 32 // bits
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    outputs = qweight.shape[1] * per_word
    order = (torch.arange(outputs).view(-1, per_word)[:, list(_AWQ_REVERSE_ORDER)]).reshape(-1)
    codes = unpack_dense(qweight, bits, outputs, dim=1)[:, order].t().contiguous()   # [N, K]
    zeros = unpack_dense(qzeros, bits, outputs, dim=1)[:, order].t().contiguous()    # [N, G]
    weight = block_weight(codes, zeros, scales.float().t().contiguous(), f"AWQ-int{bits}")
    if weight is None:
        raise ValueError(f"{name}: AWQ scales {tuple(scales.shape)} do not split {codes.shape[1]} inputs into groups")
    return weight.dequantize(), weight


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A weight scale (per tensor [1]/[], per row [N]/[N, 1], per group [N, G] or per block
    [ceil(N/bn), ceil(K/bk)]) -> float32 [N, K]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if scale.dim() == 1 or scale.shape[1] == 1:
        if scale.numel() != rows:
            raise ValueError(f"scale {tuple(scale.shape)} does not fit {rows} rows")
        return scale.reshape(rows, 1).expand(rows, cols)
    if block is None:
        if scale.shape[0] == rows and cols % scale.shape[1] == 0:   # per group of one row
            return scale.repeat_interleave(cols // scale.shape[1], dim=1)
        block = (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
    bn, bk = block
    if scale.shape != (math.ceil(rows / bn), math.ceil(cols / bk)):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit a [{rows}, {cols}] weight in {bn}x{bk} blocks")
    return scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def _fp8(parts: dict[str, torch.Tensor], spec: QuantSpec, name: str,
         report: LoadReport | None = None) -> tuple[torch.Tensor, BlockWeight | None]:
    weight = parts["weight"]
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    assert scale is not None
    rows, cols = weight.shape
    return weight.float() * expand_scales(scale, rows, cols, spec.fp8_block), None


def _compressed_tensors(parts: dict[str, torch.Tensor], spec: QuantSpec, name: str,
                        report: LoadReport | None = None) -> tuple[torch.Tensor, BlockWeight | None]:
    scale = parts["weight_scale"]
    zero_point = parts.get("weight_zero_point")
    if "weight_packed" in parts:
        packed = parts["weight_packed"]
        rows, cols = (int(v) for v in parts["weight_shape"].tolist())
        bits = next((b for b in range(1, 9) if math.ceil(cols * b / 32) == packed.shape[1]), None)
        if bits is None:
            raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} does not fit weight_shape {(rows, cols)}")
        offset = 1 << (bits - 1)
        codes = unpack_dense(packed, bits, cols, dim=1) - offset                 # signed [N, K]
        if zero_point is not None and zero_point.dtype == torch.int32 and zero_point.shape[0] != rows:
            zero_point = unpack_dense(zero_point, bits, rows, dim=0) - offset   # packed along the rows
        kind = f"CT-int{bits}"
    else:
        weight = parts["weight"]
        rows, cols = weight.shape
        if weight.dtype in _FP8_DTYPES or weight.is_floating_point():
            return weight.float() * expand_scales(scale, rows, cols, spec.fp8_block), None
        codes, kind = weight.to(torch.int32), "CT-int8"
    scale = scale.float()
    if scale.numel() == 1:
        scale2 = scale.reshape(1, 1).expand(rows, 1).contiguous()
    elif scale.dim() == 1:
        scale2 = scale.reshape(rows, 1)
    else:
        scale2 = scale
    if scale2.shape[0] != rows:   # block strategy on ints: no block weight
        zeros_full = None if zero_point is None else expand_scales(zero_point.float(), rows, cols, spec.fp8_block)
        values = codes.float() - (zeros_full if zeros_full is not None else 0.0)
        return values * expand_scales(scale, rows, cols, spec.fp8_block), None
    zeros2 = None if zero_point is None else zero_point.to(torch.int32).reshape(rows, -1)
    if zeros2 is not None and zeros2.shape[1] == 1 and scale2.shape[1] != 1:
        zeros2 = zeros2.expand(rows, scale2.shape[1])
    group = cols // scale2.shape[1] if cols % scale2.shape[1] == 0 else -1
    groups, plain = _groups_of(parts.get("weight_g_idx"), cols, group if scale2.shape[1] > 1 else -1)
    if plain and group > 0:
        weight = block_weight(codes.contiguous(), zeros2, scale2, kind)
        if weight is not None:
            return weight.dequantize(), weight
    return _dequantize_columns(codes, zeros2, scale2, groups), None


def _bnb_quant_state(parts: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The JSON of a 4-bit module's ``weight.quant_state.bitsandbytes__<type>`` tensor (its type,
    blocksize, dtype, shape and nested settings), or None before it arrived."""
    packed = next((value for key, value in parts.items() if key.startswith("weight.quant_state.")), None)
    if packed is None:
        return None
    state: dict[str, Any] = json.loads(bytes(packed.to(torch.uint8).tolist()).decode("utf-8"))
    return state


def _bitsandbytes(parts: dict[str, torch.Tensor], spec: QuantSpec, name: str,
                  report: LoadReport | None = None) -> tuple[torch.Tensor, BlockWeight | None]:
    weight = parts["weight"]
    if weight.dtype == torch.int8:   # LLM.int8: a scale per output row
        scales = (parts["SCB"].float() * _BNB_INT8_SCALE).reshape(-1, 1)
        block = BlockWeight(weight.contiguous(), scales.contiguous(), None, weight.shape[1], "bnb-int8")
        return block.dequantize(), block
    state = _bnb_quant_state(parts)
    assert state is not None
    absmax = parts["weight.absmax"]
    if "nested_blocksize" in state:
        positions = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        absmax = (parts["weight.nested_quant_map"].float()[absmax.to(torch.int64)]
                  * parts["weight.nested_absmax"].float()[positions])
        absmax = absmax + torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
    shape = [int(size) for size in state["shape"]]
    count = math.prod(shape)
    packed = weight.reshape(-1).to(torch.int32)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:count]
    values = parts["weight.quant_map"].float()[codes.to(torch.int64)]
    values = values * absmax.float()[torch.arange(count) // int(state["blocksize"])]
    return values.reshape(shape).to(getattr(torch, str(state["dtype"]))).float(), None


_REQUIRED = {
    "gptq": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
}
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale_inv", "weight_scale"),
    "fbgemm_fp8": ("weight", "weight_scale"),
    "compressed-tensors": ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                           "weight_g_idx"),
    "bitsandbytes": ("weight", "SCB", *_BNB_4BIT_PARTS),
}
_DROPPED = {"fp8": _FP8_DROPPED, "fbgemm_fp8": _FP8_DROPPED, "compressed-tensors": _CT_DROPPED,
            "gptq": (), "awq": (), "bitsandbytes": ("weight_format",)}
_DEQUANTIZE: dict[str, Callable[..., tuple[torch.Tensor, BlockWeight | None]]] = {
    "gptq": _gptq, "awq": _awq, "fp8": _fp8, "fbgemm_fp8": _fp8, "compressed-tensors": _compressed_tensors,
    "bitsandbytes": _bitsandbytes}


def _status(parts: dict[str, torch.Tensor], spec: QuantSpec) -> str:
    """``ready`` (every expected part), ``enough`` (the minimum; optional parts may still come),
    ``wait`` or ``plain`` (a float weight of a non-quantized module: pass it through)."""
    method = spec.method
    if method == "bitsandbytes":
        return _bnb_status(parts)
    if method in _REQUIRED:
        if not all(part in parts for part in _REQUIRED[method]):
            return "wait"
        return "ready" if (method != "gptq" or not spec.desc_act or "g_idx" in parts) else "enough"
    if method in ("fp8", "fbgemm_fp8"):
        weight = parts.get("weight")
        if weight is not None and weight.dtype not in _FP8_DTYPES:
            return "plain"
        return "ready" if weight is not None and ("weight_scale_inv" in parts or "weight_scale" in parts) else "wait"
    weight = parts.get("weight")
    if weight is not None and weight.is_floating_point() and weight.dtype not in _FP8_DTYPES:
        return "plain"
    if "weight_scale" not in parts or ("weight" not in parts and not {"weight_packed", "weight_shape"} <= set(parts)):
        return "wait"
    optional = (spec.needs_zero_point and "weight_zero_point" not in parts) or (
        spec.needs_g_idx and "weight_g_idx" not in parts)
    return "enough" if optional else "ready"


def _bnb_status(parts: dict[str, torch.Tensor]) -> str:
    weight = parts.get("weight")
    if weight is not None and weight.is_floating_point():
        return "plain"
    if weight is None:
        return "wait"
    if weight.dtype == torch.int8:
        return "ready" if "SCB" in parts else "wait"
    state = _bnb_quant_state(parts)
    needed = {"weight.absmax", "weight.quant_map"} | (
        {"weight.nested_absmax", "weight.nested_quant_map"} if state and "nested_blocksize" in state else set())
    return "ready" if state is not None and needed <= set(parts) else "wait"


def _split_name(name: str, parts: tuple[str, ...]) -> tuple[str, str]:
    """(module prefix, part) of a checkpoint tensor name: the part is the longest of ``parts`` the
    name ends with (bitsandbytes' parts have dots: ``weight.absmax``), else the last component."""
    for part in parts:
        if name.endswith("." + part):
            return name[:-len(part) - 1], part
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


@dataclass
class LoadReport:
    """What ``dequantizing_weights`` did, filled while the stream is consumed."""

    blocks: dict[str, BlockWeight] = field(default_factory=dict)
    """HF ``<module>.weight`` -> its integer codes (GPTQ, AWQ, CT int with whole groups)."""
    dequantized: int = 0
    dense_only: list[str] = field(default_factory=list)
    """Modules with no block weight (FP8, desc_act column orders, groups that do not divide)."""
    dropped: int = 0
    orders: dict[str, torch.Tensor] = field(default_factory=dict)
    """HF ``<module>.weight`` -> the input order of its block weight, where that is not the plain one
    (GPTQ desc_act: inputs sorted by group, so each group is contiguous)."""


def dequantizing_weights(weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], spec: QuantSpec,
                         report: LoadReport | None = None) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """``weights`` with each quantized module's tensors replaced by its float32 ``<module>.weight``
    (see the module docstring); ``report`` collects the block weights."""
    parts_of = tuple(sorted(_PARTS[spec.method], key=len, reverse=True))
    dropped = _DROPPED[spec.method]
    dequantize = _DEQUANTIZE[spec.method]
    report = report if report is not None else LoadReport()

    def emit(prefix: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        name = f"{prefix}.weight"
        try:
            weight, block = dequantize(parts, spec, name, report)
        except (KeyError, ValueError, RuntimeError) as error:
            raise ValueError(f"{name}: cannot dequantize the {spec.method} tensors "
                             f"{sorted(parts)}: {error}") from error
        if block is not None:
            report.blocks[name] = block
        else:
            report.dense_only.append(prefix)
        report.dequantized += 1
        return name, weight

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        emitted: set[str] = set()
        for name, tensor in weights():
            prefix, leaf = _split_name(name, parts_of)
            if leaf in dropped:
                report.dropped += 1
                continue
            if leaf not in parts_of or not prefix:
                yield name, tensor
                continue
            if prefix in emitted:   # an optional part after its module was dequantized without it
                if leaf in ("g_idx", "weight_g_idx") and _groups_of(tensor, tensor.numel(), spec.group or -1)[1]:
                    continue
                raise ValueError(f"{name} comes after {prefix} was dequantized without it; the checkpoint "
                                 f"interleaves its {spec.method} tensors in an order servelm cannot stream")
            parts = pending.setdefault(prefix, {})
            parts[leaf] = tensor
            status = _status(parts, spec)
            if status == "plain":
                del pending[prefix]
                yield from [(f"{prefix}.{key}", value) for key, value in parts.items()]
            elif status == "ready":
                del pending[prefix]
                emitted.add(prefix)
                yield emit(prefix, parts)
        for prefix, parts in pending.items():
            status = _status(parts, spec)
            if status == "enough":
                yield emit(prefix, parts)
            elif status == "plain":
                yield from [(f"{prefix}.{key}", value) for key, value in parts.items()]
            else:
                raise ValueError(f"{prefix}: incomplete {spec.method} tensors in the checkpoint: {sorted(parts)}")
    return stream


def serve_blocks(flag: str, dtype: str, tp_size: int, pp_size: int, device: torch.device,
                 compile_enabled: bool, spec: QuantSpec, *, has_experts: bool = False,
                 is_sharded: bool | None = None, moves_experts: bool = False) -> tuple[bool, str]:
    """(whether the integer codes run on the block routes, why) -- else the dequantized weights serve.

    ``is_sharded``: the model's dense layers are tensor-parallel shards (default: ``tp_size`` > 1;
    False under DP attention, where every rank holds them whole). Sharded, only a MoE model's
    routed experts (``has_experts``) keep their codes (``apply_prequantized_blocks``'
    ``experts_only``). ``moves_experts``: redundant expert slots or EPLB, which copy and move float
    expert stacks."""
    from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel

    if flag == "none":
        return False, "--quantization none: the dequantized weights serve"
    if spec.method == "bitsandbytes" and not spec.integer:
        return False, ("bitsandbytes 4-bit holds table values (nf4/fp4), not integer codes: dequantized to "
                       "the model dtype at load")
    if not spec.integer:
        return False, (f"{spec.method}: dequantized to the model dtype at load (no FP8 GEMM on this CPU "
                       "path; AVX512-FP16/AMX-FP8 routes are not built)")
    if dtype != "auto":
        return False, f"--dtype {dtype} asks for the weights in that dtype: dequantized exactly at load"
    is_sharded = tp_size > 1 if is_sharded is None else is_sharded
    if pp_size > 1:
        return False, ("block routes run at --pipeline-parallel-size 1: dequantized exactly at load, each "
                       "stage loading its layers")
    if is_sharded and not has_experts:
        return False, ("block routes run at --tp-size 1, or on a mixture-of-experts model's routed experts: "
                       "dequantized exactly at load, each rank loading its shard")
    if moves_experts:
        return False, ("--ep-num-redundant-experts / --enable-eplb copy and move float expert stacks: "
                       "dequantized exactly at load")
    if device.type != "cpu":
        return False, f"the block kernels are CPU kernels: dequantized on {device.type}"
    if compile_enabled:
        return False, "--enable-torch-compile compiles dequantized weights"
    if load_kernel() is None:
        return False, f"the block kernel is unavailable ({kernel_status()}): dequantized exactly at load"
    if is_sharded:
        return True, ("each rank's routed experts keep their integer codes on the GGUF block routes (whole "
                      "experts under --ep-size = --tp-size, else the rank's intermediate columns where they "
                      "are whole groups); the tensor-parallel rest is dequantized exactly at load")
    if tp_size > 1:
        return True, ("integer codes served on the GGUF block routes (DP attention: every rank's layers "
                      "whole, its routed experts whole)")
    return True, "integer codes served on the GGUF block routes (group scales split to 32-input blocks)"


def kernel_blocks(blocks: dict[str, BlockWeight]) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """The block weights the kernels take (block 16 or 32: groups that are multiples of 32 split to
    32; others, and inputs not a multiple of 64, stay float), and those left out with why."""
    served: dict[str, BlockWeight] = {}
    others: dict[str, str] = {}
    for name, weight in blocks.items():
        k = weight.codes.shape[1]
        if weight.block % 32 == 0 and k % 64 == 0:
            served[name] = weight.with_block(32)
        elif weight.block == 16 and k % 64 == 0:
            served[name] = weight
        else:
            others[name] = f"{weight.kind} group {weight.block}"
    return served, others


_FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class PermutedInputMethod:
    """Runs a layer's method on its input columns in ``order`` (a desc_act GPTQ layer whose block
    weight holds the inputs sorted by group): ``x[:, order] @ W[:, order].T == x @ W.T``. LoRA deltas
    (added by the layer on the unpermuted input) are unaffected."""

    def __init__(self, inner: Any, order: torch.Tensor) -> None:
        self.inner, self.order = inner, order
        self.name = getattr(inner, "name", "permuted")

    def create_weights(self, layer: Any, input_size: int, output_size: int, dtype: torch.dtype | None) -> None:
        raise NotImplementedError("permuted layers are made from loaded layers")

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None, rows: Any = None) -> torch.Tensor:
        return self.inner.apply(layer, x.index_select(-1, self.order), bias, rows)


def _keep_servable_expert_columns(model: Any, served: dict[str, BlockWeight], input_orders: dict[str, torch.Tensor],
                                  others: dict[str, str]) -> None:
    """Leave out of ``served`` the experts of a layer that holds some intermediate columns of them
    (tensor parallelism, or an expert-parallel group smaller than it) where the block routes could
    not take the rank's down projection: its inputs (the rank's columns) not a multiple of 64 (the
    block kernels' input step: a narrowed down would run only its dense copy), or reordered
    (desc_act: the group-sorted inputs scatter a rank's columns over groups other ranks' columns
    share, so no whole groups make the shard). Those layers serve dequantized, logged; a shard that
    would cut a group is left to ``shard_expert_blocks`` (which dequantizes it too)."""
    from servelm.model.layers.moe import FusedMoE

    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE) or module.intermediate_shard.size == module.full_intermediate_size:
            continue
        shard = module.intermediate_shard
        names = [f"{name}.{expert}.{projection}.weight" for expert in module.checkpoint_experts
                 for projection in ("gate_proj", "up_proj", "down_proj")]
        if any(n in input_orders for n in names if n.endswith("down_proj.weight")):
            why = ("desc_act sorts the down projections' inputs by group, so this rank's columns are no "
                   "whole groups")
        elif shard.size % 64:
            why = f"the block kernels take inputs in multiples of 64, and the rank's down projections have {shard.size}"
        else:
            continue
        for n in names:
            if served.pop(n, None) is not None:
                others[n] = "column shard off the block routes"
        logger.info("%s: experts' intermediate columns %d..%d of %d dequantized: %s", name, shard.start,
                    shard.start + shard.size, module.full_intermediate_size, why)


def model_weight_name(model: Any, name: str) -> str:
    """The name the block routes know checkpoint weight ``name`` by: the model's own rename where it
    has one (Mixtral's ``block_sparse_moe`` -> ``mlp``), an expert's projection as transformers
    names it (``w1`` -> ``gate_proj``)."""
    rename = getattr(model, "weight_name", None)
    return canonical_expert_name(rename(name) if rename is not None else name)


def apply_prequantized_blocks(model: Any, report: LoadReport, label: str,
                              experts_only: bool = False) -> dict[str, Any] | None:
    """Serve ``report``'s block weights on the GGUF block routes (``apply_block_weights``, which checks
    each against the loaded float weight). A layer whose block weight has its inputs reordered
    (desc_act) first gets its float weight's columns in that order and, after, a
    ``PermutedInputMethod``; a fused layer whose shards' orders differ keeps its float weight.
    Checkpoint names are matched as ``model_weight_name`` gives them; MoE layers whose experts all
    have block weights are split into per-expert linears first (``split_block_experts``: a rank's
    whole experts under expert parallelism, or its intermediate columns where they are whole
    groups). ``experts_only``: the model's other layers are tensor-parallel shards, which keep
    their dequantized weights."""
    from servelm.model.gguf.gguf_weights import apply_block_weights, expert_weight_names, split_block_experts
    from servelm.model.layers.linear import LinearBase

    served, others = kernel_blocks({model_weight_name(model, name): block for name, block in report.blocks.items()})
    input_orders = {model_weight_name(model, name): order for name, order in report.orders.items()}
    _keep_servable_expert_columns(model, served, input_orders, others)
    split = split_block_experts(model, served)   # experts' own linears first: their input orders apply to them
    if experts_only:
        experts = expert_weight_names(model, split)
        for name in [name for name in served if name not in experts]:
            del served[name]
            others[name] = "tensor-parallel shard"
    permuted: dict[str, tuple[Any, torch.Tensor]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.weight is None:
            continue
        prefix, _, leaf = module_name.rpartition(".")
        names = [f"{prefix}.{shard}.weight" for shard in _FUSED_SHARDS.get(leaf, ())] or [f"{module_name}.weight"]
        orders = [input_orders.get(name) for name in names]
        if all(order is None for order in orders):
            continue
        first = orders[0]
        if (any(order is None or not torch.equal(order, first) for order in orders)  # type: ignore[arg-type]
                or not all(name in served for name in names)):
            for name in names:
                if served.pop(name, None) is not None:
                    others[name] = "desc_act order differs across the fused shards"
            continue
        assert first is not None
        with torch.no_grad():
            module.weight.data = module.weight.data[:, first].contiguous()
        permuted[module_name] = (module, first)
    summary = apply_block_weights(model, served, others, "int16", check=True, label=label) if served else None
    for module, order in permuted.values():
        module.linear_method = PermutedInputMethod(module.linear_method, order)
    return summary
