"""Architecture name (``hf_config.architectures[0]``) -> our nn.Module class, imported lazily.

Every decoder class has ``__init__(hf_config, parallel: ParallelContext | None)`` (this rank's
shard; None: one rank), encoders ``__init__(hf_config)``; every class has
``forward(batch: ForwardBatch) -> hidden [num_tokens, hidden]``, ``compute_logits(hidden [n, hidden]) -> [n, vocab]`` (decoders; encoders in
``ENCODER_ARCHITECTURES`` have none and a ``vocab_size`` attribute instead) and
``load_weights(Iterable[(hf_name, tensor)]) -> set[str]``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),  # SigLIP + text
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),  # SigLIP + Llama
    "SmolVLMForConditionalGeneration": ("idefics3", "SmolVLMForConditionalGeneration"),
    "BertModel": ("bert", "BertModel"),
    "MPNetModel": ("mpnet", "MPNetModel"),
    "MPNetForMaskedLM": ("mpnet", "MPNetModel"),  # the encoder only (no MLM head)
}

ENCODER_ARCHITECTURES = frozenset({"BertModel", "MPNetModel", "MPNetForMaskedLM"})
"""Bidirectional encoders: no LM head (no ``compute_logits``); they serve embeddings only."""

# Configs without ``architectures`` (e.g. built from GGUF metadata) fall back to model_type.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "bert": "BertModel",
    "mpnet": "MPNetModel",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture_name(hf_config: Any) -> str:
    """The architecture we will run for ``hf_config``; ValueError when unsupported."""
    for name in getattr(hf_config, "architectures", None) or []:
        if name in _ARCHITECTURES:
            return name
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"unsupported model architecture {getattr(hf_config, 'architectures', None)} "
                     f"(model_type {model_type!r}); supported: {supported_architectures()}")


def get_model_class(hf_config: Any) -> type[nn.Module]:
    module_name, class_name = _ARCHITECTURES[architecture_name(hf_config)]
    module = importlib.import_module(f"servelm.model.architectures.{module_name}")
    return getattr(module, class_name)
