"""The whole engine on the tiny MoE checkpoints as saved on disk (per-expert tensors): greedy tokens
equal transformers' generate with the prefix cache on, chunked prefill and several concurrent
requests sharing a prefix, and equal the same engine with the cache off."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from servelm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.expert_stage import expert_distribution_call
from tests.e2e.test_prefix_cache_tiny import run as run_greedy
from tests.engine_drive import assert_greedy_parity, greedy_logprobs
from tests.reference import load_reference_model, transformers_greedy
from tests.tiny_models import TINY_MLA_ARCHS, TINY_MOE_ARCHS, make_tiny_model_dir

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


SPARSE_LAYERS = {"mixtral": [0, 1], "olmoe": [0, 1], "qwen3_moe": [0, 2], "qwen2_moe": [1],
                 "deepseek_v2": [1, 2], "deepseek_v3": [1, 2]}
"""The tiny models' MoE layers (qwen3_moe's layer 1 is dense, qwen2_moe sparse every 2nd layer,
DeepSeek's layer 0 dense)."""
PARALLEL_PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
PARALLEL_FLAGS = dict(dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True,
                      max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
"""The parallel layouts' parity runs: three prompts, the long one chunked (prefill chunks and
decodes share steps), float32."""


def parallel_greedy(model: str, **flags: Any) -> tuple[tuple[list[list[int]], list[torch.Tensor]], dict[str, Any]]:
    """PARALLEL_PROMPTS' greedy tokens and logprobs on an engine with ``flags`` over PARALLEL_FLAGS,
    and its parallel layout."""
    engine = LLMEngine(EngineConfig.from_flat(dict(PARALLEL_FLAGS, model=model, **flags)))
    try:
        return greedy_logprobs(engine, PARALLEL_PROMPTS, NUM_NEW_TOKENS), engine.stats()["parallel"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", *(pytest.param(arch, marks=pytest.mark.slow) for arch in (
    "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3"))])
def test_ep2_engine_matches_one_process_across_rebalances(tmp_path, arch):
    """--tp 2 --ep-size 2 (8 experts and 2 redundant slots: 5 whole experts a rank, attention
    tensor-parallel; Qwen2-MoE's gated shared expert and DeepSeek's shared experts split by
    columns, OLMoE's whole-projection q/k norms summed over the ranks, DeepSeek's grouped routers
    and latent pool), EPLB re-placing the experts every 3 passes: greedy tokens equal one
    process's and logprobs within 1e-4, chunked, and the experts did move."""
    model = str(make_tiny_model_dir(tmp_path, arch))
    expected, _ = parallel_greedy(model)
    engine = LLMEngine(EngineConfig.from_flat(dict(
        PARALLEL_FLAGS, model=model, tensor_parallel_size=2, expert_parallel_size=2, ep_num_redundant_experts=2,
        enable_eplb=True, eplb_rebalance_num_iterations=3, enable_metrics=True,
        enable_expert_distribution_metrics=True)))
    try:
        initial = engine.expert_load.placements()
        assert initial[0] == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
        assert_greedy_parity(greedy_logprobs(engine, PARALLEL_PROMPTS, NUM_NEW_TOKENS), expected)
        moe = engine.stats()["moe"]
        assert moe["eplb_rebalances"] >= 3 and engine.expert_load.placements() != initial
        assert moe["layers"] == SPARSE_LAYERS[arch]
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
@pytest.mark.parametrize("arch", TINY_MOE_ARCHS + TINY_MLA_ARCHS)
def test_ep2_inside_tp4_matches_one_process(tmp_path, arch):
    """--tp 4 --ep-size 2: attention over four ranks (2 KV heads: each on two ranks; DeepSeek: one
    query head a rank over the whole latent), the experts in two groups of two ranks, each group's
    ranks splitting its experts' intermediate columns: greedy tokens equal one process's and
    logprobs within 1e-4."""
    model = str(make_tiny_model_dir(tmp_path, arch))
    expected, _ = parallel_greedy(model)
    got, layout = parallel_greedy(model, tensor_parallel_size=4, expert_parallel_size=2)
    assert_greedy_parity(got, expected)
    assert layout["tp_size"] == 4 and layout["ep_size"] == 2
