"""Idefics3 and SmolVLM (SigLIP-style tower + pixel shuffle + the Llama text model) against
transformers, float32, tiny random weights: frames and pixels equal to Idefics3ImageProcessorPil
on generated PNG and JPEG images (one frame, 1 x 2 and 2 x 2 crops plus the whole image, and
without splitting), the prompt equal to Idefics3Processor's, and prefill + decode logits with 0,
1 and 2 images."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")

from servelm.model.forward_batch import BatchPlan  # noqa: E402
from servelm.multimodal.idefics3 import Idefics3Processor  # noqa: E402
from servelm.multimodal.inputs import MultimodalInputs  # noqa: E402
from servelm.multimodal.processor import image_item  # noqa: E402
from tests.tiny_models import (TINY_IDEFICS3_FAMILIES, TINY_IDEFICS3_IMAGE, TINY_IDEFICS3_PIXELS,  # noqa: E402
                               make_tiny_idefics3, random_image, write_tiny_vlm_tokenizer)

from .conftest import POOL_TOKENS, BlockAllocator  # noqa: E402

ATOL = 1e-4
NUM_NEW_TOKENS = 5
SIZES = [(80, 30), (30, 80), (90, 96)]   # (width, height): 1 x 2, 2 x 1 and 2 x 2 crops (+ the whole image)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("idefics3-tokenizer")
    write_tiny_vlm_tokenizer(path, family="idefics3")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module", params=TINY_IDEFICS3_FAMILIES)
def hf_vlm(request: pytest.FixtureRequest) -> Any:
    return make_tiny_idefics3(family=request.param)


@pytest.fixture(scope="module")
def processor(hf_vlm: Any, tokenizer: Any) -> Idefics3Processor:
    return Idefics3Processor(hf_vlm.config, dict(TINY_IDEFICS3_PIXELS), tokenizer)


def encoded(image: Any, fmt: str) -> Any:
    """``image`` written as PNG or JPEG and read back, as a server receives it."""
    from PIL import Image
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return Image.open(io.BytesIO(buffer.getvalue()))


def images(count: int, seed: int = 20) -> list[Any]:
    return [image_item(encoded(random_image(seed + i, *SIZES[i % 3]), "PNG")) for i in range(count)]


@pytest.mark.parametrize("split", [True, False])
def test_frames_equal_transformers_image_processor(hf_vlm: Any, tokenizer: Any, split: bool) -> None:
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    settings = {**TINY_IDEFICS3_PIXELS, "do_image_splitting": split}
    reference = Idefics3ImageProcessorPil(**settings)
    ours = Idefics3Processor(hf_vlm.config, settings, tokenizer)
    expected_grids = [(1, 2), (2, 1), (2, 2), (1, 2)] if split else [(0, 0)] * 4
    for (width, height, mode, fmt), grid in zip([(80, 30, "RGB", "PNG"), (30, 80, "RGBA", "PNG"),
                                                 (90, 96, "RGB", "JPEG"), (300, 3, "L", "JPEG")], expected_grids):
        image = encoded(random_image(width + height, width, height, mode=mode), fmt)
        expected = reference(images=[[image]], return_tensors="pt", return_row_col_info=True)
        frames, rows, columns = ours.frames(image)
        assert (rows, columns) == grid == (expected["rows"][0][0], expected["cols"][0][0])
        pixels = torch.stack([ours.preprocess(frame) for frame in frames])
        assert torch.equal(pixels, expected["pixel_values"][0])


def test_prompt_equals_transformers_processor(processor: Idefics3Processor, tokenizer: Any) -> None:
    from transformers import Idefics3Processor as HFProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    reference = HFProcessor(Idefics3ImageProcessorPil(**TINY_IDEFICS3_PIXELS), tokenizer,
                            image_seq_len=processor.tokens_per_frame)
    text = "User:Look<image>and<image>, then<image>.<end_of_utterance>\nAssistant:"
    items = images(3)
    expected = reference(text=[text], images=[[item.image for item in items]], return_tensors="pt")
    ids = tokenizer.encode(processor.expand_text(text, items), add_special_tokens=False)
    inputs = processor.process(ids, items)
    assert inputs.prompt_token_ids == expected["input_ids"][0].tolist()
    assert torch.equal(torch.stack([span.pixel_values for span in inputs.images]), expected["pixel_values"][0])
    assert [span.frame for span in inputs.images] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]
    assert inputs.num_images == 3
    assert all(inputs.prompt_token_ids[span.offset:span.offset + span.length] == [TINY_IDEFICS3_IMAGE] * 9
               for span in inputs.images)
    # one <image> id per image, expanded at the token level: the same ids
    short = tokenizer.encode(text, add_special_tokens=False)
    assert processor.process(short, items).prompt_token_ids == inputs.prompt_token_ids
    with pytest.raises(ValueError, match="names 3 image"):
        processor.process(short, items[:2])


def prompt_with_images(processor: Idefics3Processor, num_images: int, seed: int = 3) -> MultimodalInputs:
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(10, 290, (n,), generator=generator).tolist() for n in (5, 3, 4)]
    ids = pieces[0]
    for index in range(num_images):
        ids = ids + [TINY_IDEFICS3_IMAGE] + pieces[1 + index % 2]
    return processor.process(ids, images(num_images))


def hf_forward(model: Any, inputs: MultimodalInputs, extra: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([inputs.prompt_token_ids + (extra or [])])
    kwargs: dict[str, Any] = {}
    if inputs.images:
        kwargs["pixel_values"] = torch.stack([span.pixel_values for span in inputs.images])[None]
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits[0].float()


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_prefill_and_decode_logits_match_transformers(hf_vlm: Any, vlm_runner: Any, processor: Idefics3Processor,
                                                      num_images: int) -> None:
    inputs = prompt_with_images(processor, num_images)
    assert len(inputs.images) == [0, 3, 6][num_images]
    ids = inputs.prompt_token_ids
    allocator = BlockAllocator(POOL_TOKENS // 4)
    plan = allocator.plan(0, ids, num_logits=len(ids))
    plan.images = list(inputs.images)
    logits = vlm_runner.execute(BatchPlan([plan]))
    torch.testing.assert_close(logits, hf_forward(hf_vlm, inputs), atol=ATOL, rtol=1e-4)
    output = [int(logits[-1].argmax())]
    decode_rows = []
    while len(output) < NUM_NEW_TOKENS:
        row = vlm_runner.execute(BatchPlan([allocator.plan(0, output[-1:], num_logits=1)]))[0]
        decode_rows.append(row)
        output.append(int(row.argmax()))
    expected = hf_forward(hf_vlm, inputs, output[:-1])[len(ids):]
    torch.testing.assert_close(torch.stack(decode_rows), expected, atol=ATOL, rtol=1e-4)


def test_get_processor_reads_the_checkpoint_folder(tmp_path: Path, hf_vlm: Any, tokenizer: Any) -> None:
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from servelm.multimodal.processor import get_processor, supports_images
    hf_vlm.config.save_pretrained(tmp_path)
    Idefics3ImageProcessorPil(**{**TINY_IDEFICS3_PIXELS, "do_image_splitting": False}).save_pretrained(tmp_path)
    processor = get_processor(str(tmp_path), tokenizer)
    assert isinstance(processor, Idefics3Processor) and not processor.split and processor.frame == 48
    assert supports_images(hf_vlm.config)


def test_tower_positions_follow_transformers_buckets() -> None:
    """25 patches a side: transformers' bucketed position ids are not 0..24 in float32 (patch 9
    takes bucket 8); the tower's embeddings equal transformers' all the same."""
    import transformers
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings as Reference

    from servelm.model.architectures.idefics3 import Idefics3VisionEmbeddings
    config = transformers.Idefics3VisionConfig(hidden_size=8, image_size=25, patch_size=1, num_attention_heads=2)
    torch.manual_seed(0)
    reference = Reference(config).eval()
    ours = Idefics3VisionEmbeddings(config)
    ours.load_state_dict(reference.state_dict())
    assert not torch.equal(ours.position_ids, torch.arange(25 * 25))
    pixels = torch.randn(2, 3, 25, 25)
    with torch.no_grad():
        expected = reference(pixels, torch.ones(2, 25, 25, dtype=torch.bool))
        torch.testing.assert_close(ours(pixels), expected, atol=0, rtol=0)
