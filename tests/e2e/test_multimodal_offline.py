"""servelm.Engine with images (the tiny Gemma 3 VLM, float32, no tokenizer): ``image_data`` per
prompt gives transformers' greedy tokens; a model without images refuses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")

from servelm import Engine, SamplingParams  # noqa: E402
from servelm.multimodal.processor import get_processor, image_item  # noqa: E402
from tests.tiny_models import TINY_VLM_BOI, TINY_VLM_IMAGE, make_tiny_vlm_dir, random_image  # noqa: E402


@pytest.mark.slow   # an engine process start: ~1 min on the shared 2-core box
def test_offline_engine_takes_images(tmp_path: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration
    path = make_tiny_vlm_dir(tmp_path)
    prompts = [[21, 22, TINY_VLM_BOI, 23], [24, TINY_VLM_BOI, 25, TINY_VLM_BOI, 26], [27, 28, 29]]
    images = [[random_image(1)], [random_image(2), random_image(1)], []]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with Engine(model_path=str(path), skip_tokenizer_init=True, dtype="float32", max_total_tokens=1024) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params, image_data=images)
        with pytest.raises(ValueError, match="names 1 image"):   # two images for one marker
            engine.generate(input_ids=prompts[0], sampling_params=params, image_data=[random_image(1), random_image(2)])
    processor = get_processor(str(path))   # no tokenizer: no "\n\n" ids around an image, as the engine's
    reference = Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    for prompt, prompt_images, result in zip(prompts, images, results):
        inputs = processor.process(prompt, [image_item(image) for image in prompt_images])
        assert result.prompt_token_ids == inputs.prompt_token_ids
        out: list[int] = []
        pixels = torch.stack([span.pixel_values for span in inputs.images]) if inputs.images else None
        with torch.no_grad():
            for _ in range(4):
                ids = torch.tensor([inputs.prompt_token_ids + out])
                logits = reference(input_ids=ids, pixel_values=pixels,
                                   token_type_ids=(ids == TINY_VLM_IMAGE).long()).logits[0, -1]
                out.append(int(logits.argmax()))
        assert result.token_ids == out
