"""Gemma 3 (text): interleaved sliding-window and global attention layers.

Differences from Llama, all following the HF reference:
- ``layer_types`` (or ``sliding_window_pattern``: every Nth layer global) picks each layer's kind;
  sliding layers see the last ``sliding_window`` positions and use the local rope base
  (``rope_local_base_freq`` / ``rope_parameters["sliding_attention"]``).
- (1 + w) RMSNorm everywhere, per-head q/k norms, norms after attention and around the MLP.
- embeddings scaled by sqrt(hidden) rounded to the model dtype; attention scale
  ``query_pre_attn_scalar ** -0.5``; gelu_pytorch_tanh MLP; tied LM head; optional final softcap.
A multimodal Gemma3Config is served through its ``text_config`` here (vision weights skipped);
gemma3_mm.py adds the vision tower. Rows of ``ForwardBatch.mm_rows`` (image placeholders) take
``ForwardBatch.mm_embeds`` instead of their token embeddings (unscaled, as transformers' merge).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import (
    GatedMLP, embed_tokens_and_images, head_dim_of, load_named_weights, stage_layers, stage_rename)
from servelm.model.architectures.flat_decode import run_layers
from servelm.model.architectures.gemma3_decode import DecodePlan
from servelm.model.attention import Attention
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.layers.linear import QKVParallelLinear, RowParallelLinear
from servelm.model.layers.norm import GemmaRMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, rope_parameters


def gemma3_layer_types(text_config: Any) -> list[str]:
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    pattern = getattr(text_config, "sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(text_config.num_hidden_layers)]


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int, layer_type: str, parallel: ParallelContext) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = config.num_key_value_heads
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, bias=bias,
                                          parallel=parallel)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias,
                                        parallel=parallel, input_shard=self.qkv_proj.q_columns)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        is_sliding = layer_type == "sliding_attention"
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(config, layer_type))
        self.attn = Attention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              scale=config.query_pre_attn_scalar ** -0.5,
                              sliding_window=config.sliding_window if is_sliding else None)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden, batch.lora, batch.rows))  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
        q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v, batch), batch.lora, batch.rows)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, layer_type: str, parallel: ParallelContext) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, layer_type, parallel)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation, parallel=parallel)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), batch), hidden)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden), batch.lora, batch.rows)
        return self.post_feedforward_layernorm(mlp_out, hidden)


class Gemma3Model(nn.Module):
    residual_dtype: torch.dtype | None = None
    """As LlamaModel's: the residual stream's dtype (None: the embedding's)."""

    def __init__(self, config: Any, parallel: ParallelContext) -> None:
        super().__init__()
        # A pipeline stage holds its own layers; the embedding and the final norm only on the first
        # and last stage (None elsewhere).
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size,
                                            scale=config.hidden_size ** 0.5, parallel=parallel)
                             if parallel.is_first_stage else None)
        layer_types = gemma3_layer_types(config)
        self.held_layers = parallel.layer_range(len(layer_types))
        self.layers = stage_layers(len(layer_types), parallel,
                                   lambda i: Gemma3DecoderLayer(config, i, layer_types[i], parallel))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else None

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaModel.forward: ``hidden`` is the previous pipeline stage's output (None: embed)."""
        if self.embed_tokens is not None:
            hidden = embed_tokens_and_images(self.embed_tokens, batch)
        assert hidden is not None, "a later pipeline stage needs the previous stage's hidden states"
        return run_layers(self, DecodePlan, hidden, batch, self.norm)


class Gemma3ForCausalLM(nn.Module):
    """``forward(batch) -> hidden [num_tokens, hidden]``; ``compute_logits(hidden) -> [n, vocab]``."""

    def __init__(self, hf_config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        config = getattr(hf_config, "text_config", None) or hf_config
        self.hf_config = config
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("Gemma attention logit softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("bidirectional Gemma 3 attention is not supported")
        self.parallel = parallel
        self.model = Gemma3Model(config, parallel)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = (LMHead(config.vocab_size, config.hidden_size, tied_to=tied,
                               final_softcap=getattr(config, "final_logit_softcapping", None),
                               parallel=parallel)
                        if parallel.is_last_stage else None)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(batch, hidden)

    def compute_logits(self, hidden: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """``rows``: the forward batch's ``head_rows`` (which logit rows are generation rows), or None."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden, rows)

    def _vision_weight_name(self, name: str) -> str | None:
        """Our name for a vision tower or projector tensor: None, the text model skips them
        (gemma3_mm.py's Gemma3ForConditionalGeneration loads them)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        is_tied = self.lm_head is not None and self.lm_head.is_tied
        num_layers = len(self.model.layers)

        def rename(name: str) -> str | None:
            checkpoint_name = name
            for prefix in ("model.language_model.", "language_model.model."):
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
            name = name.removeprefix("language_model.")
            if "vision_tower" in name or "multi_modal_projector" in name:
                return self._vision_weight_name(checkpoint_name)
            if is_tied and name.startswith("lm_head."):
                return None
            return stage_rename(name, self.parallel, num_layers, self.tie_word_embeddings)

        return load_named_weights(self, weights, rename)
