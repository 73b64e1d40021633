"""The attention seam: one nn.Module the architectures use, one Protocol each backend implements.

A backend turns a ForwardBatch into its own metadata once per forward (``build_metadata``), then
for every layer writes the new K/V into the paged cache and attends each sequence's new tokens to
its whole context (causal, offset by start_position; within ``sliding_window`` when set).
A non-causal layer (``is_causal=False``, encoders) lets every token see every token of its
sequence; such a sequence is always computed whole in one forward (start_position 0).
A non-causal layer may add a per-head bias to its attention scores (``position_bias``, MPNet's
relative position bias): a function of ``key_position - query_position`` that a backend evaluates
once per forward for all layers sharing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from servelm.model.forward_batch import ForwardBatch


PositionBias = Callable[[torch.Tensor], torch.Tensor]
"""relative positions (key - query) ``[b, Q, C]`` int64 -> additive score bias ``[b, H, Q, C]``.
Must be hashable and fixed for a forward (an nn.Module): backends cache its value per forward."""


class AttentionBackend(Protocol):
    """What an attention backend provides."""

    def build_metadata(self, batch: ForwardBatch) -> Any: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch, position_bias: PositionBias | None = None) -> torch.Tensor: ...


class Attention(nn.Module):
    """Paged attention of one layer: q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H * D]``."""

    latent = False
    """Whether the pool holds one latent row per token whose first ``v_head_dim`` columns are V
    (``LatentAttention``; the runner then allocates a ``LatentKVCache``)."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, is_causal: bool = True, v_head_dim: int | None = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        """V's width per head (and the output's): head_dim unless set (DeepSeek's 128 beside 192)."""
        self.scale = scale
        self.sliding_window = sliding_window
        """Keys at positions > query_position - sliding_window are visible; None: all."""
        self.is_causal = is_causal
        """False: bidirectional over the sequence (BERT); keys after the query are visible too."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        if position_bias is None:
            return batch.attention.forward(q, k, v, self, batch)
        assert not self.is_causal and self.sliding_window is None, "position_bias: non-causal layers only"
        return batch.attention.forward(q, k, v, self, batch, position_bias)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, sliding_window={self.sliding_window}, "
                f"causal={self.is_causal}")


class LatentAttention(Attention):
    """Multi-head latent attention over the latent pool, absorbed form: every query head attends
    to one shared KV row per token, ``latent_dim`` compressed-KV columns then ``rope_dim`` rope-key
    columns; the value is the same row's first ``latent_dim`` columns. q ``[T, H, latent_dim +
    rope_dim]`` (the no-rope query already multiplied into the latent space), latent ``[T, 1,
    latent_dim + rope_dim]`` -> ``[T, H * latent_dim]`` (still to be multiplied out of it)."""

    latent = True

    def __init__(self, layer_id: int, num_heads: int, latent_dim: int, rope_dim: int, scale: float,
                 expanded_dims: tuple[int, int]) -> None:
        super().__init__(layer_id, num_heads, 1, latent_dim + rope_dim, scale, v_head_dim=latent_dim)
        self.expanded_dims = expanded_dims
        """The per-head K and V widths the latent stands for (what an expanded pool would hold)."""

    def forward(self, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch,  # type: ignore[override]
                position_bias: PositionBias | None = None) -> torch.Tensor:
        assert position_bias is None, "latent attention is causal, without a position bias"
        return batch.attention.forward(q, latent, latent[..., :self.v_head_dim], self, batch)
