"""Tiny pre-quantized checkpoints written to the formats' published layouts, from their specs.

GPTQ (AutoGPTQ/GPTQModel ``gptq`` v1 and ``gptq_v2`` checkpoint formats) and AWQ (AutoAWQ GEMM)
cannot run on this CPU-only machine (GPTQModel/AutoAWQ need CUDA builds, and transformers loads
neither format without them), so these writers pack the tensors as the formats document them:

- GPTQ: ``qweight`` int32 [K * bits / 32, N], input k = 32/bits * i + j in bits j*bits.. of word
  i (little-endian); ``qzeros`` int32 [G, N * bits / 32], packed along the outputs the same way,
  holding ``zero - 1`` in the v1 format (the off-by-one every v1 reader adds back), ``zero`` in
  v2; ``scales`` fp16 [G, N]; ``g_idx`` int32 [K] (the group of each input; with desc_act, groups
  follow the activation order, so a group's inputs are scattered).
- AWQ GEMM: ``qweight`` int32 [K, N / 8] packed along the outputs, nibble j of each word holding
  column ``[0, 2, 4, 6, 1, 3, 5, 7][j]`` of its 8; ``qzeros`` int32 [G, N / 8] the same; ``scales``
  fp16 [G, N]; w = (q - z) * s.
- FP8 (Qwen/DeepSeek ``quant_method: fp8``): ``weight`` float8_e4m3fn and ``weight_scale_inv``
  float32 per 128x128 block (w ~= fp8 * scale_inv), or a per-tensor ``weight_scale``.
- compressed-tensors pack-quantized: ``weight_packed`` int32 [N, ceil(K * bits / 32)] dense
  little-endian bits of ``q + 2^(bits-1)``, ``weight_scale`` [N, G], ``weight_shape``, and, for
  asymmetric schemes, ``weight_zero_point`` packed along the outputs.

Each writer also returns the dequantized float32 weights computed here from the codes it chose
(not from the packed bytes), the reference the tests hold servelm to.

bitsandbytes checkpoints are made by the library itself (``write_bitsandbytes``: transformers with
BitsAndBytesConfig on bitsandbytes' CPU backend) and its dequantized model is the reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from tests.tiny_models import TINY_MLA_ARCHS, make_tiny_config, perturb_norms_and_biases

QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def make_quant_hf_model(arch: str, hidden: int = 64, intermediate: int = 128, seed: int = 0,
                        **fields: Any) -> Any:
    """A tiny float32 transformers model (``make_tiny_config(arch)`` with these widths and config
    ``fields``), norms and biases perturbed as in tests.tiny_models."""
    config = make_tiny_config(arch)
    config.hidden_size, config.intermediate_size = hidden, intermediate
    for name, value in fields.items():
        setattr(config, name, value)
    if hasattr(config, "head_dim") and arch not in ("qwen3", "gemma3") + TINY_MLA_ARCHS:
        config.head_dim = hidden // config.num_attention_heads
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model, 1.0)
    return model.eval()


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PUBLISHED_EXPERTS = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
"""How a family's published checkpoints name an expert's projections (transformers' per-expert names
otherwise)."""


def expert_weights(model: Any, layer: int) -> dict[str, torch.Tensor]:
    """``model.layers.<layer>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>`` -> float weight [N, K]
    of each expert of a layer whose experts transformers (>= 5) stacks (``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]); empty for a dense layer."""
    experts = getattr(model.model.layers[layer].mlp, "experts", None)
    if experts is None:
        return {}
    out = {}
    for expert, (gate_up, down) in enumerate(zip(experts.gate_up_proj.detach().float(),
                                                 experts.down_proj.detach().float())):
        gate, up = gate_up.chunk(2, dim=0)
        for projection, weight in zip(EXPERT_PROJECTIONS, (gate, up, down)):
            out[f"model.layers.{layer}.mlp.experts.{expert}.{projection}"] = weight.contiguous()
    return out


def quantized_linears(model: Any) -> dict[str, torch.Tensor]:
    """HF module name -> float weight [N, K] of every decoder linear, each MoE expert's projections
    included (transformers' per-expert names; the router stays float, as quantizers leave it)."""
    out = {}
    for layer in range(model.config.num_hidden_layers):
        for leaf in QUANTIZED_LINEARS:
            name = f"model.layers.{layer}.{leaf}"
            if leaf.startswith("mlp.") and not hasattr(model.get_submodule(f"model.layers.{layer}.mlp"), leaf[4:]):
                continue   # an MoE layer
            out[name] = model.get_submodule(name).weight.detach().float()
        out.update(expert_weights(model, layer))
    return out


def published_name(model_type: str, name: str) -> str:
    """A tensor's name as the family's published checkpoints spell it: Mixtral's MoE block is
    ``block_sparse_moe`` and its experts' projections ``w1`` / ``w3`` / ``w2``."""
    projections = _PUBLISHED_EXPERTS.get(model_type)
    if projections is None:
        return name
    stem, sep, rest = name.replace(".mlp.", ".block_sparse_moe.").partition(".experts.")
    fields = rest.split(".")
    if not sep or len(fields) < 2 or fields[1] not in projections:
        return stem + sep + rest
    return ".".join([f"{stem}.experts.{fields[0]}", projections[fields[1]], *fields[2:]])


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, C] -> int32 [R * bits / 32, C]: row 32/bits * i + j in bits j*bits of word i."""
    per = 32 // bits
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows // per, per, cols)
    words = sum(grouped[:, j, :] << (bits * j) for j in range(per))
    return _wrap_int32(words)


def pack_along_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes [R, C] -> int32 [R, C * bits / 32]; nibble j of a word holds column
    ``order[j]`` of its 32/bits (default: column j)."""
    per = 32 // bits
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, cols // per, per)
    if order is not None:
        grouped = grouped[:, :, list(order)]
    words = sum(grouped[:, :, j] << (bits * j) for j in range(per))
    return _wrap_int32(words)


def pack_dense_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, C] -> int32 [R, ceil(C * bits / 32)]: code i at bit i*bits of the row's
    little-endian bit stream (compressed-tensors' pack_to_int32, any width 1..8)."""
    rows, cols = codes.shape
    words = -(-cols * bits // 32)
    bit_stream = ((codes.to(torch.int64)[:, :, None] >> torch.arange(bits)) & 1).reshape(rows, -1)
    bit_stream = torch.nn.functional.pad(bit_stream, (0, words * 32 - bit_stream.shape[1]))
    values = (bit_stream.reshape(rows, words, 32) << torch.arange(32)).sum(-1)
    return _wrap_int32(values)


def rtn_quantize(weight: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, sym: bool,
                 min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest min/max quantization of ``weight`` [N, K] with column groups ``groups`` [K]:
    (codes [N, K] in 0..2^bits-1, zeros [N, G], scales [N, G] float16), w ~= (q - z[g]) * s[g].
    ``min_zero``: lowest zero point (1 for GPTQ v1, whose stored ``zero - 1`` must not wrap)."""
    maxq = 2 ** bits - 1
    n = weight.shape[0]
    zeros = torch.zeros(n, num_groups, dtype=torch.int64)
    scales = torch.zeros(n, num_groups)
    for g in range(num_groups):
        columns = weight[:, groups == g]
        low = columns.amin(1).clamp(max=0)
        high = columns.amax(1).clamp(min=0)
        if sym:
            amax = torch.maximum(low.abs(), high).clamp(min=1e-6)
            scales[:, g] = 2 * amax / maxq
            zeros[:, g] = (maxq + 1) // 2
        else:
            scales[:, g] = ((high - low) / maxq).clamp(min=1e-6)
            zeros[:, g] = torch.round(-low / scales[:, g]).to(torch.int64).clamp(min_zero, maxq)
    scales = scales.half()
    codes = torch.clamp(torch.round(weight / scales.float()[:, groups]) + zeros[:, groups], 0, maxq).to(torch.int64)
    return codes, zeros, scales


def dequantize_reference(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         groups: torch.Tensor) -> torch.Tensor:
    """The formats' documented dequantization in float32: (q - z[g(k)]) * s[g(k)]."""
    return (codes - zeros[:, groups]).float() * scales.float()[:, groups]


def _save(path: Path, model: Any, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _save_tensors(path, model, tensors)


def _save_tensors(path: Path, model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """``model.safetensors`` with the tensors under the family's published names."""
    save_file({published_name(model.config.model_type, name): tensor.contiguous() for name, tensor in tensors.items()},
              str(path / "model.safetensors"))


_EXPERT_STACKS = (".experts.gate_up_proj", ".experts.down_proj")


def _float_state(model: Any, skip: set[str]) -> dict[str, torch.Tensor]:
    """The model's tensors but the quantized linears' weights (``skip``), MoE expert stacks (written
    per expert) and a tied head."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
            if (name.rsplit(".", 1)[0] not in skip or not name.endswith(".weight"))
            and not name.endswith(_EXPERT_STACKS) and not (tied and name == "lm_head.weight")}


def reference_model(model: Any, weights: dict[str, torch.Tensor]) -> Any:
    """A copy of ``model`` whose linears hold ``weights`` (the dequantized reference); an expert's
    projection (``...mlp.experts.<e>.<gate_proj|up_proj|down_proj>``) goes to its rows of the stacks."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in weights.items():
            stem, sep, rest = name.partition(".experts.")
            if not sep:
                reference.get_submodule(name).weight.copy_(weight)
                continue
            expert, projection = rest.split(".")
            experts = reference.get_submodule(f"{stem}.experts")
            if projection == "down_proj":
                experts.down_proj[int(expert)].copy_(weight)
            else:
                experts.gate_up_proj[int(expert)].chunk(2, dim=0)[EXPERT_PROJECTIONS.index(projection)].copy_(weight)
    return reference.eval()


def write_gptq(path: Path, model: Any, bits: int = 4, group: int = 32, sym: bool = True,
               desc_act: bool = False, v2: bool = False, seed: int = 0,
               shared_order: bool = True, experts_only: bool = False) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GPTQ checkpoint; returns the dequantized reference weights.
    ``shared_order``: with desc_act, the projections of one input share its order (else each its own).
    ``experts_only``: only the MoE experts' projections quantized, the rest float (as a quantizer's
    per-module exclusions leave them)."""
    generator = torch.Generator().manual_seed(seed)
    linears = {name: weight for name, weight in quantized_linears(model).items()
               if not experts_only or ".experts." in name}
    tensors = _float_state(model, set(linears))
    reference = {}
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for name, weight in linears.items():
        n, k = weight.shape
        size = k if group == -1 else group
        num_groups = k // size
        if desc_act:   # the activation order: groups of consecutive positions in a random permutation,
            # one per layer input (GPTQ orders by the input's Hessian: q/k/v share it, gate/up too)
            source = name.rsplit(".", 1)[0] + ("" if name.endswith(("o_proj", "down_proj")) else
                                              ".in") + ("" if shared_order else name)
            order = orders.setdefault((source, k), torch.randperm(k, generator=generator))
            groups = torch.empty(k, dtype=torch.int64)
            groups[order] = torch.arange(k) // size
        else:
            groups = torch.arange(k) // size
        codes, zeros, scales = rtn_quantize(weight, bits, groups, num_groups, sym, min_zero=0 if v2 else 1)
        reference[name] = dequantize_reference(codes, zeros, scales, groups)
        stored_zeros = zeros if v2 else (zeros - 1) & (2 ** bits - 1)
        tensors[f"{name}.qweight"] = pack_along_rows(codes.t(), bits)                  # [K * b / 32, N]
        tensors[f"{name}.qzeros"] = pack_along_cols(stored_zeros.t().contiguous(), bits)  # [G, N * b / 32]
        tensors[f"{name}.scales"] = scales.t().contiguous()                          # [G, N] fp16
        tensors[f"{name}.g_idx"] = groups.to(torch.int32)
    _save(path, model, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                 "desc_act": desc_act, "sym": sym, "damp_percent": 0.01,
                                 "true_sequential": True, "static_groups": False,
                                 "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    return reference


def write_awq(path: Path, model: Any, group: int = 128, experts_only: bool = False) -> dict[str, torch.Tensor]:
    """Write ``model`` as an AutoAWQ GEMM checkpoint (4-bit, zero points); returns the reference
    (``experts_only``: as ``write_gptq``'s)."""
    linears = {name: weight for name, weight in quantized_linears(model).items()
               if not experts_only or ".experts." in name}
    tensors = _float_state(model, set(linears))
    reference = {}
    for name, weight in linears.items():
        n, k = weight.shape
        groups = torch.arange(k) // group
        codes, zeros, scales = rtn_quantize(weight, 4, groups, k // group, sym=False)
        reference[name] = dequantize_reference(codes, zeros, scales, groups)
        tensors[f"{name}.qweight"] = pack_along_cols(codes.t().contiguous(), 4, AWQ_ORDER)   # [K, N / 8]
        tensors[f"{name}.qzeros"] = pack_along_cols(zeros.t().contiguous(), 4, AWQ_ORDER)    # [G, N / 8]
        tensors[f"{name}.scales"] = scales.t().contiguous()                                 # [G, N]
    _save(path, model, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                 "version": "gemm", "modules_to_not_convert": None})
    return reference


def write_fp8(path: Path, model: Any, block: tuple[int, int] | None = (128, 128)) -> dict[str, torch.Tensor]:
    """Write ``model`` as an FP8 e4m3 checkpoint (``quant_method: fp8``): block-wise
    ``weight_scale_inv`` (Qwen/DeepSeek) or, with ``block`` None, a per-tensor ``weight_scale``."""
    linears = quantized_linears(model)
    tensors = _float_state(model, set(linears))
    reference = {}
    for name, weight in linears.items():
        n, k = weight.shape
        if block is None:
            scale = (weight.abs().amax() / 448.0).reshape(1)
            expanded = scale.reshape(1, 1).expand(n, k)
            tensors[f"{name}.weight_scale"] = scale
        else:
            bn, bk = block
            rows, cols = -(-n // bn), -(-k // bk)
            padded = torch.zeros(rows * bn, cols * bk)
            padded[:n, :k] = weight.abs()
            scale = (padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
            expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            tensors[f"{name}.weight_scale_inv"] = scale
        quantized = (weight / expanded).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = quantized
        reference[name] = quantized.float() * expanded
    config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        config["weight_block_size"] = list(block)
    _save(path, model, tensors, config)
    return reference


def write_ct_pack_quantized(path: Path, model: Any, bits: int = 4, group: int = 32,
                            sym: bool = True) -> dict[str, torch.Tensor]:
    """Write ``model`` as a compressed-tensors pack-quantized checkpoint (int weights, group
    strategy), laid out as compressed-tensors documents it; returns the reference."""
    linears = quantized_linears(model)
    tensors = _float_state(model, set(linears))
    reference = {}
    for name, weight in linears.items():
        n, k = weight.shape
        groups = torch.arange(k) // group
        codes, zeros, scales = rtn_quantize(weight, bits, groups, k // group, sym)
        reference[name] = dequantize_reference(codes, zeros, scales, groups)
        # compressed-tensors' codes and zero points are signed (q - 2^(b-1)) and packed with
        # 2^(b-1) added back: the packed values are these unsigned q and z
        tensors[f"{name}.weight_packed"] = pack_dense_bits(codes, bits)
        tensors[f"{name}.weight_scale"] = scales.float()
        tensors[f"{name}.weight_shape"] = torch.tensor([n, k])
        if not sym:
            tensors[f"{name}.weight_zero_point"] = pack_dense_bits(zeros.t().contiguous(), bits).t().contiguous()
    weights_args = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group,
                    "dynamic": False, "actorder": None, "observer": "minmax"}
    _save(path, model, tensors, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_args, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}})
    return reference


def write_bitsandbytes(path: Path, model: Any, kind: str, double_quant: bool = False) -> None:
    """A bitsandbytes checkpoint made by transformers + bitsandbytes themselves (its CPU backend):
    ``model`` (or the float32 directory it names) loaded with ``BitsAndBytesConfig`` (``kind`` int8,
    nf4 or fp4; ``double_quant``: 4-bit absmax quantized again) and saved as transformers saves it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    source = model if isinstance(model, Path) else path.with_name(path.name + "-float32")
    if not isinstance(model, Path):
        model.save_pretrained(source)
    config = (BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double_quant,
                                 bnb_4bit_compute_dtype=torch.float32))
    quantized = AutoModelForCausalLM.from_pretrained(str(source), quantization_config=config, dtype=torch.float32,
                                                     device_map="cpu")
    quantized.save_pretrained(path)


def bitsandbytes_reference(path: Path) -> Any:
    """The library's dequantized model: transformers loads the bitsandbytes checkpoint and
    ``dequantize()``s it (bitsandbytes' own dequantization) to float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device_map="cpu")
    return model.dequantize(dtype=torch.float32).eval()


def unfused_experts(model: Any) -> Any:
    """A copy of ``model`` whose stacked MoE experts are per-expert ``nn.Linear`` layers
    (``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``), as llm-compressor unfuses them for
    its quantizers, which target Linear layers (only its state dict is used, never its forward)."""
    model = copy.deepcopy(model)
    for layer in range(model.config.num_hidden_layers):
        weights = expert_weights(model, layer)
        experts = torch.nn.ModuleList()
        for expert in range(len(weights) // len(EXPERT_PROJECTIONS)):
            module = torch.nn.Module()
            for projection in EXPERT_PROJECTIONS:
                weight = weights[f"model.layers.{layer}.mlp.experts.{expert}.{projection}"]
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                linear.weight.data.copy_(weight)
                setattr(module, projection, linear)
            experts.append(module)
        if weights:
            model.model.layers[layer].mlp.experts = experts
    return model


def write_ct_with_library(path: Path, model: Any, weights: dict[str, Any], fmt: str,
                          activations: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A compressed-tensors checkpoint made by the library itself: its quantization config applied to
    the model (MoE experts unfused into Linear layers first: ``unfused_experts``), min/max scales
    from its own ``calculate_qparams`` (llm-compressor's minmax observer without calibration data),
    compressed by its ``ModelCompressor`` and saved with its config. Returns the library's own
    decompression of what it wrote (``ModelCompressor.decompress_model``): HF module name (experts
    per expert) -> float32 weight, the reference for ``reference_model``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = unfused_experts(model)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            module_scheme = getattr(module, "quantization_scheme", None)
            if module_scheme is None or module_scheme.weights is None:
                continue
            args, weight = module_scheme.weights, module.weight
            if args.strategy == "group":
                grouped = weight.unflatten(-1, (weight.shape[1] // args.group_size, args.group_size))
                low, high = grouped.amin(-1), grouped.amax(-1)
            elif args.strategy == "channel":
                low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
            else:
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if activations and hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    config_json = json.loads((path / "config.json").read_text())
    config_json.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config_json))
    compressor.update_config(str(path))
    tied = model.config.tie_word_embeddings
    _save_tensors(path, model, {name: tensor.detach() for name, tensor in model.state_dict().items()
                                if not (tied and name == "lm_head.weight")})
    quantized = [name for name, module in model.named_modules() if getattr(module, "quantization_scheme", None)]
    compressor.decompress_model(model)
    return {name: model.get_submodule(name).weight.detach().float().clone() for name in quantized}
