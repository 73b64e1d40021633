"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2); Qwen2 and Qwen3 subclass it.

pre-norm blocks: ``h += o(attn(rope(qkv(norm(h)))))``, ``h += down(act(gate(x)) * up(x))``, final norm.
Class attributes choose the variants: ``qkv_bias``/``o_bias`` (None: the config's
``attention_bias``) and ``has_qk_norm`` (per-head RMSNorm of q and k before rope, Qwen3);
``build_attention``/``build_mlp`` build each layer's parts (the MoE families override them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import (
    GatedMLP, embed_tokens_and_images, head_dim_of, layer_sliding_window, load_named_weights, stage_layers,
    stage_rename)
from servelm.model.architectures.flat_decode import run_layers
from servelm.model.architectures.llama_decode import LlamaDecodePlan
from servelm.model.attention import Attention
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.layers.linear import QKVParallelLinear, RowParallelLinear
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, rope_parameters


class LlamaAttention(nn.Module):
    has_flat_decode = True
    """Whether llama_decode.py's flat plan computes this attention (a subclass with other steps: False)."""

    def __init__(self, hf_config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, has_qk_norm: bool,
                 parallel: ParallelContext) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias,
                                          parallel=parallel)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias, parallel=parallel,
                                        input_shard=self.qkv_proj.q_columns)
        self.has_qk_norm = has_qk_norm
        if has_qk_norm:
            self.q_norm = RMSNorm(head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(hf_config))
        self.attn = Attention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              scale=head_dim ** -0.5,
                              sliding_window=layer_sliding_window(hf_config, layer_id))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden, batch.lora, batch.rows))  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
        if self.has_qk_norm:
            q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache)
        return self.o_proj(self.attn(q, k, v, batch), batch.lora, batch.rows)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP; ``mlp`` is any module called as ``mlp(x, lora)`` (the dense
    GatedMLP, or an MoE block)."""

    def __init__(self, hf_config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        normed, hidden = self.post_attention_layernorm.add_norm(
            self.self_attn(self.input_layernorm(hidden), batch), hidden)
        return hidden + self.mlp(normed, batch.lora, batch.rows)


class LlamaModel(nn.Module):
    residual_dtype: torch.dtype | None = None
    """The residual stream's dtype (``--residual-dtype``; None: the embedding's). The norms take it
    in and give their weight's dtype out; the final norm's output is in the model dtype."""

    def __init__(self, hf_config: Any, parallel: ParallelContext,
                 build_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        # A pipeline stage holds its own layers; the embedding and the final norm only on the first
        # and last stage (None elsewhere).
        self.embed_tokens = (VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel=parallel)
                             if parallel.is_first_stage else None)
        self.held_layers = parallel.layer_range(hf_config.num_hidden_layers)
        self.layers = stage_layers(hf_config.num_hidden_layers, parallel, build_layer)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps) if parallel.is_last_stage else None

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states; on a pipeline stage, the stage's output from the previous
        stage's ``hidden`` (None on the first stage, which embeds ``batch.input_ids``)."""
        if self.embed_tokens is not None:
            hidden = embed_tokens_and_images(self.embed_tokens, batch)
        assert hidden is not None, "a later pipeline stage needs the previous stage's hidden states"
        return run_layers(self, LlamaDecodePlan, hidden, batch, self.norm)


class LlamaForCausalLM(nn.Module):
    """``forward(batch) -> hidden [num_tokens, hidden]``; ``compute_logits(hidden) -> [n, vocab]``."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    has_qk_norm = False

    def __init__(self, hf_config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.hf_config = hf_config
        self.parallel = parallel
        self.model = LlamaModel(hf_config, parallel, lambda i: LlamaDecoderLayer(
            hf_config, self.build_attention(hf_config, i, parallel), self.build_mlp(hf_config, i, parallel)))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = (LMHead(hf_config.vocab_size, hf_config.hidden_size, tied_to=tied, parallel=parallel)
                        if parallel.is_last_stage else None)

    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        """Layer ``layer_id``'s attention (the class attributes choose biases and q/k norms)."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        return LlamaAttention(hf_config, layer_id, qkv_bias, o_bias, self.has_qk_norm, parallel)

    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        """Layer ``layer_id``'s MLP: dense here; the MoE families return their sparse block."""
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act,
                        bias=getattr(hf_config, "mlp_bias", False), parallel=parallel)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(batch, hidden)

    def compute_logits(self, hidden: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """``rows``: the forward batch's ``head_rows`` (which logit rows are generation rows), or None."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        is_tied = self.lm_head is not None and self.lm_head.is_tied
        num_layers, tie = self.hf_config.num_hidden_layers, self.tie_word_embeddings
        return load_named_weights(
            self, weights, lambda name: stage_rename(
                None if is_tied and name.startswith("lm_head.") else name, self.parallel, num_layers, tie))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding window on every layer (handled by layer_sliding_window)."""
