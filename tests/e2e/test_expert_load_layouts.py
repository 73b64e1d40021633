"""The expert distribution recorder, its metrics and EPLB in the layouts beyond one process and
plain EP: pipeline stages (each stage counts its own MoE layers and reports them to the engine
process; EPLB rebalances every stage's), an EP group smaller than TP (--tp 4 --ep 2: rows counted
per group of ranks), and the compiled decode graphs. Each is held to one eager process on the same
tiny checkpoint: greedy tokens and logprobs, the routing totals per (layer, logical expert) and
every recorded pass's counts equal, and every layer routes each computed token top_k times."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from tests.e2e.test_engine_moe import NUM_NEW_TOKENS, PARALLEL_FLAGS, PARALLEL_PROMPTS, SPARSE_LAYERS
from tests.engine_drive import assert_greedy_parity, greedy_logprobs
from tests.tiny_models import make_tiny_model_dir

RECORDING = dict(enable_metrics=True, enable_expert_distribution_metrics=True,
                 expert_distribution_recorder_mode="per_pass")
ROUTED_TOKENS = sum(map(len, PARALLEL_PROMPTS)) + len(PARALLEL_PROMPTS) * (NUM_NEW_TOKENS - 1)
"""Tokens each MoE layer routes for PARALLEL_PROMPTS: every prompt token, and every generated
token but the last (it is sampled, never computed)."""


def recorded_greedy(model: str, **flags: Any) -> tuple[Any, dict[str, Any], dict[str, Any], LLMEngine]:
    """PARALLEL_PROMPTS' greedy tokens and logprobs with the recorder on from the first pass; the
    routing totals (stats' ``moe``) and the dump. The engine is returned shut down."""
    engine = LLMEngine(EngineConfig.from_flat(dict(PARALLEL_FLAGS, model=model, **RECORDING, **flags)))
    try:
        assert engine.expert_distribution("start")["success"]
        result = greedy_logprobs(engine, PARALLEL_PROMPTS, NUM_NEW_TOKENS)
        assert engine.expert_distribution("stop")["success"]
        return result, engine.stats()["moe"], engine.expert_distribution("dump"), engine
    finally:
        engine.shutdown()


def check_counts(model: str, arch: str, moe: dict[str, Any], dump: dict[str, Any],
                 expected_moe: dict[str, Any], expected_dump: dict[str, Any], ep_size: int) -> None:
    """One process's counts, every sparse layer's (all stages'), each summing to the routed rows."""
    top_k = json.loads((Path(model) / "config.json").read_text())["num_experts_per_tok"]
    assert moe["layers"] == dump["layers"] == expected_moe["layers"] == SPARSE_LAYERS[arch]
    assert moe["expert_rows"] == expected_moe["expert_rows"]
    assert [sum(rows) for rows in moe["expert_rows"]] == [ROUTED_TOKENS * top_k] * len(SPARSE_LAYERS[arch])
    assert dump["num_passes"] == expected_dump["num_passes"] > 0
    assert dump["passes"] == expected_dump["passes"]   # pass by pass, layer by layer, expert by expert
    if ep_size > 1:
        assert [(len(rows), sum(rows)) for rows in moe["ep_rank_rows"]] == \
            [(ep_size, ROUTED_TOKENS * top_k)] * len(SPARSE_LAYERS[arch])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Per arch: the model directory and one eager process's recorded run (built once)."""
    runs: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in runs:
            model = str(make_tiny_model_dir(tmp_path_factory.mktemp(arch), arch))
            runs[arch] = (model, *recorded_greedy(model)[:3])
        return runs[arch]
    return get


@pytest.mark.parametrize("arch", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_pipeline_stages_report_their_layers_routing(one_process: Any, arch: str) -> None:
    """--pp-size 2: Mixtral's layer 0 is on the first stage's rank, not in the engine process;
    Qwen2-MoE's first stage has no sparse layer at all. The totals, the dump and the recorder's
    start/stop cover both stages."""
    model, expected, expected_moe, expected_dump = one_process(arch)
    got, moe, dump, _ = recorded_greedy(model, pipeline_parallel_size=2)
    assert_greedy_parity(got, expected)
    check_counts(model, arch, moe, dump, expected_moe, expected_dump, 1)


@pytest.mark.slow
def test_eplb_rebalances_every_pipeline_stage(one_process: Any) -> None:
    """--pp 2 --tp 2 --ep 2 with 2 redundant slots, EPLB every 3 passes: both stages' layers are
    re-placed (one decision for the model), outputs and counts stay one process's."""
    model, expected, expected_moe, expected_dump = one_process("mixtral")
    got, moe, dump, engine = recorded_greedy(
        model, pipeline_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2,
        ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=3)
    assert_greedy_parity(got, expected)
    check_counts(model, "mixtral", moe, dump, expected_moe, expected_dump, 2)
    initial = (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    assert moe["eplb_rebalances"] >= 3
    assert len(dump["placements"]) == 2 and all(placement != initial for placement in dump["placements"])


@pytest.mark.slow
def test_eplb_over_expert_groups_smaller_than_tp(one_process: Any) -> None:
    """--tp 4 --ep 2 with 2 redundant slots and EPLB every 3 passes: two groups of two ranks, rows
    counted per group; the experts move between groups, outputs and counts stay one process's."""
    model, expected, expected_moe, expected_dump = one_process("qwen3_moe")
    got, moe, dump, _ = recorded_greedy(model, tensor_parallel_size=4, expert_parallel_size=2,
                                        ep_num_redundant_experts=2, enable_eplb=True,
                                        eplb_rebalance_num_iterations=3)
    assert_greedy_parity(got, expected)
    check_counts(model, "qwen3_moe", moe, dump, expected_moe, expected_dump, 2)
    assert moe["eplb_rebalances"] >= 3
    assert all(placement != (0, 1, 2, 3, 4, 5, 6, 7, 0, 1) for placement in dump["placements"])


@pytest.mark.slow
def test_recorder_under_compiled_decode_graphs(one_process: Any) -> None:
    """--enable-torch-compile: the MoE blocks' routing is kept from inside the compiled decode
    graphs; tokens, totals (the warm-up's dummy decodes not counted) and every pass's counts equal
    the eager run's."""
    from torch._dynamo.utils import counters

    model, expected, expected_moe, expected_dump = one_process("qwen3_moe")
    counters.clear()
    got, moe, dump, _ = recorded_greedy(model, enable_torch_compile=True, torch_compile_max_bs=4)
    assert counters["stats"]["unique_graphs"] > 0, "no graph was compiled"
    assert got[0] == expected[0]
    for got_values, expected_values in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(got_values, expected_values, atol=1e-5, rtol=0)
    check_counts(model, "qwen3_moe", moe, dump, expected_moe, expected_dump, 1)
