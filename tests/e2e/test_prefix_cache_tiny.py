"""The prefix cache with the real model runner on tiny random-weight checkpoints: greedy outputs
are identical with the cache on and off, for shared prefixes, n>1 and heavy preemption."""

from __future__ import annotations

import random

import pytest
from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir

ARCHES = ["llama", "gemma3"]  # plain attention, and sliding-window layers


@pytest.fixture(scope="module", params=ARCHES)
def tiny_model(request, tmp_path_factory):
    return request.param, make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def make_engine(path, cache: bool, max_total_tokens: int = 4096, chunk: int = 16) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8, disable_radix_cache=not cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=256),
    )
    return LLMEngine(config)


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(1, vocab_size) for _ in range(37)]
    questions = [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    n_copies = [system + questions[0]] * 3  # n=3 of one prompt
    return [system + q for q in questions] + n_copies


def run(engine: LLMEngine, token_lists: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(token_lists))]
    for request_id, tokens in zip(ids, token_lists):
        assert engine.add_request(request_id, tokens, params) is None
    outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
    cached = 0
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
            if output.is_finished:
                assert output.finish_reason == "length", output.error
                cached += output.num_cached_tokens
    return [outputs[request_id] for request_id in ids], cached


def test_shared_prefixes_and_n_copies_identical_with_cache_on_and_off(tiny_model):
    arch, path = tiny_model
    results = {}
    for cache in (False, True):
        engine = make_engine(path, cache)
        token_lists = shared_prefix_prompts(engine.runner.vocab_size)
        first, cached_first = run(engine, token_lists, 12)
        # A second round (multi-turn-like reuse of everything the first one cached).
        second, cached_second = run(engine, token_lists, 12)
        assert first == second, arch
        results[cache] = first
        if cache:
            assert cached_first > 0 and cached_second >= 8 * 32, arch
            stats = engine.stats()
            assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] > 0
            assert 0 < stats["cache_hit_rate"] < 1
        else:
            assert cached_first == cached_second == 0
    assert results[True] == results[False], arch


def test_heavy_preemption_16_concurrent_identical_with_cache_on_and_off(tiny_model):
    arch, path = tiny_model
    rng = random.Random(3)
    vocab = 320
    system = [rng.randrange(1, vocab) for _ in range(16)]
    token_lists = [system + [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 12))]
                   for _ in range(16)]
    reference, _ = run(make_engine(path, cache=False), token_lists, 16)  # a roomy pool
    for cache in (False, True):
        # 128 tokens of KV (16 blocks of 8) for 16 requests of up to 43 tokens each.
        engine = make_engine(path, cache, max_total_tokens=128, chunk=8)
        squeezed, _ = run(engine, token_lists, 16)
        assert engine.scheduler.num_preemptions > 0, arch
        assert squeezed == reference, (arch, cache)
        stats = engine.stats()
        assert stats["num_running"] == stats["num_waiting"] == stats["num_used_blocks"] == 0
        if cache:  # empty but cached
            assert stats["num_cached_blocks"] > 0
            assert engine.block_pool.num_used_blocks == stats["num_cached_blocks"]
