"""MPNet encoder (MPNetModel; sentence-transformers checkpoints such as all-mpnet-base-v2).

The blocks are BERT's (``bert.BertLayer``: post-norm, q/k/v/o with biases, GELU FFN) and run
bidirectionally the same way; MPNet differs in three places:

- embeddings: ``LN(word + position)``, no token types; positions start after the padding id like
  RoBERTa: ``position_id = pad_token_id + 1 + index`` (an unpadded prompt; we never pad inputs).
  Hence at most ``max_position_embeddings - pad_token_id - 1`` tokens per input (512).
- a relative position bias added to every layer's attention scores: a learned
  ``[num_buckets, heads]`` table indexed by T5-style bidirectional log buckets of
  ``key_position - query_position`` (half the buckets per direction, exact below a quarter of
  them, logarithmic up to ``max_distance`` 128). One module shared by all layers; the attention
  backend evaluates it once per forward.
- checkpoint names (``attention.attn.{q,k,v,o}``, ``encoder.relative_attention_bias``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from servelm.model.architectures.bert import BertModel
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.embedding import VocabEmbedding

_MAX_DISTANCE = 128


class MPNetEmbeddings(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.position_offset = hf_config.pad_token_id + 1
        self.word_embeddings = VocabEmbedding(hf_config.vocab_size, hidden)
        self.position_embeddings = VocabEmbedding(hf_config.max_position_embeddings, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        positions = batch.positions + self.position_offset
        return self.LayerNorm(self.word_embeddings(batch.input_ids) + self.position_embeddings(positions))


def relative_position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bidirectional log buckets of ``key - query`` (int64) -> bucket ids in [0, num_buckets)."""
    half = num_buckets // 2
    bucket = (relative > 0).long() * half  # keys after the query use the upper half
    distance = relative.abs()
    exact = half // 2
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = torch.clamp(exact + (scaled * (half - exact)).long(), max=half - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """``relative positions [..., Q, C] -> bias [..., H, Q, C]`` (a ``PositionBias``)."""

    def __init__(self, num_buckets: int, num_heads: int, max_distance: int = _MAX_DISTANCE) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads), requires_grad=False)

    def forward(self, relative: torch.Tensor) -> torch.Tensor:
        buckets = relative_position_bucket(relative, self.num_buckets, self.max_distance)
        return self.weight[buckets].movedim(-1, -3)  # [..., Q, C, H] -> [..., H, Q, C]


class MPNetModel(BertModel):
    """``forward(batch) -> hidden [num_tokens, hidden]``, the last layer's output (no LM head)."""

    embeddings_class = MPNetEmbeddings
    layer_names = {
        "attention.attn.q": "q_proj", "attention.attn.k": "k_proj", "attention.attn.v": "v_proj",
        "attention.attn.o": "attention_output", "attention.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm",
    }
    skipped_prefixes = ("pooler.", "lm_head.")  # MPNetModel's pooler, MPNetForMaskedLM's head
    checkpoint_prefixes = ("mpnet.", "model.")

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.position_bias = RelativePositionBias(hf_config.relative_attention_num_buckets,
                                                  hf_config.num_attention_heads)

    def _rename(self, name: str) -> str | None:
        if name.removeprefix("mpnet.") == "encoder.relative_attention_bias.weight":
            return "position_bias.weight"
        return super()._rename(name)
