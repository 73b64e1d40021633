"""Qwen2-VL and Qwen2.5-VL (M-RoPE text model + their vision transformers) against transformers,
float32, tiny random weights: the processor's patches and 3-D positions, prefill and decode logits
with 0, 1 and 2 images of different sizes (dynamic resolution; Qwen2.5-VL's images span several
attention windows), and the M-RoPE offsets' effect on decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("PIL")

from servelm.model.forward_batch import BatchPlan  # noqa: E402
from servelm.multimodal.inputs import MultimodalInputs  # noqa: E402
from servelm.multimodal.processor import Qwen2VLProcessor, image_item, mrope_positions_for  # noqa: E402
from tests.tiny_models import (TINY_QWEN2_VL_END, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_PIXELS,  # noqa: E402
                               TINY_QWEN2_VL_START, TINY_QWEN_VL_FAMILIES, make_tiny_qwen2_vl, random_image)

from .conftest import POOL_TOKENS, BlockAllocator  # noqa: E402

ATOL = 1e-4
NUM_NEW_TOKENS = 6
SIZES = [(40, 56), (30, 22)]   # (width, height): 7 x 5 and 3 x 4 merged tokens after smart_resize


@pytest.fixture(scope="module", params=TINY_QWEN_VL_FAMILIES)
def hf_vlm(request: pytest.FixtureRequest) -> Any:
    return make_tiny_qwen2_vl(family=request.param)


@pytest.fixture(scope="module")
def processor(hf_vlm: Any) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(hf_vlm.config, dict(TINY_QWEN2_VL_PIXELS))


def prompt_with_images(num_images: int, seed: int = 3) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(10, 290, (n,), generator=generator).tolist() for n in (5, 3, 4)]
    ids = pieces[0]
    for index in range(num_images):
        ids = ids + [TINY_QWEN2_VL_START, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_END] + pieces[1 + index % 2]
    return ids


def images(count: int, seed: int = 20) -> list[Any]:
    return [image_item(random_image(seed + i, *SIZES[i % 2])) for i in range(count)]


def hf_forward(model: Any, inputs: MultimodalInputs, extra: list[int] | None = None,
               plain_positions: bool = False) -> torch.Tensor:
    ids = torch.tensor([inputs.prompt_token_ids + (extra or [])])
    kwargs: dict[str, Any] = {}
    if inputs.images:
        kwargs = dict(pixel_values=torch.cat([span.pixel_values for span in inputs.images]),
                      image_grid_thw=torch.tensor([span.extra["grid_thw"] for span in inputs.images]),
                      mm_token_type_ids=(ids == TINY_QWEN2_VL_IMAGE).int())
    if plain_positions:
        kwargs["position_ids"] = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits[0].float()


def test_patches_equal_transformers_image_processor(processor: Qwen2VLProcessor) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    reference = Qwen2VLImageProcessorPil(**TINY_QWEN2_VL_PIXELS)
    for seed, (width, height), mode in [(1, (40, 56), "RGB"), (2, (300, 17), "RGBA"), (3, (9, 9), "L")]:
        image = random_image(seed, width, height, mode=mode)
        expected = reference(images=[image], return_tensors="pt")
        patches, grid = processor.pixels(image)
        assert list(grid) == expected["image_grid_thw"][0].tolist()
        assert torch.equal(patches, expected["pixel_values"])


def test_expansion_and_mrope_positions_equal_transformers(hf_vlm: Any, processor: Qwen2VLProcessor) -> None:
    items = images(2)
    inputs = processor.process(prompt_with_images(2), items)
    counts = [span.extra["grid_thw"][1] * span.extra["grid_thw"][2] // 4 for span in inputs.images]
    assert [span.length for span in inputs.images] == counts == [35, 12]
    for span in inputs.images:
        assert inputs.prompt_token_ids[span.offset - 1] == TINY_QWEN2_VL_START
        assert inputs.prompt_token_ids[span.offset + span.length] == TINY_QWEN2_VL_END
    ids = torch.tensor([inputs.prompt_token_ids])
    expected, delta = hf_vlm.model.get_rope_index(
        ids, mm_token_type_ids=(ids == TINY_QWEN2_VL_IMAGE).int(),
        image_grid_thw=torch.tensor([span.extra["grid_thw"] for span in inputs.images]))
    assert torch.equal(inputs.extra["mrope_positions"], expected[:, 0])
    assert inputs.extra["mrope_delta"] == int(delta) < 0
    assert processor.process(inputs.prompt_token_ids, items).prompt_token_ids == inputs.prompt_token_ids


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_prefill_and_decode_logits_match_transformers(hf_vlm: Any, vlm_runner: Any, processor: Qwen2VLProcessor,
                                                      num_images: int) -> None:
    inputs = processor.process(prompt_with_images(num_images), images(num_images))
    ids = inputs.prompt_token_ids
    allocator = BlockAllocator(POOL_TOKENS // 4)
    plan = allocator.plan(0, ids, num_logits=len(ids))
    plan.images = list(inputs.images)
    plan.mrope_positions = mrope_positions_for(inputs, 0, len(ids))
    logits = vlm_runner.execute(BatchPlan([plan]))
    torch.testing.assert_close(logits, hf_forward(hf_vlm, inputs), atol=ATOL, rtol=1e-4)
    output = [int(logits[-1].argmax())]
    decode_rows = []
    while len(output) < NUM_NEW_TOKENS:
        step = allocator.plan(0, output[-1:], num_logits=1)
        step.mrope_positions = mrope_positions_for(inputs, len(ids) + len(output) - 1, 1)
        row = vlm_runner.execute(BatchPlan([step]))[0]
        decode_rows.append(row)
        output.append(int(row.argmax()))
    expected = hf_forward(hf_vlm, inputs, output[:-1])[len(ids):]
    torch.testing.assert_close(torch.stack(decode_rows), expected, atol=ATOL, rtol=1e-4)
    if num_images:   # the offsets matter: plain positions give other logits
        plain = hf_forward(hf_vlm, inputs, output[:-1], plain_positions=True)[len(ids):]
        assert (plain - expected).abs().max() > 1e-3
