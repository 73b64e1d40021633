"""The prefix cache inside the scheduler, with a runner that reads K/V back through the block table
(so a wrong shared block, or a shared block written again, changes the output)."""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.request import LoRAState

from .fake_runner import FakeRunner
from .test_engine_core import EOS, greedy, run_all

SYSTEM = [(5 * j) % 89 + 1 for j in range(22)]  # 5 full blocks of 4, plus 2 tokens


def make(num_blocks: int = 64, cache: bool = True, eviction: str = "lru",
         **scheduler) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=4)
    config = EngineConfig(cache=CacheConfig(disable_radix_cache=not cache,
                                            radix_eviction_policy=eviction),
                          scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(config, runner=runner, eos_token_ids=[EOS], context_length=512), runner


def question(i: int, length: int = 5) -> list[int]:
    return SYSTEM + [(11 * i + j) % 80 + 3 for j in range(length)]


def assert_idle_and_cached(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["token_usage"] == 0
    assert engine.prefix_cache is not None
    assert stats["num_cached_blocks"] == engine.prefix_cache.num_blocks > 0
    # Every block still taken from the pool belongs to the cache, with the cache's reference only.
    assert engine.block_pool.num_used_blocks == engine.prefix_cache.num_blocks
    assert engine.prefix_cache.num_evictable_blocks() == engine.prefix_cache.num_blocks


def test_second_request_reuses_exact_blocks() -> None:
    engine, runner = make()
    engine.add_request("a", question(0), greedy(3))
    engine.step()
    first_blocks = list(engine.scheduler.requests["a"].block_ids)
    while engine.has_unfinished():
        engine.step()
    tokens, _, finished = run_all(engine, {"b": (question(1), greedy(6))})
    assert tokens["b"] == runner.reference(question(1), 6)
    # 22 shared tokens: the 5 full blocks are reused (20 tokens), with a's exact block ids.
    assert finished["b"].num_cached_tokens == 20
    engine.add_request("c", question(2), greedy(2))
    engine.step()
    assert engine.scheduler.requests["c"].block_ids[:5] == first_blocks[:5]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["cache_hit_rate"] == round(40 / (3 * 27), 4)
    assert_idle_and_cached(engine)


@pytest.mark.parametrize("chunk", [-1, 6])
def test_outputs_identical_with_cache_on_and_off(chunk: int) -> None:
    requests = {f"r{i}": (question(i, 3 + i), greedy(8 + i)) for i in range(6)}
    outputs = {}
    forward = {}
    for cache in (False, True):
        engine, runner = make(cache=cache, chunked_prefill_size=chunk, max_prefill_tokens=24)
        tokens, _, finished = run_all(engine, requests)
        outputs[cache] = tokens
        forward[cache] = runner.num_forward_tokens
        for request_id, (prompt, params) in requests.items():
            assert tokens[request_id] == runner.reference(prompt, params.max_tokens)
        cached = sum(f.num_cached_tokens for f in finished.values())
        assert (cached > 0) == cache
    assert outputs[True] == outputs[False]
    assert forward[True] < forward[False]


def test_n_copies_of_one_prompt_compute_the_prefix_once() -> None:
    engine, runner = make()
    prompt = question(3)
    requests = {f"n{i}": (prompt, greedy(5)) for i in range(4)}
    tokens, _, finished = run_all(engine, requests)
    for request_id in requests:
        assert tokens[request_id] == runner.reference(prompt, 5)
    cached = sorted(f.num_cached_tokens for f in finished.values())
    assert cached == [0, 24, 24, 24]  # all but the last prompt token, block-aligned: 26 -> 24


def test_multi_turn_chat_hits_the_previous_turn() -> None:
    engine, runner = make()
    turn1 = question(4)
    tokens, _, _ = run_all(engine, {"t1": (turn1, greedy(9))})
    turn2 = turn1 + tokens["t1"] + [7, 8, 9]
    tokens2, _, finished = run_all(engine, {"t2": (turn2, greedy(4))})
    assert tokens2["t2"] == runner.reference(turn2, 4)
    # Turn 1 computed 27 + 8 positions (the last sampled token has no K/V): 8 full blocks.
    assert finished["t2"].num_cached_tokens == 32


def test_heavy_preemption_with_the_cache_completes_every_request_exactly() -> None:
    # 16 concurrent requests, a pool of 14 blocks (56 tokens), each request needs up to 47.
    requests = {f"r{i}": (question(i, 1 + i % 7), greedy(16)) for i in range(16)}
    results = {}
    for cache in (False, True):
        engine, runner = make(num_blocks=14, cache=cache, chunked_prefill_size=8,
                              max_prefill_tokens=16)
        tokens, _, finished = run_all(engine, requests)
        for request_id, (prompt, _) in requests.items():
            assert tokens[request_id] == runner.reference(prompt, 16), request_id
            assert finished[request_id].finish_reason == "length"
        assert engine.scheduler.num_preemptions > 0
        results[cache] = tokens
    assert results[True] == results[False]
    assert_idle_and_cached(engine)


def test_free_cached_blocks_are_evicted_before_anyone_is_preempted() -> None:
    engine, runner = make(num_blocks=12)
    for i in range(4):  # fill the pool with cached, unused blocks
        run_all(engine, {f"fill{i}": ([90 - i] * 8, greedy(1))})
    assert engine.prefix_cache.num_blocks >= 4
    tokens, _, _ = run_all(engine, {"a": (question(0), greedy(15)), "b": ([1, 2, 3], greedy(4))})
    assert tokens["a"] == runner.reference(question(0), 15)
    assert engine.scheduler.num_preemptions == 0
    assert engine.block_pool.num_used_blocks == engine.prefix_cache.num_blocks


def test_prompt_logprobs_requests_compute_the_whole_prompt() -> None:
    engine, runner = make()
    run_all(engine, {"a": (question(0), greedy(2))})
    before = runner.num_forward_tokens
    _, _, finished = run_all(engine, {"b": (question(0), greedy(2, prompt_logprobs=0))})
    assert finished["b"].num_cached_tokens == 0
    assert runner.num_forward_tokens - before == len(question(0)) + 1


def test_adapters_do_not_share_cached_blocks() -> None:
    engine, _ = make()
    run_all(engine, {"a": (question(0), greedy(2))})
    engine.add_request("b", question(0), greedy(2))
    engine.scheduler.requests["b"].lora = LoRAState("lora-1")
    engine.step()
    assert engine.scheduler.requests["b"].num_cached_tokens == 0


def test_flush_cache_only_when_idle_and_disabled_cache() -> None:
    engine, _ = make()
    run_all(engine, {"a": (question(0), greedy(2))})
    engine.add_request("b", [1, 2, 3], greedy(20))
    engine.step()
    refused = engine.flush_cache()
    assert not refused["success"] and "running" in refused["message"]
    while engine.has_unfinished():
        engine.step()
    assert engine.flush_cache()["success"]
    assert engine.block_pool.num_used_blocks == 0 and engine.prefix_cache.num_blocks == 0
    off, _ = make(cache=False)
    assert off.prefix_cache is None
    _, _, finished = run_all(off, {"a": (question(0), greedy(2)), "b": (question(0), greedy(2))})
    assert off.block_pool.num_used_blocks == 0
    assert off.stats()["cache_hit_rate"] == 0 and off.flush_cache()["success"]
