"""Requests with images through the LLMEngine (tiny Gemma 3 VLM, float32): greedy tokens equal
transformers', the prefix cache keys image positions by the image's digest, the encoder cache skips
a repeated image, and chunked prefill never cuts an image."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")

from servelm.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, RuntimeConfig,  # noqa: E402
                            SchedulerConfig, SpeculativeConfig)
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.multimodal.inputs import MultimodalInputs  # noqa: E402
from servelm.multimodal.processor import get_processor, image_item  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402
from tests.engine_drive import drain  # noqa: E402
from tests.tiny_models import (TINY_VLM_BOI, TINY_VLM_IMAGE, TINY_VLM_IMAGE_TOKENS, TINY_VLM_NEWLINES,  # noqa: E402
                               make_tiny_vlm_dir, random_image)

BLOCK = 4
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT = [21, 22, 23, 24, 25, 26, 27]   # 7 tokens, then the image (its block starts inside block 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm_dir(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> Any:
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> Any:
    processor = get_processor(str(model_dir))
    processor.newline_ids = [TINY_VLM_NEWLINES]
    return processor


def make(model_dir: Path, max_total_tokens: int = 1024, with_tokenizer: bool = False,
         speculative: SpeculativeConfig | None = None, lora: LoRAConfig | None = None,
         **scheduler: Any) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model=str(model_dir), skip_tokenizer_init=not with_tokenizer,
                                            dtype="float32"),
                          cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=BLOCK),
                          scheduler=SchedulerConfig(**scheduler), runtime=RuntimeConfig(num_threads=1),
                          speculative=speculative or SpeculativeConfig(), lora=lora or LoRAConfig())
    return LLMEngine(config)


def reference_greedy(model: Any, inputs: MultimodalInputs, num_tokens: int = MAX_TOKENS,
                     allowed: list[int] | None = None) -> list[int]:
    """transformers' greedy tokens (the argmax over ``allowed`` ids when given)."""
    ids = list(inputs.prompt_token_ids)
    pixels = torch.stack([span.pixel_values for span in inputs.images]) if inputs.images else None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            tensor = torch.tensor([ids + out])
            logits = model(input_ids=tensor, pixel_values=pixels,
                           token_type_ids=(tensor == TINY_VLM_IMAGE).long()).logits[0, -1]
            out.append(int(logits.argmax()) if allowed is None else allowed[int(logits[allowed].argmax())])
    return out


def run(engine: LLMEngine, requests: dict[str, MultimodalInputs], params: SamplingParams = PARAMS,
        lora_name: str | None = None) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Add, drain; tokens and cached prompt tokens per request."""
    cached: dict[str, int] = {}
    for request_id, inputs in requests.items():
        assert engine.add_request(request_id, inputs.prompt_token_ids, params, mm_inputs=inputs,
                                  lora_name=lora_name) is None
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.is_finished:
                cached[output.request_id] = output.num_cached_tokens
    return tokens, cached


def test_images_through_the_engine_equal_transformers(model_dir: Path, reference_model: Any, processor: Any) -> None:
    """Zero, one and two images (one repeated) in one batch."""
    engine = make(model_dir)
    one = processor.process(TEXT + [TINY_VLM_BOI, 30, 31], [image_item(random_image(1))])
    two = processor.process(TEXT[:3] + [TINY_VLM_BOI, 40] + [TINY_VLM_BOI, 41, 42],
                            [image_item(random_image(2)), image_item(random_image(1))])
    text = processor.process(TEXT + [50, 51], [])
    tokens, _ = run(engine, {"one": one, "two": two, "text": text})
    assert tokens["one"] == reference_greedy(reference_model, one)
    assert tokens["two"] == reference_greedy(reference_model, two)
    assert tokens["text"] == reference_greedy(reference_model, text)
    assert engine.runner.encoder_cache.num_encoded == 2   # image 1 appears twice, encoded once


def test_prefix_cache_keys_images_by_digest(model_dir: Path, reference_model: Any, processor: Any) -> None:
    """Same text, another image: nothing from the image's block on is shared; the same image again:
    its K/V is (cached tokens past the image). A different prefix before a known image misses the
    prefix cache but hits the encoder cache."""
    engine = make(model_dir)
    first_image, other_image = image_item(random_image(7)), image_item(random_image(8))
    prompt = TEXT + [TINY_VLM_BOI, 33, 34, 35]
    first = processor.process(prompt, [first_image])
    other = processor.process(prompt, [other_image])
    again = processor.process(prompt, [first_image])
    image_offset = first.images[0].offset
    image_end = image_offset + TINY_VLM_IMAGE_TOKENS

    tokens, cached = run(engine, {"first": first})
    first_tokens = tokens["first"]
    assert first_tokens == reference_greedy(reference_model, first)
    tokens, cached = run(engine, {"other": other})
    assert 0 < cached["other"] <= image_offset   # the text before the image only
    assert tokens["other"] == reference_greedy(reference_model, other)
    tokens, cached = run(engine, {"again": again})
    assert cached["again"] >= image_end // BLOCK * BLOCK > image_offset
    assert tokens["again"] == first_tokens

    encoded = engine.runner.encoder_cache.num_encoded
    shifted = processor.process([60, 61] + prompt, [first_image])
    tokens, cached = run(engine, {"shifted": shifted})
    assert cached["shifted"] == 0 and engine.runner.encoder_cache.num_encoded == encoded
    assert tokens["shifted"] == reference_greedy(reference_model, shifted)


def test_chunked_prefill_never_cuts_an_image(model_dir: Path, reference_model: Any, processor: Any) -> None:
    """Chunks of 6 tokens (an image has 16): a chunk stops before an image, the next takes all of
    it; every pass's image spans are whole; tokens equal transformers'."""
    engine = make(model_dir, chunked_prefill_size=6)
    passes: list[list[tuple[int, int, list[Any]]]] = []
    execute = engine.runner.execute

    def recording(plan: Any) -> Any:
        passes.append([(s.start_position, len(s.token_ids), list(s.images)) for s in plan.sequences])
        return execute(plan)

    engine.runner.execute = recording   # type: ignore[method-assign]
    inputs = processor.process(TEXT + [TINY_VLM_BOI, 70] + [TINY_VLM_BOI, 71, 72],
                               [image_item(random_image(11)), image_item(random_image(12))])
    text = processor.process(TEXT + [80, 81, 82, 83, 84, 85, 86, 87], [])
    tokens, _ = run(engine, {"images": inputs, "text": text})
    assert tokens["images"] == reference_greedy(reference_model, inputs)
    assert tokens["text"] == reference_greedy(reference_model, text)
    image_passes = 0
    for plan in passes:
        for start, length, spans in plan:
            for span in spans:
                assert start <= span.offset or start < span.offset + span.length
                assert start + length >= span.offset + span.length, "a pass cut an image"
                image_passes += 1
    assert image_passes == 2
    assert any(length == 6 for plan in passes for _, length, _ in plan)   # the cap did apply


def test_requests_with_images_are_refused_by_a_text_model(tmp_path: Path, processor: Any) -> None:
    from tests.tiny_models import make_tiny_model_dir
    engine = make(make_tiny_model_dir(tmp_path, "gemma3"))
    inputs = processor.process(TEXT + [TINY_VLM_BOI], [image_item(random_image(3))])
    refused = engine.add_request("x", inputs.prompt_token_ids, PARAMS, mm_inputs=inputs)
    assert refused is not None and refused.error_status == 400 and "does not take images" in (refused.error or "")
    assert drain(engine) == {}


def test_qwen2_vl_images_through_the_engine_equal_transformers(tmp_path: Path) -> None:
    """Qwen2-VL: two image sizes in one batch with a text prompt; the M-RoPE offsets carry into
    decode (greedy tokens equal transformers'); the same image again is a prefix-cache hit."""
    from transformers import Qwen2VLForConditionalGeneration

    from tests.tiny_models import (TINY_QWEN2_VL_END, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_START,
                                   make_tiny_qwen2_vl_dir)
    path = make_tiny_qwen2_vl_dir(tmp_path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    processor = get_processor(str(path))
    marker = [TINY_QWEN2_VL_START, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_END]
    big, small = image_item(random_image(5, 40, 56)), image_item(random_image(6, 30, 22))
    one = processor.process(TEXT + marker + [30, 31], [big])
    two = processor.process(TEXT[:3] + marker + [40] + marker + [41, 42], [small, big])
    text = processor.process(TEXT + [50, 51], [])

    def reference(inputs: MultimodalInputs) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids = torch.tensor([inputs.prompt_token_ids + out])
                kwargs: dict[str, Any] = {}
                if inputs.images:
                    kwargs = dict(pixel_values=torch.cat([span.pixel_values for span in inputs.images]),
                                  image_grid_thw=torch.tensor([span.extra["grid_thw"] for span in inputs.images]),
                                  mm_token_type_ids=(ids == TINY_QWEN2_VL_IMAGE).int())
                out.append(int(model(input_ids=ids, **kwargs).logits[0, -1].argmax()))
        return out

    engine = make(path)
    tokens, _ = run(engine, {"one": one, "two": two, "text": text})
    assert tokens["one"] == reference(one)
    assert tokens["two"] == reference(two)
    assert tokens["text"] == reference(text)
    again, cached = run(engine, {"again": processor.process(TEXT + marker + [30, 31], [big])})
    assert again["again"] == tokens["one"] and cached["again"] > one.images[0].offset + one.images[0].length - BLOCK


def test_smolvlm_frames_through_the_engine_equal_transformers(tmp_path: Path) -> None:
    """SmolVLM from its checkpoint folder: two images cut into 3 and 5 frames (a span each) with
    chunked prefill of 16 tokens (frames of 9 placeholders never cut); greedy tokens equal
    transformers', and the same image again is a prefix-cache hit past its frames."""
    from transformers import AutoTokenizer, SmolVLMForConditionalGeneration

    from tests.tiny_models import TINY_IDEFICS3_IMAGE, make_tiny_idefics3_dir
    path = make_tiny_idefics3_dir(tmp_path, family="smolvlm")
    model = SmolVLMForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    processor = get_processor(str(path), AutoTokenizer.from_pretrained(str(path)))
    wide, square = image_item(random_image(5, 80, 30)), image_item(random_image(6, 90, 96))
    two = processor.process(TEXT[:3] + [TINY_IDEFICS3_IMAGE, 40, TINY_IDEFICS3_IMAGE, 41, 42], [wide, square])
    assert [span.frame for span in two.images] == [0, 1, 2, 0, 1, 2, 3, 4]

    def reference(inputs: MultimodalInputs) -> list[int]:
        pixels = torch.stack([span.pixel_values for span in inputs.images])[None]
        out: list[int] = []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids = torch.tensor([inputs.prompt_token_ids + out])
                out.append(int(model(input_ids=ids, pixel_values=pixels).logits[0, -1].argmax()))
        return out

    engine = make(path, chunked_prefill_size=16)
    tokens, _ = run(engine, {"two": two})
    assert tokens["two"] == reference(two)
    again, cached = run(engine, {"again": processor.process(two.prompt_token_ids, [wide, square])})
    last = two.images[-1]
    assert again["again"] == tokens["two"] and cached["again"] > last.offset + last.length - BLOCK


# -- the other features with an image in the prompt (issue 32) -----------------------------------------

def three_image_prompts(processor: Any) -> dict[str, MultimodalInputs]:
    return {f"r{i}": processor.process(TEXT + [TINY_VLM_BOI, 30 + i, 31], [image_item(random_image(20 + i))])
            for i in range(3)}


def test_preempted_requests_with_images_equal_transformers(model_dir: Path, reference_model: Any,
                                                           processor: Any) -> None:
    """14 blocks of 4 for three 29-token prompts that grow by 5: admitted without a reserve, the
    running ones run out of blocks in decode and are preempted; recomputed, their tokens are
    transformers' (the image's K/V recomputed from the encoder cache or the tower again)."""
    engine = make(model_dir, max_total_tokens=56, schedule_conservativeness=0.0)
    requests = three_image_prompts(processor)
    tokens, _ = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request_id, inputs in requests.items():
        assert tokens[request_id] == reference_greedy(reference_model, inputs), request_id
    assert engine.stats()["num_used_blocks"] == 0


def test_ngram_drafts_with_images_are_verified_to_plain_greedy(model_dir: Path, reference_model: Any,
                                                               processor: Any) -> None:
    """The prompt repeats its text after the image: n-gram drafts copy from the prompt (its image
    placeholders included) and the verify pass keeps greedy tokens equal to transformers'."""
    inputs = processor.process(TEXT + [TINY_VLM_BOI] + TEXT, [image_item(random_image(3))])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = make(model_dir, speculative=SpeculativeConfig(speculative_algorithm="NGRAM"))
    tokens, _ = run(engine, {"a": inputs}, params)
    assert tokens["a"] == reference_greedy(reference_model, inputs, 12)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_verify_passes"] > 0


def test_a_grammar_constrains_the_output_of_a_request_with_an_image(
        model_dir: Path, reference_model: Any, processor: Any, tmp_path: Path) -> None:
    """Regex [a-h]{5} (a real tokenizer beside the model): the tokens are transformers' argmax over
    the eight letters at each step, where the free greedy output is other tokens."""
    from transformers import AutoTokenizer

    from servelm.sampling.params import StructuredSpec
    from tests.tiny_models import write_tiny_vlm_tokenizer
    path = tmp_path / "with-tokenizer"
    shutil.copytree(model_dir, path)
    write_tiny_vlm_tokenizer(path)
    letters = AutoTokenizer.from_pretrained(str(path)).convert_tokens_to_ids(list("abcdefgh"))
    inputs = three_image_prompts(processor)["r0"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured=StructuredSpec("regex", "[a-h]{5}"))
    tokens, _ = run(make(path, with_tokenizer=True), {"g": inputs}, params)
    assert tokens["g"] == reference_greedy(reference_model, inputs, allowed=letters)
    assert set(reference_greedy(reference_model, inputs)).isdisjoint(letters)   # it did constrain


def test_lora_on_the_text_model_with_images_equals_peft(model_dir: Path, reference_model: Any,
                                                        processor: Any, tmp_path: Path) -> None:
    """A PEFT adapter on the text model's projections of the VLM (keys under language_model):
    requests with an image and the adapter equal peft's greedy tokens, those without it the base
    model's (which differ) in the same batch. An adapter on the vision tower is refused."""
    peft = pytest.importorskip("peft")
    from transformers import Gemma3ForConditionalGeneration

    from servelm.lora.adapter import BaseShapes, LoRAAdapterError, load_adapter

    def adapter(name: str, targets: str) -> Any:
        torch.manual_seed(5)
        base = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                              attn_implementation="eager")
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=64,
                                                          target_modules=targets)).eval()
        model.save_pretrained(tmp_path / name)
        return model

    tuned = adapter("text", r".*language_model.*\.(q_proj|v_proj|up_proj)")
    engine = make(model_dir, lora=LoRAConfig(lora_paths=[f"text={tmp_path / 'text'}"]))
    requests = three_image_prompts(processor)
    with_adapter, _ = run(engine, {"r0": requests["r0"]}, lora_name="text")
    assert with_adapter["r0"] == reference_greedy(tuned, requests["r0"])
    base, _ = run(engine, {"r0": requests["r0"]})
    assert base["r0"] == reference_greedy(reference_model, requests["r0"]) != with_adapter["r0"]

    adapter("vision", r".*vision_tower.*\.q_proj")
    with pytest.raises(LoRAAdapterError, match="vision tower"):
        load_adapter("vision", tmp_path / "vision", BaseShapes.from_hf_config(reference_model.config), 16)
