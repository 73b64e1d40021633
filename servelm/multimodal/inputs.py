"""What a request carries for its images, between the front door and the model (the multimodal seam).

Flow: the server loads and checks each image (``servelm.multimodal.media``: data:/file:/http URLs,
limits) into an ``ImageItem``; the chat template renders the prompt text with the model's image
marker; the model's processor (``servelm.multimodal.processor``) expands each marker into the
image's placeholder tokens and turns the pixels into tensors, giving ``MultimodalInputs``; these
travel in ``SubmitRequest.mm_inputs`` to the engine, which keeps them on the Request, keys the prefix
cache by ``ImageSpan.digest`` over the span's positions, never splits a span across prefill chunks,
and hands the model the spans a forward pass covers (``SequencePlan.images``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageItem:
    """One decoded, checked image (RGB), as the server loaded it."""

    image: Any
    """A PIL.Image.Image in RGB mode."""
    digest: str
    """sha256 hex of the decoded pixels plus size and mode: equal images, equal digest."""
    source: str = ""
    """Where it came from, for errors and logs ("data:", a file path, a URL); never the bytes."""


@dataclass
class ImageSpan:
    """One image's placeholder tokens in the prompt and what the vision tower needs to encode it."""

    offset: int
    """Position of the first placeholder token in the prompt."""
    length: int
    """Number of placeholder tokens (the tower's output rows for this image)."""
    digest: str
    """ImageItem.digest: the prefix cache and the encoder cache key this span by it."""
    pixel_values: Any = None
    """The processor's tensor(s) for this image (a torch.Tensor, or a dict of them per family)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Family-specific data (e.g. Qwen2-VL's grid_thw)."""
    frame: int = 0
    """Which part of its image this span is: a family that cuts an image into frames encoded one by
    one (Idefics3/SmolVLM: crops and the whole image, each its own run of placeholders between
    text tokens) gives one span per frame, numbered from 0; other families one span (0)."""


@dataclass
class MultimodalInputs:
    """The processor's result for one prompt: expanded token ids and one span per image, in order."""

    prompt_token_ids: list[int]
    images: list[ImageSpan] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Family-specific per-prompt data (e.g. M-RoPE position ids)."""

    @property
    def num_image_tokens(self) -> int:
        return sum(span.length for span in self.images)

    @property
    def num_images(self) -> int:
        """Images (not spans: an image cut into frames has one span per frame)."""
        return sum(1 for span in self.images if span.frame == 0)
