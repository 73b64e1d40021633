"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v (none on o)."""

from __future__ import annotations

from servelm.model.architectures.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
