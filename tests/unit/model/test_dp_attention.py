"""DP attention's assignment of sequences to ranks (model/dp_attention.py): a sequence runs on the
rank whose pool partition holds its blocks, naming them by that pool's own ids; block copies run
on their partition's rank; and the rows of each rank gathered in rank order come back in plan order.
The ranks' pools together hold what one process's pool would for the same flags."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from servelm.model.dp_attention import AttentionRanks, rank_share
from servelm.model.forward_batch import BatchPlan, SequencePlan

RANKS = AttentionRanks(2, blocks_per_rank=10)
"""Rank 0's pool: the engine's blocks 0-9; rank 1's: 10-19."""


def sequence(block_ids: list[int], num_tokens: int = 2, num_logits: int = 1) -> SequencePlan:
    return SequencePlan(list(range(num_tokens)), 0, block_ids, num_logits)


def test_a_sequence_runs_where_its_blocks_are_in_that_pool_s_ids() -> None:
    plan = BatchPlan([sequence([12, 13]), sequence([3]), sequence([19, 10, 11])])
    assert RANKS.assign(plan) == [1, 0, 1]
    share = rank_share(plan, RANKS, 1)
    assert [s.block_ids for s in share.plan.sequences] == [[2, 3], [9, 0, 1]]
    assert plan.sequences[0].block_ids == [12, 13]   # the engine's plan is left as it was
    assert RANKS.own_copies([(3, 4), (15, 17)], 1) == [(5, 7)] and RANKS.own_copies([(3, 4)], 1) == []
    with pytest.raises(AssertionError, match="span the pools of several ranks"):
        RANKS.assign(BatchPlan([sequence([9, 10])]))


def test_gathered_rows_return_in_plan_order() -> None:
    plan = BatchPlan([sequence([11], 4, 2), sequence([2], 3, 0), sequence([3], 2, 1), sequence([14], 1, 1)])
    share = rank_share(plan, RANKS, 0)
    assert [s.block_ids for s in share.plan.sequences] == [[2], [3]]
    assert share.logits_counts == [1, 3]
    plan_rows = torch.tensor([10, 11, 30, 40])     # each logits row's label, plan order
    gathered = torch.tensor([30, 10, 11, 40])      # rank 0's rows, then rank 1's
    assert torch.equal(gathered[share.plan_rows], plan_rows)


def test_the_ranks_pools_together_hold_one_process_s_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No --max-total-tokens: the budget's smallest bound here is --max-running-requests 4 x the
    512-token context = 2048 tokens (512 blocks of 4), one process's pool. Two DP-attention ranks
    report that engine total (the engine takes the minimum and divides it): 256 blocks, 1024 tokens
    a rank, 2048 together -- not 2048 a rank, as before -- in the start-up log and kv_pool_layout
    (/get_server_info)."""
    from servelm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from servelm.model.runner import ModelRunner
    from servelm.model.source import resolve_model_source
    from tests.tiny_models import make_tiny_model_dir
    from tests.unit.distributed.test_parallel import run_ranks

    model_config = ModelConfig(model=str(make_tiny_model_dir(tmp_path, "qwen3_moe")), device="cpu", dtype="float32")

    def config(size: int) -> EngineConfig:
        return EngineConfig(model=model_config, cache=CacheConfig(page_size=4),
                            scheduler=SchedulerConfig(max_running_requests=4),
                            parallel=ParallelConfig(tensor_parallel_size=size, enable_dp_attention=size > 1))

    single = ModelRunner(config(1), resolve_model_source(model_config), defer_kv_cache=True)
    assert single.kv_capacity_blocks() == 512

    def work(parallel: object) -> tuple[int, dict[str, object]]:
        runner = ModelRunner(config(2), resolve_model_source(model_config), parallel=parallel, defer_kv_cache=True)
        capacity = runner.kv_capacity_blocks(ranks_sharing_memory=2)
        runner.init_kv_cache(capacity)
        assert runner.kv_cache is not None and runner.kv_cache.num_blocks == 256
        return capacity, runner.kv_pool_layout()["dp_attention"]

    with caplog.at_level(logging.INFO, logger="servelm.model.runner"):
        ranks = run_ranks(2, work)
    assert ranks == [(512, {"ranks": 2, "blocks_per_rank": 256, "tokens_per_rank": 1024, "total_tokens": 2048})] * 2
    logged = [r.getMessage() for r in caplog.records if "pool holds its own requests' K/V: 1024 tokens" in r.getMessage()]
    assert len(logged) == 2 and all("all ranks together 2048 tokens" in line for line in logged)
