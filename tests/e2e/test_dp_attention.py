"""--enable-dp-attention on two ranks on loopback: each rank runs the attention (and dense layers)
of its own requests over its own KV pool, the MoE layers expert-parallel over both; greedy tokens
equal one process's in float32, with a prefix-cache hit, chunked prefill, and passes where one
rank has no request (it still joins every MoE layer's all-to-all)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.e2e.test_engine_moe import shared_prefix_prompts
from tests.e2e.test_prefix_cache_tiny import run
from tests.tiny_models import TINY_VOCAB_SIZE, make_tiny_model_dir

NUM_NEW_TOKENS = 12


def generate(flags: dict[str, Any], token_lists: list[list[int]],
             probe: Callable[[LLMEngine], None] | None = None) -> tuple[list[list[int]], int, dict[str, Any]]:
    """A first request alone (one rank idle in its passes, and it fills the prefix cache), then the
    rest together from its prefix; (their tokens, cached prompt tokens, the engine's stats after,
    with ``cached_partitions``: the pool partitions (ranks) whose blocks the prefix cache holds).
    ``probe``: called with the engine after the requests (more checks on it)."""
    engine = LLMEngine(EngineConfig.from_flat(flags))
    try:
        first, _ = run(engine, token_lists[:1], NUM_NEW_TOKENS)
        rest, cached = run(engine, token_lists[1:], NUM_NEW_TOKENS)
        if probe is not None:
            probe(engine)
        stats = engine.stats()
        assert stats["num_used_blocks"] == 0
        pool = engine.block_pool
        stats["cached_partitions"] = sorted(
            {pool.partition_of(block) for block in range(pool.num_blocks) if pool.ref_count(block)})
        return first + rest, cached, stats
    finally:
        engine.shutdown()


FLAGS = dict(dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True, max_total_tokens=1024,
             page_size=4, chunked_prefill_size=8)
TOKEN_LISTS = shared_prefix_prompts(TINY_VOCAB_SIZE) + [[300, 12, 99], list(range(7, 30))]
"""Five prompts sharing a 29-token prefix (the first alone fills the cache), and two of their own."""


@pytest.mark.slow
@pytest.mark.parametrize("arch, dp_lm_head", [("deepseek_v3", False), ("deepseek_v2", True), ("qwen3_moe", False),
                                              ("mixtral", True), ("qwen2_moe", False), ("olmoe", False)])
def test_dp_attention_matches_one_process(tmp_path, arch: str, dp_lm_head: bool) -> None:
    model = str(make_tiny_model_dir(tmp_path, arch))
    expected, _, _ = generate(dict(FLAGS, model=model), TOKEN_LISTS)
    got, cached, stats = generate(dict(FLAGS, model=model, tensor_parallel_size=2, enable_dp_attention=True,
                                       enable_dp_lm_head=dp_lm_head), TOKEN_LISTS)
    assert got == expected, arch
    assert cached > 0, "no prefix-cache hit"
    assert stats["cached_partitions"] == [0, 1], "both ranks ran requests"


@pytest.mark.slow
def test_each_rank_pool_holds_its_share_and_a_full_one_makes_requests_wait(tmp_path) -> None:
    """--max-total-tokens 128 over 2 DP-attention ranks: each rank's pool holds 64 tokens (16
    blocks of 4), reported per rank and in the engine's kv_pool; the four requests sharing the
    cached prefix all land on its rank, whose pool cannot hold them at once (the prefix's 7 blocks
    and 3-4 of each), so requests wait or are preempted (more steps than with a roomy pool), never
    fail, and every token equals one process's with a roomy pool. A request that fits 128 tokens
    but not one rank's 64 is refused up front, naming the rank's pool."""
    def refuse_too_long(engine: LLMEngine) -> None:
        refusal = engine.add_request("long", list(range(1, 81)), SamplingParams(temperature=0.0, max_tokens=4))
        assert refusal is not None and refusal.is_finished and "(64 tokens)" in (refusal.error or ""), refusal

    model = str(make_tiny_model_dir(tmp_path, "qwen3_moe"))
    expected, _, roomy = generate(dict(FLAGS, model=model), TOKEN_LISTS)
    got, cached, stats = generate(dict(FLAGS, model=model, max_total_tokens=128, tensor_parallel_size=2,
                                       enable_dp_attention=True), TOKEN_LISTS, refuse_too_long)
    assert got == expected
    assert stats["kv_pool"]["dp_attention"] == {"ranks": 2, "blocks_per_rank": 16, "tokens_per_rank": 64,
                                                "total_tokens": 128}
    assert [rank["kv_pool_blocks"] for rank in stats["parallel"]["ranks"]] == [16, 16]
    assert stats["kv_pool_tokens"] == 128 and cached > 0
    assert stats["num_steps"] > roomy["num_steps"], (stats["num_steps"], roomy["num_steps"], stats["num_preemptions"])


@pytest.mark.slow
def test_dp_attention_ranks_divide_one_process_s_kv_budget(tmp_path, caplog) -> None:
    """No --max-total-tokens: the pool comes from the budget, here its smallest bound, --max-running-
    requests 4 x the 512-token context. One process allocates 2048 tokens; two DP-attention ranks
    1024 each, 2048 together (each rank's pool used to be the whole budget), reported per rank and
    in total in the start-up log and in the engine's kv_pool (/get_server_info); greedy tokens equal
    one process's."""
    model = str(make_tiny_model_dir(tmp_path, "qwen3_moe"))
    flags = dict(FLAGS, model=model, max_total_tokens=None, max_running_requests=4)
    expected, _, single = generate(flags, TOKEN_LISTS)
    assert single["kv_pool_tokens"] == 2048
    with caplog.at_level(logging.INFO, logger="servelm.model.runner"):
        got, _, stats = generate(dict(flags, tensor_parallel_size=2, enable_dp_attention=True), TOKEN_LISTS)
    assert got == expected
    assert stats["kv_pool_tokens"] == 2048
    assert stats["kv_pool"]["dp_attention"] == {"ranks": 2, "blocks_per_rank": 256, "tokens_per_rank": 1024,
                                                "total_tokens": 2048}
    assert [rank["kv_pool_blocks"] for rank in stats["parallel"]["ranks"]] == [256, 256]
    assert any("rank 0's pool holds its own requests' K/V: 1024 tokens" in record.getMessage()
               and "all ranks together 2048 tokens" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_a_model_without_experts_is_refused(tmp_path) -> None:
    model = str(make_tiny_model_dir(tmp_path, "llama"))
    flags = dict(model=model, dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True,
                 max_total_tokens=256, tensor_parallel_size=2, enable_dp_attention=True)
    with pytest.raises(Exception, match="has no mixture-of-experts layer"):
        LLMEngine(EngineConfig.from_flat(flags))
