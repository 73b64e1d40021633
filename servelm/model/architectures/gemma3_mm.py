"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the text model of gemma3.py plus a
SigLIP vision tower and Gemma 3's multi-modal projector, following transformers.

An image ``[3, S, S]`` becomes ``mm_tokens_per_image`` rows of the text model's hidden size:
SigLIP's last hidden state ``[P, E]`` (P = (S / patch)^2 patches), laid back on its
``sqrt(P) x sqrt(P)`` grid and average-pooled to ``sqrt(T) x sqrt(T)`` (T = mm_tokens_per_image),
Gemma's (1 + w) RMSNorm (``mm_soft_emb_norm``), then ``@ mm_input_projection_weight`` ``[E, hidden]``.
Those rows replace the (scaled) token embeddings at the image's placeholder rows
(``ForwardBatch.mm_rows``; the text model does that, gemma3.py); the image's placeholder rows
attend to each other in both directions (``ForwardBatch.images``, the attention backend's mask).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.gemma3 import Gemma3ForCausalLM
from servelm.model.architectures.siglip import SiglipVisionTower
from servelm.model.layers.norm import GemmaRMSNorm


class Gemma3MultiModalProjector(nn.Module):
    """SigLIP rows ``[N, P, E]`` -> ``[N, T, hidden]`` (see the module docstring)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.get_text_config()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.tokens_per_side = int(round(hf_config.mm_tokens_per_image ** 0.5))
        if self.tokens_per_side ** 2 != hf_config.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image {hf_config.mm_tokens_per_image} is not a square")
        if self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"{self.patches_per_side} patches per side do not pool evenly to "
                             f"{self.tokens_per_side} tokens per side")
        self.kernel_size = self.patches_per_side // self.tokens_per_side

    def forward(self, vision_rows: torch.Tensor) -> torch.Tensor:
        num_images, _, width = vision_rows.shape
        grid = vision_rows.transpose(1, 2).reshape(num_images, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel_size, self.kernel_size)
        pooled = pooled.flatten(2).transpose(1, 2).contiguous()   # [N, T, E] (the fused norm takes contiguous rows)
        normed = self.mm_soft_emb_norm(pooled).to(vision_rows.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(vision_rows.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma3ForCausalLM's interface plus ``encode_images(spans) -> [T, hidden] per image``."""

    takes_images = True
    bidirectional_images = True
    """An image's placeholder rows attend to each other in both directions (transformers'
    ``token_type_ids``): the runner builds its passes with that block mask."""

    def __init__(self, hf_config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__(hf_config, parallel)
        self.mm_tokens_per_image = int(hf_config.mm_tokens_per_image)
        if not self.parallel.is_first_stage:   # the tower feeds the first stage's embeddings only
            return
        self.vision_tower = SiglipVisionTower(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)
        for module in (self.vision_tower, self.multi_modal_projector):
            module.requires_grad_(False)   # as the text model's parameters: inference only

    def encode_images(self, spans: list[Any]) -> list[torch.Tensor]:
        """ImageSpans (``pixel_values`` ``[3, S, S]`` each) -> per image the
        ``[mm_tokens_per_image, hidden]`` rows that replace its placeholder embeddings; the images
        go through the tower together."""
        weight = self.vision_tower.post_layernorm.weight
        pixels = torch.stack([span.pixel_values for span in spans]).to(weight.device, weight.dtype)
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def _vision_weight_name(self, name: str) -> str | None:
        if not self.parallel.is_first_stage:
            return None
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            return SiglipVisionTower.checkpoint_name(name)
        if name.startswith("multi_modal_projector."):
            return name
        return None
