"""PEFT LoRA adapters: load, validate against the base model, map onto our fused layers.

Invariants:
- An adapter directory holds ``adapter_config.json`` plus ``adapter_model.safetensors`` (or
  ``adapter_model.bin``), as PEFT writes them. Loading either returns a complete ``LoRAAdapter`` or
  raises ``LoRAAdapterError`` whose message says what is wrong (malformed, rank over the limit, a
  target we cannot serve, a shape that does not match the base model); nothing half-loaded escapes.
- Weights keep PEFT's layout: ``A`` is ``[rank, in_features]``, ``B`` is ``[out_features, rank]``;
  the delta of a target is ``(x @ A.T) @ B.T * scale`` with ``scale = alpha / rank`` (rsLoRA:
  ``alpha / sqrt(rank)``). Per-module ``rank_pattern`` / ``alpha_pattern`` are honoured.
- Targets are HF projection names (q/k/v/o/gate/up/down ``_proj``) or the fused ``qkv_proj`` /
  ``gate_up_proj`` (Phi-3's names, laid out [q; k; v] and [gate; up] as ours); ``FUSED_TARGETS``
  says where each lands in our layers (``qkv_proj`` shard q/k/v or all of it, ``gate_up_proj``
  shard 0/1 or all of it, ``o_proj``, ``down_proj``). An adapter may target any subset of modules
  and layers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from servelm.config import LORA_TARGET_MODULES

SUPPORTED_TARGETS = LORA_TARGET_MODULES
FUSED_TARGETS: dict[str, tuple[str, int | str | None]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None), "qkv_proj": ("qkv_proj", None),
    "gate_up_proj": ("gate_up_proj", None),
}
"""HF projection -> (our layer attribute, shard id inside it; None when the layer is not fused)."""

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?"
                  r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.[^.]+)?\.weight$")
"""A PEFT tensor key of a text model's projection: ``model.layers.N`` of a causal LM, or the text
model of a vision-language model (``model.language_model.layers.N``; ``language_model.model.layers.N``
in older transformers layouts)."""


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must match: layer count and (in, out) features of each projection."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, config: Any) -> BaseShapes:
        text = getattr(config, "text_config", None) or config
        hidden = text.hidden_size
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        inter = text.intermediate_size
        return cls(text.num_hidden_layers, {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim), "gate_up_proj": (hidden, 2 * inter),
        })


@dataclass(frozen=True)
class LoRAWeights:
    """One target of one layer: ``delta = (x @ a.T) @ b.T * scale``."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of any target
    base_model: str | None
    weights: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)
    """(layer index, HF projection name) -> weights."""

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}

    def layer_weights(self, layer: int, module: str) -> LoRAWeights | None:
        return self.weights.get((layer, module))

    def to(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> LoRAAdapter:
        self.weights = {key: LoRAWeights(w.a.to(device, dtype).contiguous(),
                                         w.b.to(device, dtype).contiguous(), w.scale)
                        for key, w in self.weights.items()}
        return self


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a regex matched against the end of the module name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?{pattern}$", key):
            return value
    return default


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: adapter_config.json is not a JSON object")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st_file, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st_file.is_file():
            from safetensors.torch import load_file
            return load_file(str(st_file))
        if bin_file.is_file():
            tensors = torch.load(str(bin_file), map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: adapter_model.bin is not a state dict")
            return tensors
    except LoRAAdapterError:
        raise
    except Exception as exc:  # corrupt files raise many kinds of errors
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: cannot read the weights: {exc}") from exc
    raise LoRAAdapterError(
        f"LoRA adapter {str(path)!r} has neither adapter_model.safetensors nor adapter_model.bin")


def load_adapter(name: str, path: str | Path, base: BaseShapes, max_rank: int) -> LoRAAdapter:
    """Read and validate a PEFT LoRA adapter; raise ``LoRAAdapterError`` saying what is wrong."""
    path = Path(path)
    config = _read_config(path)
    where = f"LoRA adapter {name!r} ({str(path)!r})"
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, unsupported in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                             ("layer_replication", "layer_replication")):
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {unsupported} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    try:
        default_rank = int(config["r"])
        default_alpha = float(config.get("lora_alpha", default_rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise LoRAAdapterError(f"{where}: adapter_config.json needs an integer 'r' and a numeric "
                               f"'lora_alpha'") from exc
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}

    tensors = _read_tensors(path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            if "vision" in key or "multi_modal_projector" in key:
                raise LoRAAdapterError(f"{where}: targets the vision tower or projector ({key}); LoRA "
                                       "applies to the text model of a vision-language model only")
            if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                raise LoRAAdapterError(f"{where}: targets the embeddings or LM head ({key}); only "
                                       f"{', '.join(SUPPORTED_TARGETS)} are supported")
            raise LoRAAdapterError(f"{where}: unexpected tensor {key!r}; only LoRA A/B weights of "
                                   f"{', '.join(SUPPORTED_TARGETS)} are supported")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(f"{where}: target module {module!r} is not supported; supported: "
                                   f"{', '.join(SUPPORTED_TARGETS)}")
        if layer >= base.num_layers:
            raise LoRAAdapterError(f"{where}: targets layer {layer} but the base model has "
                                   f"{base.num_layers} layers (base-model mismatch)")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAAdapterError(f"{where}: no LoRA weights found")

    adapter = LoRAAdapter(name=name, path=str(path), rank=0,
                          base_model=config.get("base_model_name_or_path"))
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has lora_{next(iter(pair))} "
                                   f"but no matching half (malformed adapter)")
        a, b = pair["A"], pair["B"]
        in_features, out_features = base.features[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                                   f"lora_B {tuple(b.shape)} do not form a low-rank pair (malformed)")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAAdapterError(
                f"{where}: layer {layer} {module} maps {a.shape[1]} -> {b.shape[0]} features but the "
                f"base model's maps {in_features} -> {out_features} (base-model mismatch)")
        rank = a.shape[0]
        full_name = f"layers.{layer}.{module}"
        expected = int(_pattern_value(rank_pattern, full_name, default_rank))
        if rank != expected:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has rank {rank} but "
                                   f"adapter_config.json says {expected} (malformed)")
        if rank > max_rank:
            raise LoRAAdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
        alpha = float(_pattern_value(alpha_pattern, full_name, default_alpha))
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        adapter.weights[(layer, module)] = LoRAWeights(a.float(), b.float(), scale)
        adapter.rank = max(adapter.rank, rank)
    return adapter


def lora_delta(x: torch.Tensor, weights: LoRAWeights) -> torch.Tensor:
    """``(x @ A.T) @ B.T * scale`` for the rows of one adapter group."""
    return (x @ weights.a.T) @ weights.b.T * weights.scale
