"""Beam search through the engine (engine/beam.py) against transformers' ``generate(num_beams=k)``.

Every beam, its order and its score (``sequences_scores``) must match, for several widths,
length penalties and early_stopping modes, with stop tokens that end some beams early; the
blocks beams share must all come back (the pool is idle after each search).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.outputs import RequestOutput
from servelm.sampling.params import BeamParams, SamplingParams
from tests.reference import load_reference_model, transformers_beams
from tests.tiny_models import make_tiny_model_dir

MAX_TOKENS = 12
CASES = [  # width, length_penalty, early_stopping, stop token ids (the tiny model's EOS)
    (4, 1.0, False, [48]),
    (3, 0.5, True, [63, 92]),
    (4, 2.0, "never", [48, 63]),
    (5, 1.0, True, [297]),
    (2, -1.0, False, [92]),
    (4, 0.0, "never", [48]),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("beam"), "gemma3")
    rng = random.Random(7)
    prompt = [rng.randrange(1, 320) for _ in range(19)]
    return path, prompt, load_reference_model(path)


def make_engine(path: Any, cache: bool = True, chunk: int = -1, max_total_tokens: int = 2048,
                ) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8, disable_radix_cache=not cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk)))


def beam_params(width: int, rank: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, **params: Any) -> SamplingParams:
    beam = BeamParams(width=width, num_returns=width, rank=rank, length_penalty=length_penalty,
                      early_stopping=early_stopping)
    return SamplingParams(temperature=0.0, max_tokens=params.pop("max_tokens", MAX_TOKENS), beam=beam,
                          **params)


def run_search(engine: LLMEngine, prompt: list[int], width: int, name: str = "q",
               **params: Any) -> list[RequestOutput]:
    """One search: ``width`` client requests (ranks), drained; their final outputs, best first."""
    for rank in range(width):
        assert engine.add_request(f"{name}-{rank}", prompt, beam_params(width, rank, **params),
                                  group=name) is None
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id not in outputs, "a beam request answers once"
            outputs[output.request_id] = output
    return [outputs[f"{name}-{rank}"] for rank in range(width)]


def assert_same(ours: list[RequestOutput], reference: list[tuple[list[int], float]]) -> None:
    assert [o.new_token_ids for o in ours] == [tokens for tokens, _ in reference]
    for output, (_, score) in zip(ours, reference):
        assert output.beam_score == pytest.approx(score, abs=1e-4, rel=1e-4)
    assert [o.beam_score for o in ours] == sorted((o.beam_score for o in ours), reverse=True)


def assert_idle(engine: LLMEngine) -> None:
    """No block is held: each shared block was released once per holder."""
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_running_beam_searches"] == 0
    assert engine.block_pool.num_used_blocks == stats["num_cached_blocks"]


@pytest.mark.parametrize("width,length_penalty,early_stopping,stop", CASES)
def test_beams_and_scores_match_transformers(tiny: Any, width: int, length_penalty: float,
                                             early_stopping: bool | str, stop: list[int]) -> None:
    path, prompt, reference_model = tiny
    engine = make_engine(path)
    ours = run_search(engine, prompt, width, length_penalty=length_penalty,
                      early_stopping=early_stopping, stop_token_ids=stop)
    reference = transformers_beams(reference_model, prompt, width, MAX_TOKENS, stop,
                                   length_penalty=length_penalty, early_stopping=early_stopping)
    assert_same(ours, reference)
    for output in ours:
        ended_by_stop = bool(output.new_token_ids) and output.new_token_ids[-1] in stop
        assert output.finish_reason == ("stop" if ended_by_stop else "length")
    assert_idle(engine)
    assert engine.stats()["num_beam_forks"] > 0


def test_forks_share_blocks_and_copy_the_partial_one(tiny: Any) -> None:
    """Without the prefix cache every block comes back to the free list; forks copied partial
    blocks instead of recomputing them (the results still equal transformers')."""
    path, prompt, reference_model = tiny
    engine = make_engine(path, cache=False)
    ours = run_search(engine, prompt, 4, stop_token_ids=[48])
    assert_same(ours, transformers_beams(reference_model, prompt, 4, MAX_TOKENS, [48]))
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert engine.stats()["num_beam_block_copies"] > 0


def test_beams_do_not_depend_on_the_batch(tiny: Any) -> None:
    """Two searches and greedy requests in one batch, prompts chunked: the same beams."""
    path, prompt, reference_model = tiny
    engine = make_engine(path, chunk=5)
    other = prompt[3:] + [7, 8]
    for rank in range(3):
        engine.add_request(f"a-{rank}", prompt, beam_params(3, rank, stop_token_ids=[63, 92]), group="a")
        engine.add_request(f"b-{rank}", other, beam_params(3, rank), group="b")
    engine.add_request("greedy", prompt, SamplingParams(temperature=0.0, max_tokens=20))
    outputs: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            outputs[output.request_id] = output
    assert_same([outputs[f"a-{r}"] for r in range(3)],
                transformers_beams(reference_model, prompt, 3, MAX_TOKENS, [63, 92]))
    assert_same([outputs[f"b-{r}"] for r in range(3)],
                transformers_beams(reference_model, other, 3, MAX_TOKENS, []))
    assert len(tokens["greedy"]) == 20
    assert_idle(engine)


def test_a_small_pool_preempts_beams_and_still_matches(tiny: Any) -> None:
    """A pool too small for every beam at once: beams are preempted and recomputed."""
    path, prompt, reference_model = tiny
    engine = make_engine(path, max_total_tokens=64)
    ours = run_search(engine, prompt, 4, max_tokens=40)
    assert engine.stats()["num_preemptions"] > 0
    assert_same(ours, transformers_beams(reference_model, prompt, 4, 40, []))
    assert_idle(engine)


def test_fewer_returns_than_beams_and_abort(tiny: Any) -> None:
    path, prompt, reference_model = tiny
    engine = make_engine(path)
    for rank in range(2):
        beam = BeamParams(width=4, num_returns=2, rank=rank)
        engine.add_request(f"n2-{rank}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                beam=beam), group="n2")
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    assert_same([outputs["n2-0"], outputs["n2-1"]],
                transformers_beams(reference_model, prompt, 4, MAX_TOKENS, [])[:2])
    # aborting every client request of a running search ends it and frees its beams
    for rank in range(2):
        engine.add_request(f"x-{rank}", prompt, beam_params(2, rank), group="x")
    engine.step()
    engine.step()
    assert engine.abort_request("x-0").finish_reason == "abort"
    assert engine.stats()["num_running_beam_searches"] == 1
    assert engine.abort_request("x-1").finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_idle(engine)


def test_offline_engine_beam_search(tiny: Any) -> None:
    """servelm.Engine.beam_search (vLLM's LLM.beam_search): the beams through the engine process."""
    from servelm import Engine

    path, prompt, reference_model = tiny
    with Engine(str(path), skip_tokenizer_init=True, dtype="float32", max_total_tokens=2048,
                page_size=8, num_threads=1) as engine:
        beams = engine.beam_search(input_ids=prompt, beam_width=3, max_tokens=MAX_TOKENS,
                                   stop_token_ids=[63, 92], length_penalty=0.5, early_stopping=True)
    reference = transformers_beams(reference_model, prompt, 3, MAX_TOKENS, [63, 92],
                                   length_penalty=0.5, early_stopping=True)
    assert [b.token_ids for b in beams] == [tokens for tokens, _ in reference]
    assert [b.beam_score for b in beams] == pytest.approx([score for _, score in reference], abs=1e-4)


@pytest.mark.parametrize("field,value", [("temperature", 0.7), ("top_p", 0.5), ("logprobs", 2),
                                         ("min_tokens", 2), ("repetition_penalty", 1.2)])
def test_options_beams_cannot_honour_are_refused(field: str, value: Any) -> None:
    from servelm.sampling.params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{"temperature": 0.0, field: value}, beam=BeamParams(width=2))  # type: ignore[arg-type]
    with pytest.raises(SamplingParamsError, match="n \\(3\\) must not exceed"):
        SamplingParams(temperature=0.0, beam=BeamParams(width=2, num_returns=3))
    with pytest.raises(SamplingParamsError, match="early_stopping"):
        SamplingParams(temperature=0.0, beam=BeamParams(width=2, early_stopping="always"))


GEMMA_PROMPTS = ["The capital of France is", "Question: What is 2 + 2?\nAnswer:"]


@pytest.fixture(scope="module")
def gemma() -> Any:
    from servelm.model.packaged import PackagedModelError, packaged_model_path

    try:
        gguf = packaged_model_path("gemma3-270m")
    except PackagedModelError as error:
        pytest.skip(str(error))
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="gemma3-270m", dtype="float32"),
                                    cache=CacheConfig(max_total_tokens=4096)))
    yield engine, load_reference_model(gguf.parent, gguf.name)
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("width,length_penalty,early_stopping", [(4, 1.0, False), (3, 0.6, "never")])
def test_gemma3_270m_beams_match_transformers(gemma: Any, width: int, length_penalty: float,
                                              early_stopping: bool | str) -> None:
    """The real Gemma 3 270M in float32: beams, order and scores equal transformers'."""
    engine, reference_model = gemma
    for index, text in enumerate(GEMMA_PROMPTS):
        prompt = engine.tokenizer.encode(text)
        ours = run_search(engine, prompt, width, name=f"g{index}{width}", max_tokens=16,
                          length_penalty=length_penalty, early_stopping=early_stopping)
        assert_same(ours, transformers_beams(reference_model, prompt, width, 16, engine.eos_token_ids,
                                             length_penalty=length_penalty,
                                             early_stopping=early_stopping))
        assert ours[0].new_text == engine.tokenizer.decode(ours[0].new_token_ids, skip_special_tokens=True)
    assert_idle(engine)


def test_beams_with_an_image_match_transformers(tmp_path: Any) -> None:
    """Qwen2-VL with an image: every beam (forks included) carries the prompt's image, so its
    decode positions keep the M-RoPE offset; beams and scores equal transformers'."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from servelm.multimodal.processor import get_processor, image_item
    from tests.tiny_models import (TINY_QWEN2_VL_END, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_START,
                                   make_tiny_qwen2_vl_dir, random_image)
    path = make_tiny_qwen2_vl_dir(tmp_path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    marker = [TINY_QWEN2_VL_START, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_END]
    inputs = get_processor(str(path)).process([21, 22, 23] + marker + [30, 31], [image_item(random_image(1, 40, 56))])
    width, stop = 3, [48]
    engine = make_engine(path)
    for rank in range(width):
        assert engine.add_request(f"v-{rank}", inputs.prompt_token_ids, beam_params(width, rank, stop_token_ids=stop),
                                  group="v", mm_inputs=inputs) is None
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        outputs.update((output.request_id, output) for output in engine.step() if output.is_finished)
    ids = torch.tensor([inputs.prompt_token_ids])
    span = inputs.images[0]
    reference = transformers_beams(model, inputs.prompt_token_ids, width, MAX_TOKENS, stop,
                                   pixel_values=span.pixel_values,
                                   image_grid_thw=torch.tensor([span.extra["grid_thw"]]),
                                   mm_token_type_ids=(ids == TINY_QWEN2_VL_IMAGE).int())
    assert_same([outputs[f"v-{rank}"] for rank in range(width)], reference)
    assert engine.stats()["num_beam_forks"] > 0
    assert_idle(engine)
