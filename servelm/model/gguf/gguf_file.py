"""GGUF files: metadata -> transformers config, quantized tensors -> HF-named float tensors.

llama.cpp's converter renames tensors and changes some of them; this module undoes that so the
result equals what ``transformers`` loads from the same file (our parity reference):

- names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` and so on
  (``_LAYER_NAMES``); ``ffn_norm`` is the pre-MLP norm, which Gemma 3 calls
  ``pre_feedforward_layernorm`` and the others ``post_attention_layernorm``.
- llama architecture: Q/K rows were permuted from HF's half-split rotary layout to llama.cpp's
  interleaved one (per head: rows ``[a0 b0 a1 b1 ...]`` -> HF ``[a0 a1 ... b0 b1 ...]``);
  ``reverse_llama_permute`` undoes it. Qwen2/Qwen3/Gemma3 are stored unpermuted.
- Gemma: every RMSNorm weight is stored as ``w + 1`` (HF's Gemma norm multiplies by ``1 + w``).
- A file without ``output.weight`` has a tied head: the config says ``tie_word_embeddings=True``
  and no ``lm_head.weight`` is yielded, exactly like a tied HF safetensors checkpoint.
- Mixture of experts (Mixtral: ``llama`` with ``llama.expert_count``; ``qwen3moe``): the router is
  ``ffn_gate_inp`` and each projection's experts are one 3-D tensor ``ffn_{gate,up,down}_exps``
  ``[E, rows, cols]``, yielded as the per-expert tensors of an HF checkpoint
  (``mlp.experts.<e>.gate_proj.weight``; ``expert_tensor_names``). llama.cpp renormalises Qwen3-MoE's
  top-k weights whatever the original config said (``norm_topk_prob=True``, as transformers'
  GGUF loader does too), and a Qwen3-MoE or Qwen2-MoE layer without ``ffn_gate_inp`` is a dense MLP
  (``mlp_only_layers``).
- Qwen2-MoE (``qwen2moe``): the shared expert is ``ffn_{gate,up,down}_shexp`` and its gate
  ``ffn_gate_inp_shexp``; OLMoE (``olmoe``): whole-projection ``attn_q_norm``/``attn_k_norm``. llama.cpp
  runs both without renormalising the top-k and OLMoE without clipping q/k/v, so the config says
  ``norm_topk_prob=False`` (and ``clip_qkv=None``) whatever the original did.
- DeepSeek-V2/V3 (``deepseek2``, converted as MQA over the latent): ``attn_kv_a_mqa``,
  ``attn_kv_a_norm``, ``attn_q_a``/``attn_q_a_norm``/``attn_q_b`` (or ``attn_q``), shared experts
  ``ffn_*_shexp``, V3's routing bias ``exp_probs_b.bias``, dense leading layers
  (``leading_dense_block_count``). ``kv_b_proj`` is stored split for the absorbed form: ``attn_k_b``
  ``[H, kv_lora_rank, nope]`` (transposed) and ``attn_v_b`` ``[H, v, kv_lora_rank]``; ``join_kv_b``
  rebuilds it (older files hold ``attn_kv_b`` whole). A sigmoid gating function (or a routing bias)
  makes the file V3, else V2 (group-limited where it has expert groups). The file keeps one YaRN
  mscale (``yarn_log_multiplier`` = 0.1 x ``mscale_all_dim``), so ``mscale`` = ``mscale_all_dim``,
  as in every released DeepSeek config.

Tensors are dequantized one at a time (float32), so peak memory is one tensor beyond the model.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "olmoe", "deepseek2")

# llama.cpp architecture -> transformers model_type (Gemma 3 GGUFs hold the text backbone only).
_MOE_ARCHITECTURES = ("mixtral", "llama4", "gpt-oss")
"""GGUF architectures of MoE models not loaded yet, refused with their own reason."""
_MOE_FAMILIES = {"llama": "mixtral", "qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "olmoe": "olmoe",
                 "deepseek2": "deepseek2"}
"""Architectures whose files may hold experts (``<arch>.expert_count``) -> the family they are then."""
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                "mixtral": "mixtral", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe",
                "deepseek2": "deepseek_v2"}
_SIGMOID_GATING = 2
"""``<arch>.expert_gating_func`` of sigmoid scores (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)."""

# GGUF metadata key (after "<arch>.") -> config field, per architecture.
_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_ARCH_KEYS = {
    "llama": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "qwen2": _COMMON_KEYS,
    "qwen3": {**_COMMON_KEYS, "attention.key_length": "head_dim"},
    "gemma3": {**_COMMON_KEYS, "attention.key_length": "head_dim",
               "attention.sliding_window": "sliding_window"},
    "mixtral": {**_COMMON_KEYS, "rope.dimension_count": "head_dim", "expert_count": "num_local_experts",
                "expert_used_count": "num_experts_per_tok"},
    "qwen3moe": {**_COMMON_KEYS, "attention.key_length": "head_dim", "expert_count": "num_experts",
                 "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {**_COMMON_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "olmoe": {**_COMMON_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
    # head_count_kv is 1 (MQA over the latent): the HF config's KV heads are the query heads
    "deepseek2": {**{key: name for key, name in _COMMON_KEYS.items() if key != "attention.head_count_kv"},
                  "expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
                  "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
                  "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                  "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
                  "leading_dense_block_count": "first_k_dense_replace", "attention.q_lora_rank": "q_lora_rank",
                  "attention.kv_lora_rank": "kv_lora_rank", "attention.value_length_mla": "v_head_dim",
                  "rope.dimension_count": "qk_rope_head_dim"},
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""A layer's stacked expert tensors ``[E, rows, cols]`` -> the per-expert HF projection."""
_KV_B_HALVES = ("attn_k_b", "attn_v_b")
"""DeepSeek's ``kv_b_proj`` as current llama.cpp stores it, in two 3-D halves (``join_kv_b``)."""
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_DEEPSEEK_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    **{half: "self_attn.kv_b_proj" for half in _KV_B_HALVES},
    "exp_probs_b": "mlp.gate.e_score_correction",   # its ".bias" is HF's "_bias" (gguf_to_hf_name)
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA_LAYER_NAMES, "deepseek2": _DEEPSEEK_LAYER_NAMES}
# Tensors llama.cpp adds that have no HF parameter (recomputed from the config).
_IGNORED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_0-9]+)\.(weight|bias)$")

# GGUF general.file_type -> llama.cpp's name for the quantization mix.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


class GGUFError(ValueError):
    """The GGUF file is unreadable or holds an architecture or tensor we cannot map."""


def gguf_to_hf_name(gguf_name: str, architecture: str) -> str | None:
    """HF parameter name for a llama.cpp tensor name; None for tensors HF does not keep.

    Raises GGUFError for a name this module does not know (better than silently dropping it).
    """
    if gguf_name in _IGNORED:
        return None
    if match := _LAYER_RE.match(gguf_name):
        layer, part, suffix = match.groups()
        names = _LAYER_NAMES_BY_ARCH.get(architecture, _LAYER_NAMES)
        if part in _EXPERT_NAMES and suffix == "weight":
            return f"model.layers.{layer}.mlp.experts.{_EXPERT_NAMES[part]}.weight"
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{suffix}".replace(".e_score_correction.bias",
                                                                           ".e_score_correction_bias")
    elif (match := _GLOBAL_RE.match(gguf_name)) and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise GGUFError(f"unknown GGUF tensor {gguf_name!r} for architecture {architecture!r}")


def layer_part(gguf_name: str) -> str | None:
    """The per-layer part of a tensor name (``blk.3.ffn_up_exps.weight`` -> ``ffn_up_exps``); None
    for a global tensor."""
    match = _LAYER_RE.match(gguf_name)
    return match.group(2) if match else None


def is_expert_stack(gguf_name: str) -> bool:
    """Whether the tensor is a layer's experts stacked ``[E, rows, cols]``."""
    return layer_part(gguf_name) in _EXPERT_NAMES


def is_kv_b_half(gguf_name: str) -> bool:
    """Whether the tensor is one of DeepSeek's two ``kv_b_proj`` halves (``join_kv_b``)."""
    return layer_part(gguf_name) in _KV_B_HALVES


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's ``kv_b_proj`` ``[H * (nope + v), kv_lora_rank]`` (per head: its no-rope key rows, then
    its value rows) from llama.cpp's ``attn_k_b`` ``[H, kv_lora_rank, nope]`` and ``attn_v_b``
    ``[H, v, kv_lora_rank]``."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


def expert_tensor_names(stack_name: str, num_experts: int) -> list[str]:
    """The per-expert HF names of a stacked expert tensor's HF name (``gguf_to_hf_name`` of
    ``ffn_*_exps``): ``...mlp.experts.gate_proj.weight`` -> ``...mlp.experts.<e>.gate_proj.weight``."""
    stem, _, projection = stack_name.rpartition(".experts.")
    return [f"{stem}.experts.{expert}.{projection}" for expert in range(num_experts)]


def reverse_llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (``num_heads``: heads of this projection).

    llama.cpp stores, per head, rows ``reshape(2, head_dim // 2).swapaxes``: the two rotary halves
    interleaved. Works for weights [rows, cols] and biases [rows].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())


def llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's forward permutation (inverse of ``reverse_llama_permute``); used by tests."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())


_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8: string, 9: array handled separately).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (rows first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int    # absolute byte offset in the file
    num_bytes: int


@dataclass
class _StringArray:
    """A string array left unparsed (token lists are large): its position and length."""

    pos: int
    count: int


class GGUFFile:
    """An opened GGUF file: metadata, config, and lazy, dequantized access to its tensors.

    Our own header parser (memory-mapped, ~10-50 ms) replaces ``gguf.GGUFReader``, whose
    constructor turns every token and merge into a field part (2-6 s per start); dequantization
    is the gguf package's ``gguf.quants.dequantize``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._blob = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.fields, self.tensor_infos = self._parse()
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise GGUFError(f"cannot read GGUF file {self.path}: {e}") from e
        self.architecture = str(self.fields.get("general.architecture"))
        has_experts = bool(self.fields.get(f"{self.architecture}.expert_count"))
        if self.architecture in _MOE_ARCHITECTURES or has_experts and self.architecture not in _MOE_FAMILIES:
            raise GGUFError(f"{self.path.name}: a mixture-of-experts GGUF ({self.architecture!r} with experts) "
                            "does not load yet (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE and DeepSeek-V2/V3 "
                            "GGUFs do); its Hugging Face safetensors directory does")
        self.family = _MOE_FAMILIES[self.architecture] if has_experts else self.architecture
        """The model family: the architecture, or the MoE family of one with experts (Mixtral)."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: GGUF architecture {self.architecture!r} is not "
                            f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        return cls(path)

    # -- header parsing -------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        buf = memoryview(self._blob)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (need 2 or later)")
        pos = 24
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_string(buf, pos)
            (value_type,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            fields[key], pos = _read_value(buf, pos, value_type)
        entries = []
        for _ in range(tensor_count):
            name, pos = _read_string(buf, pos)
            (num_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(fields.get("general.alignment", 32))
        data_start = (pos + alignment - 1) // alignment * alignment
        infos = [TensorInfo(name, shape, ggml_type, data_start + offset, _tensor_bytes(shape, ggml_type))
                 for name, shape, ggml_type, offset in entries]
        return fields, infos

    # -- metadata -------------------------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value; string arrays (token lists) come back parsed."""
        value = self.fields.get(key, default)
        if isinstance(value, _StringArray):
            value = _read_string_array(memoryview(self._blob), value)
            self.fields[key] = value
        return value

    @property
    def tensor_names(self) -> list[str]:
        return [info.name for info in self.tensor_infos]

    @property
    def quantization(self) -> str:
        file_type = self.fields.get("general.file_type")
        return _FILE_TYPES.get(file_type, f"file_type {file_type}") if file_type is not None else "unknown"

    @property
    def chat_template(self) -> str | None:
        return self.fields.get("tokenizer.chat_template")

    def token_id(self, token: str) -> int | None:
        """Id of one vocabulary token, or None."""
        tokens = self.metadata("tokenizer.ggml.tokens")
        if not tokens:
            return None
        try:
            return tokens.index(token)
        except ValueError:
            return None

    def config_dict(self) -> dict[str, Any]:
        """The transformers config fields this file defines (same values transformers derives)."""
        arch = self.architecture
        values: dict[str, Any] = {}
        for key, name in _ARCH_KEYS[self.family].items():
            value = self.metadata(f"{arch}.{key}")
            if value is not None:
                values[name] = value
        for key, name in _TOKEN_ID_KEYS.items():
            value = self.metadata(key)
            if value is not None:
                values[name] = value
        if "vocab_size" not in values:
            tokens = self.fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise GGUFError(f"{self.path.name}: no vocab_size and no tokenizer.ggml.tokens")
            values["vocab_size"] = tokens.count if isinstance(tokens, _StringArray) else len(tokens)
        values["tie_word_embeddings"] = "output.weight" not in self.tensor_names
        if self.family in ("qwen3moe", "qwen2moe"):
            values["mlp_only_layers"] = [layer for layer in range(values["num_hidden_layers"])
                                         if f"blk.{layer}.ffn_gate_inp.weight" not in self.tensor_names]
        # llama.cpp always renormalises Qwen3-MoE's top-k, never Qwen2-MoE's or OLMoE's
        values.update(_FIXED_FIELDS.get(self.family, {}))
        if self.family == "qwen2moe":
            values["qkv_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        if self.family == "deepseek2":
            values.update(self._deepseek_fields(values))
        return values

    def _deepseek_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The DeepSeek config fields the metadata gives only indirectly (see the module docstring)."""
        arch = self.architecture
        rope_dim = values["qk_rope_head_dim"]
        qk_dim = self.metadata(f"{arch}.attention.key_length_mla") or self.metadata(f"{arch}.attention.key_length")
        v3 = (self.metadata(f"{arch}.expert_gating_func") == _SIGMOID_GATING
              or any(name.endswith(".exp_probs_b.bias") for name in self.tensor_names))
        fields: dict[str, Any] = {name: value for name, value in _DEEPSEEK_ABSENT.items() if name not in values}
        fields.update({"num_key_value_heads": values["num_attention_heads"], "qk_nope_head_dim": qk_dim - rope_dim,
                       "v_head_dim": values.get("v_head_dim") or self.metadata(f"{arch}.attention.value_length"),
                       "rope_parameters": self._deepseek_rope(values.pop("rope_theta", 10000.0))})
        if v3:
            fields.update(model_type="deepseek_v3", topk_method="noaux_tc", rope_interleave=True)
        else:
            grouped = int(values.get("n_group") or 1) > 1
            fields.update(model_type="deepseek_v2", topk_method="group_limited_greedy" if grouped else "greedy")
        return fields

    def _deepseek_rope(self, theta: float) -> dict[str, Any]:
        arch = self.architecture
        if self.metadata(f"{arch}.rope.scaling.type") != "yarn":
            return {"rope_type": "default", "rope_theta": theta}
        mscale = round((self.metadata(f"{arch}.rope.scaling.yarn_log_multiplier") or 0.0) / 0.1, 6)
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": self.metadata(f"{arch}.rope.scaling.factor"),
                  "original_max_position_embeddings": self.metadata(f"{arch}.rope.scaling.original_context_length"),
                  "mscale": mscale, "mscale_all_dim": mscale}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := self.metadata(f"{arch}.rope.scaling.{key}")) is not None:
                params[name] = value
        return params

    def hf_config(self, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
        """A transformers config for this file, with ``overrides`` applied before construction."""
        values = {**self.config_dict(), **(overrides or {})}
        model_type = values.pop("model_type", _MODEL_TYPES[self.family])
        config = CONFIG_MAPPING[model_type](**values)
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        return config

    def tensors(self, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named float32 tensors, dequantized one at a time, in file order; the HF names in
        ``skip`` are neither read nor dequantized (those served in their own blocks).

        The Q/K un-permutation uses the file's own head counts, never overridden ones. A stacked
        expert tensor comes out as its experts' tensors (skipped when its first expert's name is).
        """
        config = self.config_dict()
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for info in self.tensor_infos:
            name = gguf_to_hf_name(info.name, self.architecture)
            if name is None or name in skip:
                continue
            if is_expert_stack(info.name):
                names = expert_tensor_names(name, info.shape[0])
                if names[0] not in skip:
                    yield from zip(names, self.dequantize(info).unbind(0))
                continue
            if is_kv_b_half(info.name):   # yielded whole once both halves are read
                pending = halves.setdefault(name, {})
                pending[str(layer_part(info.name))] = self.dequantize(info)
                if len(pending) == len(_KV_B_HALVES):
                    yield name, join_kv_b(*(pending.pop(half) for half in _KV_B_HALVES))
                continue
            yield name, self._undo_conversion(info.name, self.dequantize(info), config)

    def dequantize(self, info: TensorInfo) -> torch.Tensor:
        """One tensor as float32 [*shape], copied out of the memory map."""
        from gguf import GGMLQuantizationType

        from servelm.model.gguf.gguf_blocks import dequantize_raw
        raw = self._blob[info.offset:info.offset + info.num_bytes]
        ggml_type = GGMLQuantizationType(info.ggml_type)
        if ggml_type in _PLAIN_DTYPES:
            values = raw.view(_PLAIN_DTYPES[ggml_type]).astype(np.float32)  # astype copies
        elif ggml_type == GGMLQuantizationType.BF16:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = dequantize_raw(raw.reshape(*info.shape[:-1], -1), ggml_type.name)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape))

    def _undo_conversion(self, gguf_name: str, weight: torch.Tensor, config: dict[str, Any]
                         ) -> torch.Tensor:
        if self.architecture == "llama":
            num_heads = config["num_attention_heads"]
            if ".attn_q." in gguf_name:
                return reverse_llama_permute(weight, num_heads)
            if ".attn_k." in gguf_name:
                return reverse_llama_permute(weight, config.get("num_key_value_heads", num_heads))
        if self.architecture == "gemma3" and gguf_name.endswith("norm.weight"):
            return weight - 1.0
        return weight


_FIXED_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3moe": {"norm_topk_prob": True},
    "qwen2moe": {"norm_topk_prob": False},
    "olmoe": {"norm_topk_prob": False, "clip_qkv": None},
}
"""Config fields a family's GGUF always has: what llama.cpp computes for it whatever the original
config said (see the module docstring)."""
_DEEPSEEK_ABSENT = {"q_lora_rank": None, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 0, "n_shared_experts": 0}
"""What a DeepSeek file without the metadata key means to llama.cpp (transformers' defaults differ)."""

_PLAIN_DTYPES: dict[Any, Any] = {}


def _init_plain_dtypes() -> None:
    from gguf import GGMLQuantizationType as T
    _PLAIN_DTYPES.update({T.F32: np.float32, T.F16: np.float16, T.F64: np.float64,
                          T.I8: np.int8, T.I16: np.int16, T.I32: np.int32})


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    num_elements = int(np.prod(shape))
    if num_elements % block_elements:
        raise ValueError(f"tensor of {num_elements} elements is not whole blocks of {block_elements}")
    return num_elements // block_elements * block_bytes


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(buf: memoryview, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type == _STRING:  # skip over it now, parse on demand
        start = pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return _StringArray(start, count), pos
    if element_type in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
        return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
    values = []
    for _ in range(count):
        value, pos = _read_value(buf, pos, element_type)
        values.append(value)
    return values, pos


def _read_string_array(buf: memoryview, array: _StringArray) -> list[str]:
    values, pos = [], array.pos
    for _ in range(array.count):
        value, pos = _read_string(buf, pos)
        values.append(value)
    return values


_init_plain_dtypes()
