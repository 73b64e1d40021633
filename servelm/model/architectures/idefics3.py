"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``):
a SigLIP-style vision tower, a pixel-shuffle connector and the Llama text model, following
transformers (the two families share the model; they differ in checkpoints and defaults only).

The processor (servelm.multimodal.processor.Idefics3Processor) cuts an image into frames of the
tower's ``image_size`` square (crops, then the whole image); each frame is its own ``ImageSpan``
and goes through the tower alone: SigLIP's last hidden state ``[P, E]`` on its ``sqrt(P)`` square
grid -> pixel shuffle by ``scale_factor`` s (each s x s block of patches becomes one row of
``s * s * E``: block row by row, inside a block its rows then columns) -> a linear projection (no
bias) to the text model's hidden size: ``P / s**2`` rows, one per ``<image>`` placeholder. The
text model attends causally (no image block mask in this family).

Positions in the tower: transformers' Idefics3 embeddings take per-patch position ids from a
bucketing of fractional coordinates (made for padded frames). For the full frames the processor
gives they are computed here the same way, once, so rounding at the bucket edges matches too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.llama import LlamaForCausalLM
from servelm.model.architectures.siglip import SiglipEmbeddings, SiglipVisionTower


class Idefics3VisionEmbeddings(SiglipEmbeddings):
    """SigLIP's patch embedding with Idefics3's bucketed position ids (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        side = self.image_size // self.patch_size
        step = 1.0 / torch.tensor([side])   # float32, as transformers computes it
        fractions = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
        buckets = torch.bucketize(fractions, torch.arange(1 / side, 1.0, 1 / side), right=True)
        self.position_ids = (buckets[:, None] * side + buckets[None, :]).flatten()
        """``[P]`` int64; not a buffer (checkpoints have none)."""

    def position_rows(self) -> torch.Tensor:
        return self.position_embedding(self.position_ids.to(self.position_embedding.weight.device))


class Idefics3VisionTower(SiglipVisionTower):
    embeddings_class = Idefics3VisionEmbeddings


class Idefics3Projection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Idefics3Connector(nn.Module):
    """``[N, P, E]`` tower rows -> ``[N, P / s**2, hidden]`` (pixel shuffle, then projection)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.scale = int(hf_config.scale_factor)
        self.side = vision.image_size // vision.patch_size
        if self.side % self.scale:
            raise ValueError(f"{self.side} patches a side do not shuffle by scale_factor {self.scale}")
        self.modality_projection = Idefics3Projection(vision.hidden_size * self.scale ** 2,
                                                      hf_config.get_text_config().hidden_size)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        frames, _, width = rows.shape
        side, scale = self.side, self.scale
        blocks = rows.reshape(frames, side // scale, scale, side // scale, scale, width)
        shuffled = blocks.permute(0, 1, 3, 2, 4, 5).reshape(frames, -1, scale * scale * width)
        return self.modality_projection.proj(shuffled)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """LlamaForCausalLM's interface (over ``text_config``) plus ``encode_images(spans)``: one
    ``[P / s**2, hidden]`` per frame span."""

    takes_images = True

    def __init__(self, hf_config: Any, parallel: ParallelContext | None = None) -> None:
        text = copy.deepcopy(hf_config.get_text_config())
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        super().__init__(text, parallel)
        if not self.parallel.is_first_stage:   # the tower feeds the first stage's embeddings only
            return
        self.vision_model = Idefics3VisionTower(hf_config.vision_config)
        self.connector = Idefics3Connector(hf_config)
        for module in (self.vision_model, self.connector):
            module.requires_grad_(False)

    def encode_images(self, spans: list[Any]) -> list[torch.Tensor]:
        """Frame spans (``pixel_values`` ``[3, S, S]`` each) -> their rows, the frames encoded together."""
        weight = self.vision_model.post_layernorm.weight
        pixels = torch.stack([span.pixel_values for span in spans]).to(weight.device, weight.dtype)
        return list(self.connector(self.vision_model(pixels)).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.text_model."):
                    name = "model." + name.removeprefix("model.text_model.")
                elif name.startswith(("model.vision_model.", "model.connector.")):
                    name = name.removeprefix("model.")
                if name.startswith(("vision_model.", "connector.")) and not self.parallel.is_first_stage:
                    continue   # the tower lives on the first stage
                yield name, tensor
        return super().load_weights(renamed())


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's model under another name (its checkpoints' tensor names are the same)."""
