"""The model side of an image: placeholder tokens in the prompt and the pixel tensor the tower reads.

``get_processor(model)`` gives the processor of a vision-language model (None for a text model);
``processor.process(prompt_token_ids, images)`` expands each image marker in the prompt into the
image's placeholder tokens and preprocesses its pixels, giving the ``MultimodalInputs`` a
``SubmitRequest`` carries (``inputs.py``). ``supports_images(hf_config)`` answers /props' vision.

Gemma 3 (``Gemma3ForConditionalGeneration``, SigLIP tower), as transformers' Gemma3Processor:
- the prompt names each image with ``<start_of_image>`` (boi); the processor replaces each with
  ``"\\n\\n" + boi + image_token * mm_tokens_per_image + eoi + "\\n\\n"`` (``full_image_sequence``);
  only the ``image_token`` rows are the image's block (its ``token_type_ids`` 1).
  transformers replaces the marker in the prompt *text* and then tokenizes, so the two ``"\\n\\n"``
  may merge with neighbouring newlines into one token; ``expand_text`` does exactly that (then
  ``process`` finds the expanded spans in the tokenized ids). Given unexpanded token ids,
  ``process`` expands at the token level with ``"\\n\\n"``'s own ids, which equals transformers
  wherever the marker's neighbours are not newlines.
- pixels: RGB (alpha composited on white), PIL resize to the processor's ``size`` (bilinear by
  default), ``x * rescale_factor`` in float64 then float32, ``(x - mean) / std`` in float32,
  channels first: bit-identical to ``Gemma3ImageProcessorPil`` (tests/unit/model/test_multimodal_gemma3.py).
  Pan-and-scan crops are not supported (transformers' default is off).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from servelm.multimodal.inputs import ImageItem, ImageSpan, MultimodalInputs
from servelm.multimodal.media import image_digest, to_rgb

MULTIMODAL_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                                      "Qwen2_5_VLForConditionalGeneration", "Idefics3ForConditionalGeneration",
                                      "SmolVLMForConditionalGeneration"})
"""Architectures whose model takes images (servelm.model.architectures.gemma3_mm, qwen2_vl, qwen2_5_vl,
idefics3)."""
_MODEL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
                "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration",
                "smolvlm": "SmolVLMForConditionalGeneration"}
_IDEFICS3 = frozenset({"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"})
_QWEN_VL = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
"""Qwen2-VL and Qwen2.5-VL: one processor (the same image processor, placeholders and M-RoPE table)."""

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def supports_images(hf_config: Any) -> bool:
    """Whether the model of ``hf_config`` takes images (``/props`` ``modalities.vision``)."""
    if getattr(hf_config, "vision_config", None) is None:
        return False
    return _architecture(hf_config) is not None


def _architecture(hf_config: Any) -> str | None:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf_config.model_type]]
    return next((name for name in names if name in MULTIMODAL_ARCHITECTURES), None)


def image_item(image: Any, source: str = "") -> ImageItem:
    """An ``ImageItem`` for a PIL image the caller already holds (the offline Engine, tests): RGB,
    with its digest, as the server's loader (``servelm.multimodal.media``) makes them."""
    rgb = to_rgb(image)
    return ImageItem(image=rgb, digest=image_digest(rgb), source=source)


class ImagePreprocessor:
    """resize, rescale, normalize to a ``[3, H, W]`` float32 tensor: transformers' PIL backend
    (``Gemma3ImageProcessorPil``, ``SiglipImageProcessorPil``) for a fixed output size."""

    def __init__(self, size: tuple[int, int], resample: int = 2, rescale_factor: float = 1 / 255,
                 image_mean: Any = IMAGENET_STANDARD, image_std: Any = IMAGENET_STANDARD,
                 do_resize: bool = True, do_rescale: bool = True, do_normalize: bool = True,
                 do_convert_rgb: bool = True) -> None:
        self.size = size
        """(height, width)."""
        self.resample = resample
        self.rescale_factor = rescale_factor
        self.image_mean = np.array(_per_channel(image_mean), dtype=np.float32)
        self.image_std = np.array(_per_channel(image_std), dtype=np.float32)
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.do_convert_rgb = do_convert_rgb

    @classmethod
    def from_config(cls, config: dict[str, Any], default_size: int) -> ImagePreprocessor:
        """From a ``preprocessor_config.json`` dict (missing keys: transformers' Gemma 3 defaults,
        the size the vision tower's)."""
        size = config.get("size") or {}
        height = size.get("height") or size.get("shortest_edge") or default_size
        width = size.get("width") or size.get("shortest_edge") or default_size
        if config.get("do_pan_and_scan"):
            raise ValueError("Gemma 3 pan-and-scan crops (do_pan_and_scan) are not supported")

        def flag(name: str) -> bool:
            value = config.get(name)
            return True if value is None else bool(value)

        resample = config.get("resample")
        return cls((int(height), int(width)), 2 if resample is None else int(resample),
                   float(config.get("rescale_factor") or 1 / 255),
                   config.get("image_mean") or IMAGENET_STANDARD, config.get("image_std") or IMAGENET_STANDARD,
                   flag("do_resize"), flag("do_rescale"), flag("do_normalize"), flag("do_convert_rgb"))

    def __call__(self, image: Any, size: tuple[int, int] | None = None) -> torch.Tensor:
        """``[3, H, W]`` float32; ``size`` (height, width) replaces the fixed size (dynamic resolution)."""
        from PIL import Image
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            height, width = size or self.size
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        values: np.ndarray = pixels
        if self.do_rescale:   # as transformers: float64 product, then float32
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            if not np.issubdtype(values.dtype, np.floating):
                values = values.astype(np.float32)
            values = (values - self.image_mean.astype(values.dtype)) / self.image_std.astype(values.dtype)
        return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))


def _per_channel(value: Any) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * 3


class Gemma3Processor:
    """Gemma 3's prompt expansion and pixels (see the module docstring)."""

    family = "gemma3"

    def __init__(self, hf_config: Any, preprocessor_config: dict[str, Any] | None = None,
                 tokenizer: Any = None) -> None:
        self.image_token_id = int(hf_config.image_token_id)
        self.boi_token_id = int(hf_config.boi_token_id)
        self.eoi_token_id = int(hf_config.eoi_token_id)
        config = preprocessor_config or {}
        self.tokens_per_image = int(config.get("image_seq_length") or hf_config.mm_tokens_per_image)
        if self.tokens_per_image != hf_config.mm_tokens_per_image:
            raise ValueError(f"image_seq_length {self.tokens_per_image} != the model's mm_tokens_per_image "
                             f"{hf_config.mm_tokens_per_image}")
        self.preprocess = ImagePreprocessor.from_config(config, hf_config.vision_config.image_size)
        image_size = hf_config.vision_config.image_size
        if self.preprocess.size != (image_size, image_size):
            raise ValueError(f"the image processor's size {self.preprocess.size} differs from the vision "
                             f"tower's {image_size}x{image_size}")
        self.tokenizer = tokenizer
        self.newline_ids: list[int] = (list(tokenizer.encode("\n\n", add_special_tokens=False))
                                       if tokenizer is not None else [])
        """``"\\n\\n"``'s token ids, around each expanded image (none without a tokenizer)."""

    # -- text ------------------------------------------------------------------------------
    def marker_text(self) -> str:
        """The string a prompt names an image with (``<start_of_image>``)."""
        return self._token_text(self.boi_token_id)

    def full_image_sequence(self) -> str:
        boi, eoi, image = (self._token_text(t) for t in (self.boi_token_id, self.eoi_token_id, self.image_token_id))
        return f"\n\n{boi}{image * self.tokens_per_image}{eoi}\n\n"

    def expand_text(self, text: str, images: Sequence[ImageItem] = ()) -> str:
        """The prompt text with each image marker replaced as transformers' Gemma3Processor does
        (tokenize the result, then ``process`` it: the ids then equal transformers' exactly); every
        Gemma 3 image has the same sequence, so ``images`` is not read."""
        return text.replace(self.marker_text(), self.full_image_sequence())

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            raise ValueError("expanding prompt text needs the model's tokenizer")
        return str(self.tokenizer.convert_ids_to_tokens(token_id))

    # -- ids -------------------------------------------------------------------------------
    def expand_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """Token-level expansion of every ``<start_of_image>`` (no-op where none)."""
        image = [self.image_token_id] * self.tokens_per_image
        out: list[int] = []
        for token in prompt_token_ids:
            if token == self.boi_token_id:
                out += self.newline_ids + [self.boi_token_id] + image + [self.eoi_token_id] + self.newline_ids
            else:
                out.append(token)
        return out

    def process(self, prompt_token_ids: list[int], images: list[ImageItem]) -> MultimodalInputs:
        """The prompt's ids with each image's placeholder tokens and one ``ImageSpan`` per image,
        in order. ``prompt_token_ids`` either name each image once with ``<start_of_image>`` or
        are already expanded (``expand_text`` then tokenized). ValueError when the count of
        images and markers differ."""
        ids = list(prompt_token_ids)
        if self.image_token_id not in ids:
            markers = ids.count(self.boi_token_id)
            if markers != len(images):
                raise ValueError(f"the prompt names {markers} image(s) (<start_of_image>) but {len(images)} "
                                 "were given")
            ids = self.expand_ids(ids)
        runs = image_runs(ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder block(s) but {len(images)} "
                             "image(s) were given")
        spans = []
        for (offset, length), item in zip(runs, images):
            if length != self.tokens_per_image:
                raise ValueError(f"an image placeholder block has {length} tokens; this model's images "
                                 f"have {self.tokens_per_image}")
            spans.append(ImageSpan(offset=offset, length=length, digest=item.digest,
                                   pixel_values=self.preprocess(item.image)))
        return MultimodalInputs(prompt_token_ids=ids, images=spans)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's output size: both sides multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible (transformers' own rule)."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"an image's aspect ratio must be below 200, got {ratio:.0f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLProcessor:
    """Qwen2-VL's placeholders, pixels and M-RoPE positions, as transformers' Qwen2VLProcessor and
    Qwen2VLImageProcessorPil.

    - the chat template names an image ``<|vision_start|><|image_pad|><|vision_end|>``; the one
      ``<|image_pad|>`` becomes ``grid_h * grid_w / merge**2`` of them (no text around: ids and
      text expansion agree).
    - pixels: ``smart_resize`` to multiples of ``patch * merge`` within [min_pixels, max_pixels],
      PIL bicubic, rescale, CLIP mean/std, then patches ``[grid_h * grid_w, 3 * T * P * P]`` in
      merge-block order, the image repeated over the temporal patch (``ImageSpan.pixel_values``;
      ``extra["grid_thw"]`` = (1, grid_h, grid_w)).
    - positions (``MultimodalInputs.extra``): ``mrope_positions`` ``[3, prompt]`` (text: the same
      index on all three axes; an image: t = start, h = start + row, w = start + column, then text
      resumes at start + max(rows, columns)), and ``mrope_delta`` = max + 1 - prompt length: a
      position p past the prompt rotates at p + delta on all three axes (decode).
    """

    family = "qwen2_vl"

    def __init__(self, hf_config: Any, preprocessor_config: dict[str, Any] | None = None,
                 tokenizer: Any = None) -> None:
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_start_token_id = int(hf_config.vision_start_token_id)
        vision = hf_config.vision_config
        config = preprocessor_config or {}
        self.patch_size = int(config.get("patch_size") or vision.patch_size)
        self.merge_size = int(config.get("merge_size") or vision.spatial_merge_size)
        self.temporal_patch_size = int(config.get("temporal_patch_size") or vision.temporal_patch_size)
        if (self.patch_size, self.merge_size, self.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError("the image processor's patch, merge or temporal patch size differs from the "
                             "vision tower's")
        size = config.get("size") or {}
        self.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        resample = config.get("resample")
        self.preprocess = ImagePreprocessor(
            (0, 0), 3 if resample is None else int(resample), float(config.get("rescale_factor") or 1 / 255),
            config.get("image_mean") or OPENAI_CLIP_MEAN, config.get("image_std") or OPENAI_CLIP_STD,
            config.get("do_resize") is not False, config.get("do_rescale") is not False,
            config.get("do_normalize") is not False, config.get("do_convert_rgb") is not False)
        self.tokenizer = tokenizer

    def marker_text(self) -> str:
        if self.tokenizer is None:
            raise ValueError("the marker text needs the model's tokenizer")
        return str(self.tokenizer.convert_ids_to_tokens(self.image_token_id))

    def expand_text(self, text: str, images: Sequence[ImageItem] = ()) -> str:
        """No text-level step: each ``<|image_pad|>`` is expanded by ``process`` at the id level
        (the pads have no text around them to merge with)."""
        return text

    def pixels(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``[grid_h * grid_w, 3 * T * P * P]`` float32 patches and (1, grid_h, grid_w)."""
        rgb = to_rgb(image) if self.preprocess.do_convert_rgb else image
        factor = self.patch_size * self.merge_size
        height, width = smart_resize(rgb.size[1], rgb.size[0], factor, self.min_pixels, self.max_pixels)
        chw = self.preprocess(rgb, (height, width)).numpy()
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // patch, width // patch
        patches = chw.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)                    # (gh, gw, mh, mw, C, ph, pw)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, patch, patch))
        flat = np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3 * temporal * patch * patch))
        return torch.from_numpy(flat), (1, grid_h, grid_w)

    def process(self, prompt_token_ids: list[int], images: list[ImageItem]) -> MultimodalInputs:
        """Each image's ``<|image_pad|>`` expanded to its placeholder count (ids already expanded
        are kept), one ``ImageSpan`` per image and the M-RoPE positions (see the class docstring)."""
        pixels = [self.pixels(item.image) for item in images]
        counts = [grid[1] * grid[2] // self.merge_size ** 2 for _, grid in pixels]
        runs = image_runs(list(prompt_token_ids), self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt names {len(runs)} image(s) (<|image_pad|>) but {len(images)} were given")
        ids: list[int] = []
        previous = 0
        for (start, length), count in zip(runs, counts):
            if length not in (1, count):
                raise ValueError(f"an image placeholder run has {length} tokens; the image needs {count}")
            ids += list(prompt_token_ids[previous:start]) + [self.image_token_id] * count
            previous = start + length
        ids += list(prompt_token_ids[previous:])
        spans = []
        for (offset, length), item, (values, grid) in zip(image_runs(ids, self.image_token_id), images, pixels):
            spans.append(ImageSpan(offset=offset, length=length, digest=item.digest, pixel_values=values,
                                   extra={"grid_thw": grid}))
        positions, delta = self.mrope_positions(len(ids), spans)
        return MultimodalInputs(prompt_token_ids=ids, images=spans,
                                extra={"mrope_positions": positions, "mrope_delta": delta})

    def mrope_positions(self, num_tokens: int, spans: list[ImageSpan]) -> tuple[torch.Tensor, int]:
        """``[3, num_tokens]`` int64 positions and the delta decode positions carry."""
        pieces = []
        position = 0
        previous = 0
        for span in spans:
            text = span.offset - previous
            pieces.append(torch.arange(text).expand(3, -1) + position)
            position += text
            _, grid_h, grid_w = span.extra["grid_thw"]
            rows, columns = grid_h // self.merge_size, grid_w // self.merge_size
            h_index = torch.arange(rows).repeat_interleave(columns)
            w_index = torch.arange(columns).repeat(rows)
            pieces.append(torch.stack([torch.zeros_like(h_index), h_index, w_index]) + position)
            position += max(rows, columns)
            previous = span.offset + span.length
        pieces.append(torch.arange(num_tokens - previous).expand(3, -1) + position)
        positions = torch.cat(pieces, dim=1).to(torch.int64)
        delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
        return positions, delta


def mrope_positions_for(inputs: MultimodalInputs | None, start: int, count: int) -> torch.Tensor | None:
    """``[3, count]`` M-RoPE positions of positions ``start ..`` of a sequence with ``inputs``
    (prompt positions from its table, later ones p + delta); None without a table."""
    if inputs is None or "mrope_positions" not in inputs.extra:
        return None
    table: torch.Tensor = inputs.extra["mrope_positions"]
    delta = int(inputs.extra["mrope_delta"])
    prompt = table.shape[1]
    end = start + count
    inside = table[:, min(start, prompt):min(end, prompt)]
    if end <= prompt:
        return inside
    after = torch.arange(max(start, prompt), end, dtype=torch.int64).expand(3, -1) + delta
    return torch.cat([inside, after], dim=1)


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for index, value in enumerate(ids + [None]):   # type: ignore[operator]
        if value == token and start is None:
            start = index
        elif value != token and start is not None:
            runs.append((start, index - start))
            start = None
    return runs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as handle:
            loaded = json.load(handle)
    except FileNotFoundError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def get_processor(model: Any, tokenizer: Any = None,
                  hf_config: Any = None) -> Any:
    """The processor of the model at ``model`` (a local directory, or an object with
    ``model_path``/``hf_config`` such as a ModelSource); None when the model takes no images.
    ``preprocessor_config.json`` (and ``processor_config.json``'s ``image_seq_length``) are read
    from the directory where present."""
    path = getattr(model, "model_path", model)
    if hf_config is None:
        hf_config = getattr(model, "hf_config", None)
    if hf_config is None:
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(str(path))
    architecture = _architecture(hf_config) if getattr(hf_config, "vision_config", None) is not None else None
    if architecture is None:
        return None
    config: dict[str, Any] = {}
    if path is not None and Path(str(path)).is_dir():
        config = _read_json(Path(str(path)) / "preprocessor_config.json")
        processor_config = _read_json(Path(str(path)) / "processor_config.json")
        for key in ("image_seq_length", "image_seq_len"):   # Gemma 3's, Idefics3's
            if processor_config.get(key) and not config.get(key):
                config[key] = processor_config[key]
    if architecture in _QWEN_VL:
        return Qwen2VLProcessor(hf_config, config, tokenizer)
    if architecture in _IDEFICS3:
        from servelm.multimodal.idefics3 import Idefics3Processor   # it builds on this module
        return Idefics3Processor(hf_config, config, tokenizer)
    return Gemma3Processor(hf_config, config, tokenizer)
