"""The whole engine (scheduler + real model runner) on tiny random-weight checkpoints.

Greedy tokens must equal transformers' generate on the same checkpoint, and must not depend on
what else is in the batch or on how prompts are chunked.
"""

from __future__ import annotations

import random

import pytest
from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.reference import load_reference_model, transformers_greedy
from tests.tiny_models import make_tiny_model_dir

ARCHES = ["llama", "qwen2", "qwen3", "gemma3"]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module", params=ARCHES)
def tiny_model(request, tmp_path_factory):
    return request.param, make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def prompts(vocab_size: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(5, 41))] for _ in range(count)]


def make_engine(path: str, chunk: int = -1, max_total_tokens: int = 4096) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=2048),
    )
    return LLMEngine(config)


def generate(engine: LLMEngine, token_lists: list[list[int]], max_tokens: int = NUM_NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, tokens in enumerate(token_lists):
        assert engine.add_request(f"r{index}-{id(tokens)}", tokens, params) is None
    outputs: dict[str, list[int]] = {}
    order = [f"r{index}-{id(tokens)}" for index, tokens in enumerate(token_lists)]
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.is_finished:
                assert output.finish_reason == "length", output.error
    assert engine.stats()["num_used_blocks"] == 0
    return [outputs[request_id] for request_id in order]


def test_greedy_matches_transformers_in_a_mixed_batch(tiny_model):
    arch, path = tiny_model
    engine = make_engine(path)
    token_lists = prompts(engine.runner.vocab_size)
    ours = generate(engine, token_lists)
    reference = transformers_greedy(load_reference_model(path), token_lists, NUM_NEW_TOKENS)
    assert ours == reference, arch


@pytest.mark.parametrize("chunk", [-1, 7])
def test_batch_invariance_with_and_without_chunked_prefill(tiny_model, chunk):
    arch, path = tiny_model
    engine = make_engine(path, chunk=chunk)
    token_lists = prompts(engine.runner.vocab_size)
    together = generate(engine, token_lists)
    alone = [generate(engine, [tokens])[0] for tokens in token_lists]
    assert together == alone, arch


def test_preemption_keeps_greedy_output(tiny_model):
    arch, path = tiny_model
    # A pool a few times one request's length, 8 concurrent requests: preemption must happen.
    engine = make_engine(path, chunk=16, max_total_tokens=160)
    token_lists = prompts(engine.runner.vocab_size)
    squeezed = generate(engine, token_lists)
    assert engine.scheduler.num_preemptions > 0
    roomy = generate(make_engine(path), token_lists)
    assert squeezed == roomy, arch
