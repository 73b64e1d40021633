"""Images at the front door (the HTTP server): which request parts are images, whether this
server takes them, and turning a prompt with images into the engine's ``MultimodalInputs``.

Flow for one request: the route collects ``ImageRef``s (what the client sent, unread) while it
parses the request; ``MultimodalFrontDoor.check`` refuses them at once when the model is text-only,
images are off or there are too many (nothing is read or fetched then); ``load`` reads and checks
them (``servelm.multimodal.media``) off the event loop; ``expand_text`` writes each image's
full token sequence into the prompt text (as transformers' processors do, so the tokenization
matches theirs), and after tokenizing ``expand`` runs the model's image processor, which finds
(or, for token ids sent as such, makes) each image's placeholder tokens and computes its pixels. The expanded token ids are the prompt the engine
sees: the context check, ``usage.prompt_tokens`` and the prefix cache all count image tokens.

The image processor comes from the model side (``servelm.multimodal.processor``) through one
function, ``load_image_processor``; tests pass a fake with the ``ImageProcessor`` shape.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from servelm.config import EngineConfig
from servelm.errors import InvalidRequestError
from servelm.multimodal.inputs import ImageItem, MultimodalInputs
from servelm.multimodal.media import MediaPolicy, load_image

logger = logging.getLogger(__name__)


class ImageProcessor(Protocol):
    """The model's image processor, as the front door uses it (``servelm.multimodal.processor``'s
    Gemma3Processor, Qwen2VLProcessor and Idefics3Processor have this shape)."""

    def marker_text(self) -> str:
        """The text the model's chat template writes for one image (Gemma 3:
        ``<start_of_image>``); --chat-template-content-format string puts it where an image part
        was. ValueError when unknown."""
        ...

    def expand_text(self, text: str, images: list[ImageItem]) -> str:
        """The prompt text with each image marker replaced by the image's full token sequence, as
        transformers' processor does before tokenizing (so the ids equal transformers'); the
        images are there for families whose sequence depends on the image's size (Idefics3)."""
        ...

    def process(self, prompt_token_ids: list[int], images: list[ImageItem]) -> MultimodalInputs:
        """One ``ImageSpan`` per image (per frame for families that cut images), in order, over
        ``prompt_token_ids`` (expanded already by ``expand_text``, or holding one marker per image,
        which it expands), with each image's pixel values. ValueError (a 400) when the markers do not match the images."""
        ...


def load_image_processor(config: EngineConfig, model_path: str | None,
                         tokenizer: Any) -> ImageProcessor | None:
    """The served model's image processor, or None when the model takes no images.

    The one place the model side's processor plugs in (``servelm.multimodal.processor.
    get_processor``: None for a model without a vision tower). A model that is not a local
    checkpoint folder (a GGUF file, a test's fake engine) takes no images.
    """
    if config.multimodal.enable_multimodal is False or tokenizer is None or not model_path:
        return None
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    from servelm.multimodal.processor import get_processor
    processor: ImageProcessor | None = get_processor(model_path, tokenizer)
    if processor is not None and config.multimodal.processor_kwargs:
        raise ValueError("--mm-processor-kwargs: this build's image processors take no "
                         "overrides (they read the model's preprocessor_config.json)")
    return processor


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image a request names, not read yet."""

    source: Any
    """A URL string (data:, file://, http(s)), bare base64 where the API allows it, or a chat
    content part (a dict: its URL is taken out by ``image_ref_from_part`` once images are
    known to be accepted, so a text-only server says so before judging the part's shape)."""
    param: str
    """The request field it came from, for errors (``messages[0].content[1]``)."""
    allow_bare_base64: bool = False


IMAGE_PART_TYPES = ("image_url", "input_image", "image")
"""Content-part types that carry an image (OpenAI chat, the Responses API, vLLM's short form)."""
OTHER_MEDIA_PART_TYPES = ("input_audio", "audio_url", "video_url", "input_file", "file",
                          "image_pil", "image_embeds")


def image_ref_from_part(part: dict[str, Any], param: str) -> ImageRef:
    """The image of a chat content part: ``{"type": "image_url", "image_url": {"url": ...}}``
    (the URL may also be a plain string), or the Responses API's ``{"type": "input_image",
    "image_url": "..."}``."""
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    if part.get("file_id") is not None and value is None:
        raise InvalidRequestError(f"{param}.file_id: uploaded files are not supported; send the "
                                  "image as a data: URL", f"{param}.file_id")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}: an image part needs image_url.url, a data: URL "
                                  "(data:image/png;base64,...) or an http(s) URL", param)
    return ImageRef(value, param)


class MultimodalFrontDoor:
    """Whether and how this server takes images (one per ServingContext)."""

    def __init__(self, config: EngineConfig, processor: ImageProcessor | None,
                 model_name: str, policy: MediaPolicy | None = None) -> None:
        self.enable = config.multimodal.enable_multimodal
        self.processor = processor if self.enable is not False else None
        self.policy = policy if policy is not None else MediaPolicy.from_config(config)
        self.images_per_prompt = config.multimodal.images_per_prompt
        self.model_name = model_name
        if self.enable and processor is None:
            raise ValueError(f"--enable-multimodal: the model {model_name!r} takes no images (it has "
                             "no vision tower servelm can run); leave the flag out to serve it "
                             "text-only")
        if config.multimodal.processor_kwargs and self.processor is None:
            raise ValueError(f"--mm-processor-kwargs: the model {model_name!r} is served without "
                             "images, so there is no image processor to configure")

    @property
    def accepts_images(self) -> bool:
        return self.processor is not None and self.images_per_prompt > 0

    @property
    def image_marker(self) -> str | None:
        """The model's image marker text, or None (text-only, or unknown)."""
        if self.processor is None:
            return None
        try:
            return self.processor.marker_text()
        except ValueError:
            return None

    async def expand_text(self, text: str, images: list[ImageItem]) -> str:
        """The prompt text with its image markers expanded (text-level, as transformers)."""
        if not images or self.processor is None:
            return text
        return await asyncio.to_thread(self.processor.expand_text, text, images)

    def check_accepts(self, param: str) -> None:
        """400 when the request at ``param`` has an image and this server takes none."""
        if self.processor is None:
            how = (" (images are turned off: --no-enable-multimodal)" if self.enable is False
                   else "; serve a vision-language model to send images")
            raise InvalidRequestError(f"{param}: the model {self.model_name!r} is text-only: it "
                                      f"takes no images{how}", param, code="model_not_multimodal")
        if self.images_per_prompt == 0:
            raise InvalidRequestError(f"{param}: this server accepts no images "
                                      "(--limit-mm-per-prompt image=0)", param,
                                      code="too_many_images")

    def check(self, refs: list[ImageRef]) -> None:
        """400 before anything is read: a text-only model, images off, or too many images."""
        if not refs:
            return
        self.check_accepts(refs[0].param)
        if len(refs) > self.images_per_prompt:
            raise InvalidRequestError(
                f"{refs[self.images_per_prompt].param}: this prompt has {len(refs)} images; the "
                f"server accepts at most {self.images_per_prompt} per prompt "
                "(--limit-mm-per-prompt)", refs[self.images_per_prompt].param,
                code="too_many_images")

    async def load(self, refs: list[ImageRef]) -> list[ImageItem]:
        """Read, fetch and decode the images (after ``check``), concurrently, off the event loop."""
        self.check(refs)
        refs = [image_ref_from_part(ref.source, ref.param) if isinstance(ref.source, dict) else ref
                for ref in refs]
        return list(await asyncio.gather(*(
            asyncio.to_thread(load_image, ref.source, self.policy, param=ref.param,
                              allow_bare_base64=ref.allow_bare_base64) for ref in refs)))

    async def expand(self, token_ids: list[int], images: list[ImageItem],
                     param: str) -> MultimodalInputs:
        """The processor's expansion of a tokenized prompt with these images (off the loop)."""
        assert self.processor is not None, "expand() after check() refused a text-only model"
        processor = self.processor
        try:
            result = await asyncio.to_thread(processor.process, list(token_ids), images)
        except ValueError as error:
            raise InvalidRequestError(f"{param}: {error}", param) from None
        if result.num_images != len(images):
            raise InvalidRequestError(
                f"{param}: the prompt places {result.num_images} images but {len(images)} were "
                "sent; the prompt needs one image marker per image", param)
        return result
