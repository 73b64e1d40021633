"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): the Qwen2 text model with M-RoPE plus Qwen2-VL's
vision transformer, following transformers.

- Text: Qwen2 (q/k/v biases) whose rope turns each frequency section with one of three position
  axes (temporal, height, width: ``MRotaryEmbedding``) at ``ForwardBatch.mrope_positions`` (the
  processor's table for the prompt, ``p + delta`` after it; plain positions for text-only
  sequences). Image placeholders attend causally like text (no block mask in this family).
- Vision: patches ``[N, 3 * T * P * P]`` (the processor's layout) -> linear patch embedding (the
  checkpoint's Conv3d, kernel = stride = one patch), blocks of LayerNorm -> attention with 2-D
  rope (height, width axial frequencies) over the image's own patches -> LayerNorm -> MLP; the
  merger LayerNorms each patch, concatenates each ``merge x merge`` block and projects it
  (Linear, GELU, Linear) to the text model's hidden size: one row per placeholder.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.llama import LlamaAttention
from servelm.model.architectures.qwen2 import Qwen2ForCausalLM
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.rotary import MRotaryEmbedding, rope_parameters

_VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class Qwen2VLAttention(LlamaAttention):
    """Qwen2's attention with M-RoPE (the flat decode plan does not know it)."""

    has_flat_decode = False

    def __init__(self, hf_config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, has_qk_norm: bool,
                 parallel: ParallelContext) -> None:
        super().__init__(hf_config, layer_id, qkv_bias, o_bias, has_qk_norm, parallel)
        self.rotary_emb = MRotaryEmbedding(self.rotary_emb.head_dim, rope_parameters(hf_config))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden, batch.lora, batch.rows))
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions
        q, k = self.rotary_emb(positions, q, k, batch.rope_cache)
        return self.o_proj(self.attn(q, k, v, batch), batch.lora, batch.rows)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen2VLVisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)   # [N, H, D]
        dtype = q.dtype
        cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        outputs = []
        for q_image, k_image, v_image in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            attended = F.scaled_dot_product_attention(q_image.transpose(0, 1), k_image.transpose(0, 1),
                                                      v_image.transpose(0, 1), scale=self.head_dim ** -0.5)
            outputs.append(attended.transpose(0, 1).reshape(q_image.shape[0], -1))
        return self.proj(torch.cat(outputs))


class Qwen2VLVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.act = vision_activation(activation)
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _VISION_ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {sorted(_VISION_ACTIVATIONS)})")
    return _VISION_ACTIVATIONS[name]


def layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class Qwen2VLVisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``; the family picks the norm and the MLP."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = Qwen2VLVisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin, lengths)
        return hidden + self.mlp(self.norm2(hidden))


class Qwen2VLPatchEmbed(nn.Module):
    def __init__(self, config: Any, width: int) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, width, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[N, C * T * P * P]`` -> ``[N, width]`` (the convolution over one patch is a matmul)."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class Qwen2VLPatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge_size: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.merged_dim = context_dim * merge_size ** 2
        self.ln_q = norm(context_dim)
        self.mlp = nn.Sequential(nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 nn.Linear(self.merged_dim, out_dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden).view(-1, self.merged_dim))


class Qwen2VLVisionTower(nn.Module):
    """Patches of several images (each ``[h * w, C * T * P * P]`` with its (t, h, w) grid) ->
    per image ``[h * w / merge**2, hidden]``. Qwen2-VL's tower: LayerNorm, a plain MLP, every
    block attending over whole images; subclasses change the width names, norm, MLP and the
    attention layout (``attention_layout``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge_size = config.spatial_merge_size
        width = self.width(config)
        self.patch_embed = Qwen2VLPatchEmbed(config, width)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(width, config.num_heads, self.mlp(config), self.norm)
                                    for _ in range(config.depth))
        self.merger = Qwen2VLPatchMerger(self.out_dim(config), width, config.spatial_merge_size, self.norm)
        head_dim = width // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        half = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        """Not a buffer: model.to(dtype) must never round it."""

    # -- what a family changes ---------------------------------------------------------------
    @staticmethod
    def width(config: Any) -> int:
        return int(config.embed_dim)

    @staticmethod
    def out_dim(config: Any) -> int:
        return int(config.hidden_size)

    @staticmethod
    def norm(dim: int) -> nn.Module:
        return layer_norm(dim)

    @staticmethod
    def mlp(config: Any) -> nn.Module:
        return Qwen2VLVisionMLP(config.embed_dim, int(config.embed_dim * config.mlp_ratio), config.hidden_act)

    def attention_layout(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        """The order of the merge units the blocks see (None: as given) and, per block, the lengths
        of the runs of patches that attend to each other (here: each image)."""
        return None, [[t * h * w for t, h, w in grids]] * len(self.blocks)

    # -- shared ------------------------------------------------------------------------------
    def rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` float32: each patch's (row, column) in merge-block order."""
        merge = self.merge_size
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h)[:, None].expand(h, w)
            columns = torch.arange(w)[None, :].expand(h, w)
            block = (h // merge, merge, w // merge, merge)
            rows = rows.reshape(block).transpose(1, 2).flatten()
            columns = columns.reshape(block).transpose(1, 2).flatten()
            positions.append(torch.stack([rows, columns], dim=-1).repeat(t, 1))
        freqs = torch.cat(positions)[:, :, None].float() * self.inv_freq[None, None, :]   # [N, 2, D/4]
        freqs = freqs.flatten(1)                                                           # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        unit_order, layer_lengths = self.attention_layout(grids)
        hidden = self.patch_embed(patches)
        cos, sin = self.rotary(grids)
        cos, sin = cos.to(hidden.device), sin.to(hidden.device)
        if unit_order is not None:   # whole merge units move, so the merger's groups stay intact
            unit = self.merge_size ** 2
            order = (unit_order[:, None] * unit + torch.arange(unit)).flatten().to(hidden.device)
            hidden, cos, sin = hidden[order], cos[order], sin[order]
        for block, lengths in zip(self.blocks, layer_lengths):
            hidden = block(hidden, cos, sin, lengths)
        merged = self.merger(hidden)
        if unit_order is not None:
            merged = merged[torch.argsort(unit_order).to(merged.device)]
        return list(merged.split([t * h * w // self.merge_size ** 2 for t, h, w in grids]))


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2ForCausalLM's interface (over ``text_config``, M-RoPE attention) plus
    ``encode_images(spans) -> [tokens, hidden] per image``."""

    takes_images = True
    vision_tower_class: type[Qwen2VLVisionTower] = Qwen2VLVisionTower

    def __init__(self, hf_config: Any, parallel: ParallelContext | None = None) -> None:
        text = copy.deepcopy(hf_config.get_text_config())
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not (getattr(text, "rope_parameters", None) or {}).get("mrope_section"):
            raise ValueError(f"a {type(self).__name__} text config names its mrope_section (rope_parameters)")
        if getattr(text, "use_sliding_window", False):
            raise NotImplementedError(f"{type(self).__name__} with use_sliding_window is not supported")
        super().__init__(text, parallel)
        if self.parallel.is_first_stage:   # the tower feeds the first stage's embeddings only
            self.visual = self.vision_tower_class(hf_config.vision_config)
            self.visual.requires_grad_(False)

    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return Qwen2VLAttention(hf_config, layer_id, True, False, False, parallel)

    def encode_images(self, spans: list[Any]) -> list[torch.Tensor]:
        weight = self.visual.patch_embed.proj.weight
        patches = torch.cat([span.pixel_values for span in spans]).to(weight.device, weight.dtype)
        return self.visual(patches, [tuple(span.extra["grid_thw"]) for span in spans])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                elif name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                if name.startswith("visual.") and not self.parallel.is_first_stage:
                    continue   # the tower lives on the first stage
                yield name, tensor
        return super().load_weights(renamed())
