"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rope, and no qkv bias
(unless the config's ``attention_bias`` asks for it)."""

from __future__ import annotations

from servelm.model.architectures.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    has_qk_norm = True
