"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2-VL's text model, M-RoPE positions,
processor and weight names (qwen2_vl.py) with Qwen2.5-VL's vision tower, following transformers.

The tower differs from Qwen2-VL's in four ways:
- RMSNorm (eps 1e-6) in the blocks and the merger, where Qwen2-VL has LayerNorm;
- a gated MLP with biases: ``down(act(gate(x)) * up(x))`` (``intermediate_size``, ``hidden_act``);
- widths named ``hidden_size`` (the tower) and ``out_hidden_size`` (the text model's);
- window attention: the merge units of each image are grouped into windows of
  ``window_size / patch / merge`` units a side (tiling the unit grid from its top left, windows in
  row-major order, units row-major inside a window; the last row/column of windows may be
  partial). The blocks see the patches in that order (rope angles travel with them); a block at
  ``fullatt_block_indexes`` attends over whole images, the others within each window; the merged
  rows are put back in the image's order at the end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelm.model.architectures.common import StackedLinear
from servelm.model.architectures.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen2VLVisionTower, vision_activation
from servelm.model.layers.norm import RMSNorm


class Qwen2_5_VLVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.act = vision_activation(activation)
        self.gate_up_proj = StackedLinear(dim, 2 * hidden_dim, (0, 1))
        """The checkpoint's gate_proj and up_proj (shard ids 0 and 1, STACKED_PARAMS)."""
        self.down_proj = nn.Linear(hidden_dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def window_order(grids: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merge units of all images in window order, and each window's length in patches (see the
    module docstring); ``side`` is a window's side in merge units."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        rows, columns = h // merge, w // merge
        units = torch.arange(t * rows * columns).view(t, rows, columns) + base
        for frame in units:
            for top in range(0, rows, side):
                for left in range(0, columns, side):
                    window = frame[top:top + side, left:left + side].flatten()
                    order.append(window)
                    lengths.append(window.numel() * merge * merge)
        base += t * rows * columns
    return torch.cat(order), lengths


class Qwen2_5_VLVisionTower(Qwen2VLVisionTower):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.window_side = int(config.window_size) // int(config.spatial_merge_size) // int(config.patch_size)
        if self.window_side < 1:
            raise ValueError(f"window_size {config.window_size} is smaller than one merged patch "
                             f"({config.patch_size} x {config.spatial_merge_size} pixels)")
        self.full_attention_blocks = frozenset(int(index) for index in config.fullatt_block_indexes)

    @staticmethod
    def width(config: Any) -> int:
        return int(config.hidden_size)

    @staticmethod
    def out_dim(config: Any) -> int:
        return int(config.out_hidden_size)

    @staticmethod
    def norm(dim: int) -> nn.Module:
        return RMSNorm(dim, eps=1e-6)

    @staticmethod
    def mlp(config: Any) -> nn.Module:
        return Qwen2_5_VLVisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def attention_layout(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        order, windows = window_order(grids, self.merge_size, self.window_side)
        images = [t * h * w for t, h, w in grids]
        return order, [images if index in self.full_attention_blocks else windows for index in range(len(self.blocks))]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2VLForConditionalGeneration with Qwen2.5-VL's vision tower."""

    vision_tower_class = Qwen2_5_VLVisionTower
