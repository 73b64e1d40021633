"""BERT encoder (BertModel; sentence-transformers checkpoints such as all-MiniLM-L6-v2).

post-norm blocks: ``h = LN(h + o(attn(qkv(h))))``, ``h = LN(h + down(gelu(up(h))))``; the input is
``LN(word + position + token_type[0])`` (one segment: every token has type 0). Attention is
bidirectional (``is_causal=False``): every token sees every token of its own prompt, so a prompt
must be computed in one forward from position 0 (the scheduler never chunks or prefix-matches an
embedding request; the attention backend asserts it). The encoder has no LM head: it only embeds.
``forward`` returns the last layer's hidden states; pooling happens in ``servelm.model.pooling``.
MPNet (``mpnet.py``) reuses these layers and model, swapping the embeddings and checkpoint names
and adding a relative position bias shared by all layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model.architectures.common import load_named_weights
from servelm.model.attention import Attention
from servelm.model.attention.base import PositionBias
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.embedding import VocabEmbedding
from servelm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.word_embeddings = VocabEmbedding(hf_config.vocab_size, hidden)
        self.position_embeddings = VocabEmbedding(hf_config.max_position_embeddings, hidden)
        self.token_type_embeddings = VocabEmbedding(max(1, hf_config.type_vocab_size), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        embedded = (self.word_embeddings(batch.input_ids) + self.token_type_embeddings.weight[0]
                    + self.position_embeddings(batch.positions))
        return self.LayerNorm(embedded)


class BertLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_id: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        head_dim = hidden // num_heads
        eps = hf_config.layer_norm_eps
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True)
        self.attn = Attention(layer_id, num_heads, num_heads, head_dim, scale=head_dim ** -0.5,
                              is_causal=False)
        self.attention_output = RowParallelLinear(hidden, hidden, bias=True)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = ColumnParallelLinear(hidden, hf_config.intermediate_size, bias=True)
        self.output = RowParallelLinear(hf_config.intermediate_size, hidden, bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)
        activation = hf_config.hidden_act
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"BERT activation {activation!r} is not supported "
                                      f"(supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[activation]

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # [T, H, D] each
        attended = self.attn(q, k, v, batch, position_bias)
        hidden = self.attention_norm(hidden + self.attention_output(attended))
        return self.output_norm(hidden + self.output(self.act(self.intermediate(hidden))))


# HF module path inside a layer -> ours (q/k/v go through load_named_weights' fused shards).
_LAYER_NAMES = {
    "attention.self.query": "q_proj", "attention.self.key": "k_proj",
    "attention.self.value": "v_proj", "attention.output.dense": "attention_output",
    "attention.output.LayerNorm": "attention_norm", "intermediate.dense": "intermediate",
    "output.dense": "output", "output.LayerNorm": "output_norm",
}
_SKIPPED_PREFIXES = ("pooler.", "cls.")  # BertModel's tanh pooler and MLM heads: never used
_PREFIXES = ("bert.", "model.")


class BertModel(nn.Module):
    """``forward(batch) -> hidden [num_tokens, hidden]``, the last layer's output (no LM head)."""

    # what a subclass (MPNet) changes: its embeddings and its checkpoint's names
    embeddings_class: type[nn.Module] = BertEmbeddings
    layer_names: dict[str, str] = _LAYER_NAMES
    skipped_prefixes: tuple[str, ...] = _SKIPPED_PREFIXES
    checkpoint_prefixes: tuple[str, ...] = _PREFIXES

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
            raise NotImplementedError("BERT with position_embedding_type "
                                      f"{hf_config.position_embedding_type!r} is not supported")
        self.hf_config = hf_config
        self.vocab_size: int = hf_config.vocab_size
        self.embeddings = self.embeddings_class(hf_config)
        self.layers = nn.ModuleList(BertLayer(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.position_bias: nn.Module | None = None  # MPNet: one relative bias for every layer

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embeddings(batch)
        for layer in self.layers:
            hidden = layer(hidden, batch, self.position_bias)
        return hidden

    def _rename(self, name: str) -> str | None:
        for prefix in self.checkpoint_prefixes:
            name = name.removeprefix(prefix)
        if name.startswith(self.skipped_prefixes) or name.endswith("position_ids"):
            return None
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if not name.startswith("encoder.layer."):
            return name
        layer_id, rest = name.removeprefix("encoder.layer.").split(".", 1)
        module, param = rest.rsplit(".", 1)
        if module not in self.layer_names:
            return name  # load_named_weights names the unknown tensor
        return f"layers.{layer_id}.{self.layer_names[module]}.{param}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self._rename)
