"""Gemma 3 with images (SigLIP tower + projector) against transformers, float32, tiny random weights:
the processor's pixels and placeholder expansion, prefill logits and greedy decode with 0, 1 and 2
images, an image block longer than the sliding window, and the block mask's effect."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("PIL")

from servelm.model.forward_batch import BatchPlan  # noqa: E402
from servelm.multimodal.inputs import MultimodalInputs  # noqa: E402
from servelm.multimodal.processor import Gemma3Processor, get_processor, image_item, supports_images  # noqa: E402
from tests.tiny_models import (TINY_VLM_BOI, TINY_VLM_EOI, TINY_VLM_IMAGE, TINY_VLM_IMAGE_SIZE,  # noqa: E402
                               TINY_VLM_IMAGE_TOKENS, TINY_VLM_NEWLINES, make_tiny_vlm, make_tiny_vlm_dir,
                               random_image)

from .conftest import POOL_TOKENS, BlockAllocator, make_runner, make_source  # noqa: E402

ATOL = 1e-4
NUM_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def hf_vlm() -> Any:
    return make_tiny_vlm()


@pytest.fixture(scope="module")
def runner(hf_vlm: Any) -> Any:
    return make_runner(make_source(hf_vlm))


@pytest.fixture(scope="module")
def processor(hf_vlm: Any) -> Gemma3Processor:
    processor = Gemma3Processor(hf_vlm.config, {"size": {"height": TINY_VLM_IMAGE_SIZE,
                                                         "width": TINY_VLM_IMAGE_SIZE}})
    processor.newline_ids = [TINY_VLM_NEWLINES]
    return processor


def prompt_with_images(num_images: int, seed: int = 3) -> list[int]:
    """Text ids (below the special ids) with ``num_images`` <start_of_image> markers between."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(10, 290, (n,), generator=generator).tolist() for n in (5, 3, 4)]
    ids = pieces[0]
    for index in range(num_images):
        ids = ids + [TINY_VLM_BOI] + pieces[1 + index % 2]
    return ids


def hf_logits(model: Any, inputs: MultimodalInputs, extra: list[int] | None = None,
              block_mask: bool = True) -> torch.Tensor:
    ids = torch.tensor([inputs.prompt_token_ids + (extra or [])])
    pixels = (torch.stack([span.pixel_values for span in inputs.images]) if inputs.images else None)
    token_types = (ids == TINY_VLM_IMAGE).long() if block_mask else None
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, token_type_ids=token_types).logits[0].float()


def hf_greedy(model: Any, inputs: MultimodalInputs, num_tokens: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step (the image rows keep their mask)."""
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(hf_logits(model, inputs, out)[-1].argmax()))
    return out


def test_supports_images_and_get_processor(tmp_path: Any, hf_vlm: Any) -> None:
    from tests.tiny_models import make_tiny_config
    assert supports_images(hf_vlm.config)
    assert not supports_images(make_tiny_config("gemma3"))
    path = make_tiny_vlm_dir(tmp_path)
    processor = get_processor(str(path))
    assert processor is not None and processor.preprocess.size == (TINY_VLM_IMAGE_SIZE, TINY_VLM_IMAGE_SIZE)
    assert processor.tokens_per_image == TINY_VLM_IMAGE_TOKENS


@pytest.mark.parametrize("mode,size", [("RGB", (80, 56)), ("RGBA", (37, 50)), ("L", (64, 64)), ("RGB", (13, 200))])
def test_pixels_equal_transformers_image_processor(processor: Gemma3Processor, mode: str,
                                                   size: tuple[int, int]) -> None:
    """Bit-identical to transformers' Gemma3ImageProcessorPil (resize, rescale, normalize, RGB)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    image = random_image(11, *size, mode=mode)
    reference = Gemma3ImageProcessorPil(size={"height": TINY_VLM_IMAGE_SIZE, "width": TINY_VLM_IMAGE_SIZE})(
        images=[image], return_tensors="pt")["pixel_values"][0]
    ours = processor.preprocess(image)
    assert ours.dtype == torch.float32 and ours.shape == (3, TINY_VLM_IMAGE_SIZE, TINY_VLM_IMAGE_SIZE)
    assert torch.equal(ours, reference)


def test_expansion_is_gemma3_full_image_sequence(processor: Gemma3Processor) -> None:
    """Each <start_of_image> becomes "\\n\\n" boi image*N eoi "\\n\\n" (transformers'
    Gemma3Processor.full_image_sequence, at the token level); the spans sit on the image rows."""
    images = [image_item(random_image(1)), image_item(random_image(2))]
    prompt = prompt_with_images(2)
    inputs = processor.process(prompt, images)
    block = [TINY_VLM_NEWLINES, TINY_VLM_BOI] + [TINY_VLM_IMAGE] * TINY_VLM_IMAGE_TOKENS + [TINY_VLM_EOI,
                                                                                           TINY_VLM_NEWLINES]
    first = prompt.index(TINY_VLM_BOI)
    assert inputs.prompt_token_ids[first:first + len(block)] == block
    assert len(inputs.prompt_token_ids) == len(prompt) + 2 * (len(block) - 1)
    for span, item in zip(inputs.images, images):
        assert span.digest == item.digest and span.length == TINY_VLM_IMAGE_TOKENS
        assert inputs.prompt_token_ids[span.offset:span.offset + span.length] == [TINY_VLM_IMAGE] * span.length
        assert inputs.prompt_token_ids[span.offset - 1] == TINY_VLM_BOI
    assert processor.process(inputs.prompt_token_ids, images).prompt_token_ids == inputs.prompt_token_ids  # expanded
    with pytest.raises(ValueError, match="names 2 image"):
        processor.process(prompt, images[:1])


def test_expand_text_equals_transformers_processor() -> None:
    """``expand_text`` is transformers' string replacement (``Gemma3Processor.full_image_sequence``)."""
    from types import SimpleNamespace

    tokens = {TINY_VLM_BOI: "<start_of_image>", TINY_VLM_EOI: "<end_of_image>", TINY_VLM_IMAGE: "<image_soft_token>"}
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=False: [TINY_VLM_NEWLINES],
                                convert_ids_to_tokens=lambda token: tokens[token])
    ours = Gemma3Processor(make_tiny_vlm().config, {"size": {"height": 64, "width": 64}}, tokenizer)
    reference = ("\n\n<start_of_image>" + "<image_soft_token>" * TINY_VLM_IMAGE_TOKENS + "<end_of_image>\n\n")
    assert ours.full_image_sequence() == reference
    assert ours.expand_text("user\n<start_of_image>Describe.") == "user\n" + reference + "Describe."


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_prefill_logits_and_greedy_match_transformers(hf_vlm: Any, runner: Any, processor: Gemma3Processor,
                                                      num_images: int) -> None:
    images = [image_item(random_image(20 + i)) for i in range(num_images)]
    inputs = processor.process(prompt_with_images(num_images), images)
    assert len(inputs.prompt_token_ids) > TINY_VLM_IMAGE_TOKENS * num_images
    allocator = BlockAllocator(POOL_TOKENS // 4)
    ids = inputs.prompt_token_ids
    plan = allocator.plan(0, ids, num_logits=len(ids))
    plan.images = list(inputs.images)
    logits = runner.execute(BatchPlan([plan]))
    expected = hf_logits(hf_vlm, inputs)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
    if num_images:   # the block mask matters: transformers without token_type_ids differs
        assert (hf_logits(hf_vlm, inputs, block_mask=False) - expected).abs().max() > 1e-3
    output = [int(logits[-1].argmax())]
    while len(output) < NUM_NEW_TOKENS:
        output.append(int(runner.execute(BatchPlan([allocator.plan(0, output[-1:], num_logits=1)]))[0].argmax()))
    assert output == hf_greedy(hf_vlm, inputs, NUM_NEW_TOKENS)


def test_batch_mixes_image_prompts_with_text_and_decodes(hf_vlm: Any, runner: Any,
                                                         processor: Gemma3Processor) -> None:
    """One pass: a text-only decode, a two-image prompt whose first chunk ends before its first
    image, then a chunk that starts at the image (the block lies past the window's reach from the
    chunk's start), and a text prompt; each row equals transformers."""
    allocator = BlockAllocator(POOL_TOKENS // 4)
    two = processor.process(prompt_with_images(2, seed=5), [image_item(random_image(31)), image_item(random_image(32))])
    text = processor.process(prompt_with_images(0, seed=6), [])
    runner.execute(BatchPlan([allocator.plan(2, text.prompt_token_ids, num_logits=0)]))
    cut = two.images[0].offset
    rows = []
    first = allocator.plan(0, two.prompt_token_ids[:cut], num_logits=cut)
    rows.append(runner.execute(BatchPlan([allocator.plan(2, [9], num_logits=1), first]))[1:])
    rest = two.prompt_token_ids[cut:]
    second = allocator.plan(0, rest, num_logits=len(rest))
    second.images = list(two.images)
    other = processor.process(prompt_with_images(1, seed=7), [image_item(random_image(33))])
    third = allocator.plan(1, other.prompt_token_ids, num_logits=1)
    third.images = list(other.images)
    logits = runner.execute(BatchPlan([allocator.plan(2, [10], num_logits=1), second, third]))
    rows.append(logits[1:1 + len(rest)])
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf_vlm, two), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[-1], hf_logits(hf_vlm, other)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[0], hf_logits(hf_vlm, text, [9, 10])[-1], atol=ATOL, rtol=1e-4)


def test_encoder_cache_encodes_a_repeated_image_once(runner: Any, processor: Gemma3Processor) -> None:
    image = image_item(random_image(40))
    inputs = processor.process(prompt_with_images(2), [image, image])
    cache = runner.encoder_cache
    before = cache.num_encoded
    first = runner.encode_images(list(inputs.images))
    assert cache.num_encoded == before + 1 and torch.equal(first[0], first[1])
    runner.encode_images(list(inputs.images))
    assert cache.num_encoded == before + 1 and cache.hits >= 2
