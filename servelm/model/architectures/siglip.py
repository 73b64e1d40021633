"""SigLIP's vision transformer (the image tower of Gemma 3, SmolVLM, ...), following transformers'
``SiglipVisionModel``: a patch convolution plus learned position embeddings, pre-norm encoder
layers (LayerNorm, bidirectional multi-head attention with biases, LayerNorm, fc1 -> activation ->
fc2), a final LayerNorm. ``forward(pixel_values [N, 3, H, W]) -> [N, patches, hidden]``.

The tower is replicated on every tensor-parallel rank and keeps float weights (``--quantization``
converts the text model's LinearBase layers only). q/k/v are one fused projection whose
``weight_loader`` takes the checkpoint's q_proj/k_proj/v_proj (``load_named_weights`` maps them to
``qkv_proj`` with shard ids q, k, v). Images are encoded at the resolution the tower was trained on
(``image_size``); position embeddings are not interpolated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model.architectures.common import StackedLinear

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class SiglipAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = StackedLinear(hidden, 3 * hidden, ("q", "k", "v"))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = hidden.shape
        qkv = self.qkv_proj(hidden).view(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)              # [N, heads, T, D] each
        attended = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(attended.transpose(1, 2).reshape(batch, tokens, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"SigLIP activation {config.hidden_act!r} is not supported "
                             f"(supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, padding="valid")
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"the vision tower encodes {self.image_size}x{self.image_size} images, "
                             f"got {height}x{width}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)   # [N, P, E]
        return patches + self.position_rows()

    def position_rows(self) -> torch.Tensor:
        """``[P, E]``: what each patch adds for its position (here patch i takes row i)."""
        return self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """``[N, 3, H, W] -> [N, patches, hidden]`` (the last hidden state after ``post_layernorm``)."""

    embeddings_class: type[SiglipEmbeddings] = SiglipEmbeddings
    """How pixels become patch rows; a family whose positions differ subclasses it (Idefics3)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = self.embeddings_class(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for a checkpoint tensor under the tower (``vision_tower.`` and what follows,
        with or without transformers' ``vision_model.`` level), or None for the unused pooling head."""
        rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        if rest.startswith("head."):
            return None
        return "vision_tower." + rest
