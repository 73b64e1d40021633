"""The whole engine on the tiny MoE checkpoints as saved on disk (per-expert tensors): greedy tokens
equal transformers' generate with the prefix cache on, chunked prefill and several concurrent
requests sharing a prefix, and equal the same engine with the cache off."""

from __future__ import annotations

import random

import pytest
from servelm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.expert_stage import expert_distribution_call
from tests.e2e.test_prefix_cache_tiny import run as run_greedy
from tests.reference import load_reference_model, transformers_greedy
from tests.tiny_models import TINY_MOE_ARCHS, make_tiny_model_dir

NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module", params=TINY_MOE_ARCHS)
def tiny_model(request, tmp_path_factory):
    return request.param, make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def make_engine(path, cache: bool, disable_mla: bool = False) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32", disable_mla=disable_mla),
        cache=CacheConfig(max_total_tokens=4096, page_size=8, disable_radix_cache=not cache),
        scheduler=SchedulerConfig(chunked_prefill_size=16, max_prefill_tokens=256),
    )
    return LLMEngine(config)


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(1, vocab_size) for _ in range(29)]
    return [system + [rng.randrange(1, vocab_size) for _ in range(rng.randrange(1, 14))] for _ in range(5)]


def run(engine: LLMEngine, token_lists: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs and cached prompt tokens (test_prefix_cache_tiny's driver); every block freed after."""
    outputs, cached = run_greedy(engine, token_lists, NUM_NEW_TOKENS)
    assert engine.stats()["num_used_blocks"] == 0
    return outputs, cached


def check_cached_and_chunked(arch: str, path, engine: LLMEngine) -> tuple[list[list[int]], list[list[int]]]:
    """A first request fills the cache; the rest run together, chunked, from its prefix: all their
    greedy tokens equal transformers'. Returns the prompts and transformers' tokens."""
    token_lists = shared_prefix_prompts(engine.runner.vocab_size)
    first, _ = run(engine, token_lists[:1])
    rest, cached = run(engine, token_lists[1:])
    assert cached > 0, f"{arch}: no prefix-cache hit"
    reference = transformers_greedy(load_reference_model(path), token_lists, NUM_NEW_TOKENS)
    assert first + rest == reference, arch
    return token_lists, reference


def test_greedy_matches_transformers_with_prefix_cache_and_chunks(tiny_model):
    arch, path = tiny_model
    token_lists, reference = check_cached_and_chunked(arch, path, make_engine(path, cache=True))
    uncached, _ = run(make_engine(path, cache=False), token_lists)
    assert uncached == reference, arch


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_tp2_engine_matches_tp1(tmp_path, arch):
    """Two ranks on loopback, each holding every expert's half of the intermediate dimension (and
    half the shared expert, half the dense layer's MLP; DeepSeek: half the query heads over a
    latent pool each rank holds whole): greedy tokens equal one rank's, chunked."""
    from tests.e2e.test_tensor_parallel import run_engine

    model = str(make_tiny_model_dir(tmp_path, arch))
    prompts = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
    flags = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
    expected, _ = run_engine(model, 1, prompts, **flags)
    got, layout = run_engine(model, 2, prompts, **flags)
    assert got == expected
    assert layout["tp_size"] == 2 and [r["rank"] for r in layout["ranks"]] == [0, 1]


@pytest.mark.parametrize("arch", ["mixtral", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_ep2_engine_matches_one_process_across_rebalances(tmp_path, arch):
    """--tp 2 --ep-size 2 on Mixtral (8 experts and 2 redundant slots: 5 whole experts a rank,
    attention tensor-parallel) and DeepSeek-V3 (its grouped router, shared experts and latent pool),
    EPLB re-placing the experts every 3 passes: greedy tokens equal one process's, chunked, and the
    experts did move."""
    from tests.e2e.test_tensor_parallel import PARAMS
    from tests.engine_drive import greedy

    model = str(make_tiny_model_dir(tmp_path, arch))
    prompts = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
    flags = dict(model=model, dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True,
                 max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
    single = LLMEngine(EngineConfig.from_flat(flags))
    expected = greedy(single, prompts, PARAMS)
    single.shutdown()
    engine = LLMEngine(EngineConfig.from_flat(dict(
        flags, tensor_parallel_size=2, expert_parallel_size=2, ep_num_redundant_experts=2, enable_eplb=True,
        eplb_rebalance_num_iterations=3, enable_metrics=True, enable_expert_distribution_metrics=True)))
    try:
        initial = engine.expert_load.placements()
        assert initial[0] == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
        assert greedy(engine, prompts, PARAMS) == expected
        moe = engine.stats()["moe"]
        assert moe["eplb_rebalances"] >= 3 and engine.expert_load.placements() != initial
        assert moe["layers"] == ([0, 1] if arch == "mixtral" else [1, 2])  # DeepSeek's layer 0 is dense
        assert sum(moe["expert_rows"][0]) == sum(map(sum, moe["ep_rank_rows"][:1]))
        assert engine.stats()["parallel"]["ep_size"] == 2
    finally:
        engine.shutdown()


def test_expert_distribution_recorder_in_process(tmp_path):
    """--expert-distribution-recorder-mode per_token on one process: nothing is kept before start;
    between start and stop every pass's routing is, each token's top-2 per sparse layer (qwen3_moe's
    layers 0 and 2); the dump after stop is what was recorded, and a recorder-less engine says why."""
    model = make_tiny_model_dir(tmp_path, "qwen3_moe")
    config = EngineConfig(model=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32"),
                          observability=ObservabilityConfig(expert_distribution_recorder_mode="per_token"))
    engine = LLMEngine(config)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    run_greedy(engine, [[11, 12, 13]], 2)
    assert engine.expert_distribution("dump")["num_passes"] == 0
    assert engine.expert_distribution("start")["success"]
    run_greedy(engine, prompts, 3)
    engine.expert_distribution("stop")
    run_greedy(engine, [[21, 22]], 2)
    dump = engine.expert_distribution("dump")
    assert dump["layers"] == [0, 2] and dump["num_passes"] == 3
    rows = [token for one_pass in dump["passes"] for token in one_pass[0]]
    assert len(rows) == 5 + 3 + 2 + 2 and all(len(set(experts)) == 2 for experts in rows)
    assert "--expert-distribution-recorder-mode" in expert_distribution_call(None, "start")["message"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ep2_inside_tp4_matches_one_process(tmp_path, arch):
    """--tp 4 --ep-size 2: attention over four ranks, the experts in two groups of two ranks, each
    group's ranks splitting its experts' intermediate columns: greedy tokens equal one process's."""
    from tests.e2e.test_tensor_parallel import run_engine

    model = str(make_tiny_model_dir(tmp_path, arch))
    prompts = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
    flags = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
    expected, _ = run_engine(model, 1, prompts, **flags)
    got, layout = run_engine(model, 4, prompts, expert_parallel_size=2, **flags)
    assert got == expected
    assert layout["tp_size"] == 4 and layout["ep_size"] == 2
