"""Idefics3 / SmolVLM images: frames, placeholder text and pixels, as transformers'
``Idefics3Processor`` / ``SmolVLMProcessor`` with ``Idefics3ImageProcessorPil`` (the two families'
processors are the same).

- pixels: RGB; the longest side resized to ``size["longest_edge"]`` (the other side keeping the
  aspect ratio, rounded up to even; Lanczos by default); with ``do_image_splitting`` the image is
  resized up to multiples of the frame side ``max_image_size["longest_edge"]`` (the tower's
  ``image_size``) and, when larger than one frame, cut into ``rows x cols`` crops (row-major) plus
  the whole image resized to one frame; without splitting it is resized to one frame. Each frame
  is rescaled and normalized (ImagePreprocessor) to ``[3, S, S]``. Every resize is Pillow's on
  8-bit RGB, as transformers' PIL backend does.
- text: the marker ``<image>`` becomes, for a split image, per row and column
  ``<fake_token_around_image><row_r_col_c>`` + n x ``<image>``, a ``"\\n"`` after each row, then
  ``"\\n<fake_token_around_image><global-img>"`` + n x ``<image>`` + ``<fake_token_around_image>``;
  an unsplit image is the last part only (without the newline). n = (S / patch)**2 / scale**2.
  ``expand_text`` does it on the prompt text (the tokenization then equals transformers');
  ``process`` finds the expanded runs, or expands token ids that name each image with one
  ``<image>`` at the token level (equal to transformers where the newlines do not merge with
  their neighbours into one token).
- spans: one ``ImageSpan`` per frame (``frame`` 0, 1, ...; the digest the image's plus the frame
  number), so the model encodes each frame's n rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from servelm.multimodal.inputs import ImageItem, ImageSpan, MultimodalInputs
from servelm.multimodal.media import to_rgb
from servelm.multimodal.processor import IMAGENET_STANDARD, ImagePreprocessor, image_runs

LANCZOS = 1
MAX_SIDE = 4096
"""transformers' cap on a resized side (``MAX_IMAGE_SIZE``)."""


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The first resize: the longer side to ``longest``, the other by the aspect ratio, rounded up to
    even, then scaled under ``MAX_SIDE``."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def frame_multiple_size(height: int, width: int, frame: int) -> tuple[int, int]:
    """The resize before splitting: both sides up to multiples of ``frame``, the longer side first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / frame) * frame
        height = math.ceil(int(width / aspect) / frame) * frame
    else:
        height = math.ceil(height / frame) * frame
        width = math.ceil(int(height * aspect) / frame) * frame
    return height, width


class Idefics3Processor:
    """Idefics3 / SmolVLM's frames, placeholders and pixels (see the module docstring)."""

    family = "idefics3"

    def __init__(self, hf_config: Any, preprocessor_config: dict[str, Any] | None = None,
                 tokenizer: Any = None) -> None:
        if tokenizer is None:
            raise ValueError("Idefics3/SmolVLM images need the model's tokenizer (its <image>, "
                             "<fake_token_around_image>, <global-img> and <row_r_col_c> tokens)")
        self.tokenizer = tokenizer
        vision = hf_config.vision_config
        config = preprocessor_config or {}
        self.frame = int((config.get("max_image_size") or {}).get("longest_edge") or vision.image_size)
        if self.frame != vision.image_size:
            raise ValueError(f"the image processor's frame side {self.frame} differs from the vision "
                             f"tower's image_size {vision.image_size}")
        self.longest_edge = int((config.get("size") or {}).get("longest_edge") or 4 * self.frame)
        self.do_resize = config.get("do_resize") is not False
        self.split = config.get("do_image_splitting") is not False
        self.tokens_per_frame = (vision.image_size // vision.patch_size) ** 2 // int(hf_config.scale_factor) ** 2
        declared = config.get("image_seq_len")
        if declared and int(declared) != self.tokens_per_frame:
            raise ValueError(f"image_seq_len {declared} != the model's {self.tokens_per_frame} tokens per frame")
        resample = config.get("resample")
        self.resample = LANCZOS if resample is None else int(resample)
        self.preprocess = ImagePreprocessor(
            (self.frame, self.frame), self.resample, float(config.get("rescale_factor") or 1 / 255),
            config.get("image_mean") or IMAGENET_STANDARD, config.get("image_std") or IMAGENET_STANDARD,
            do_resize=False, do_rescale=config.get("do_rescale") is not False,
            do_normalize=config.get("do_normalize") is not False,
            do_convert_rgb=config.get("do_convert_rgb") is not False)
        self.image_token_id = int(hf_config.image_token_id)
        self.fake_token_id = self._token_id("<fake_token_around_image>")
        self.global_token_id = self._token_id("<global-img>")
        self.newline_ids = list(tokenizer.encode("\n", add_special_tokens=False))

    def _token_id(self, text: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if token_id is None or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no {text} token")
        return int(token_id)

    # -- pixels ------------------------------------------------------------------------------
    def frames(self, image: Any) -> tuple[list[Any], int, int]:
        """The image's frames (PIL, each S x S: crops row-major, then the whole image) and the
        crop grid's rows and columns (0, 0: one frame)."""
        from PIL import Image
        resample = Image.Resampling(self.resample)
        if self.preprocess.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            height, width = longest_edge_size(image.height, image.width, self.longest_edge)
            image = image.resize((width, height), resample=resample)
        side = self.frame
        if not self.split:
            return [image.resize((side, side), resample=resample)], 0, 0
        height, width = frame_multiple_size(image.height, image.width, side)
        image = image.resize((width, height), resample=resample)
        if height <= side and width <= side:
            return [image], 0, 0
        rows, columns = height // side, width // side
        crops = [image.crop((column * side, row * side, (column + 1) * side, (row + 1) * side))
                 for row in range(rows) for column in range(columns)]
        return crops + [image.resize((side, side), resample=resample)], rows, columns

    # -- text --------------------------------------------------------------------------------
    def marker_text(self) -> str:
        return str(self.tokenizer.convert_ids_to_tokens(self.image_token_id))

    def image_text(self, rows: int, columns: int) -> str:
        fake, image = "<fake_token_around_image>", self.marker_text()
        whole = f"{fake}<global-img>{image * self.tokens_per_frame}{fake}"
        if rows == 0 and columns == 0:
            return whole
        grid = "".join("".join(f"{fake}<row_{row + 1}_col_{column + 1}>{image * self.tokens_per_frame}"
                               for column in range(columns)) + "\n" for row in range(rows))
        return grid + "\n" + whole

    def expand_text(self, text: str, images: Sequence[ImageItem] = ()) -> str:
        """The prompt text with each ``<image>`` replaced as transformers' processor does (left as
        it is when the count of markers and images differ: ``process`` then says so)."""
        pieces = text.split(self.marker_text())
        if len(pieces) - 1 != len(images):
            return text
        grids = [self.frames(item.image)[1:] for item in images]
        out = pieces[0]
        for (rows, columns), piece in zip(grids, pieces[1:]):
            out += self.image_text(rows, columns) + piece
        return out

    def image_ids(self, rows: int, columns: int) -> list[int]:
        """``image_text``'s token ids, built at the token level."""
        frame = [self.image_token_id] * self.tokens_per_frame
        whole = [self.fake_token_id, self.global_token_id] + frame + [self.fake_token_id]
        if rows == 0 and columns == 0:
            return whole
        ids: list[int] = []
        for row in range(rows):
            for column in range(columns):
                ids += [self.fake_token_id, self._token_id(f"<row_{row + 1}_col_{column + 1}>")] + frame
            ids += self.newline_ids
        return ids + self.newline_ids + whole

    # -- both --------------------------------------------------------------------------------
    def process(self, prompt_token_ids: list[int], images: list[ImageItem]) -> MultimodalInputs:
        """One ``ImageSpan`` per frame over the expanded ids (see the module docstring).
        ValueError when the prompt's markers or placeholder runs do not fit the images."""
        cut = [self.frames(item.image) for item in images]
        ids = list(prompt_token_ids)
        runs = image_runs(ids, self.image_token_id)
        if self.tokens_per_frame > 1 and runs and all(length == 1 for _, length in runs):
            if len(runs) != len(images):
                raise ValueError(f"the prompt names {len(runs)} image(s) (<image>) but {len(images)} were given")
            expanded: list[int] = []
            previous = 0
            for (start, _), (_, rows, columns) in zip(runs, cut):
                expanded += ids[previous:start] + self.image_ids(rows, columns)
                previous = start + 1
            ids = expanded + ids[previous:]
            runs = image_runs(ids, self.image_token_id)
        frames = [(item, index, frame) for item, (frames, _, _) in zip(images, cut)
                  for index, frame in enumerate(frames)]
        if len(runs) != len(frames) or any(length != self.tokens_per_frame for _, length in runs):
            raise ValueError(f"the prompt's image placeholders ({len(runs)} run(s)) do not fit {len(images)} "
                             f"image(s) of {len(frames)} frame(s) of {self.tokens_per_frame} tokens each")
        spans = [ImageSpan(offset=offset, length=length, digest=f"{item.digest}#{index}",
                           pixel_values=self.preprocess(frame), frame=index)
                 for (offset, length), (item, index, frame) in zip(runs, frames)]
        return MultimodalInputs(prompt_token_ids=ids, images=spans)
