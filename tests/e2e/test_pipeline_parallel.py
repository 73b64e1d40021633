"""Pipeline parallelism: PP=2 (and TP=2 x PP=2) greedy tokens are PP=1's (float32), in the engine
and through the server, and a stage killed mid-generation fails the request and ends the server
with no orphan process.

The stages are real processes passing hidden states over real gloo point-to-point; each rank gets
one thread (4 ranks on 2 cores is slow but correct).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servelm.config import EngineConfig
from servelm.distributed.errors import RankFailedError
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import PARITY_PROMPTS, greedy, reference_greedy, start_ranks_ahead
from tests.tiny_models import make_tiny_model_dir

from .server_process import ServerProcess, check_killed_rank_ends_the_server
from .test_tensor_parallel import completion_tokens

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
FLAGS = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4, chunked_prefill_size=8)


def engine_config(model: str, tp_size: int, pp_size: int, **flags: Any) -> EngineConfig:
    return EngineConfig.from_flat(dict(model=model, dtype="float32", device="cpu", num_threads=1,
                                       tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
                                       **FLAGS, **flags))


def run_engine(model: str, tp_size: int, pp_size: int, **flags: Any) -> tuple[list[list[int]], dict[str, Any]]:
    engine = LLMEngine(engine_config(model, tp_size, pp_size, **flags))
    try:
        return greedy(engine, PROMPTS, PARAMS), engine.stats()["parallel"]
    finally:
        engine.shutdown()


# llama with -m slow: the same tiny Llama in two stages (one layer each, tied head), with the same
# prompts and flags, runs in the default suite in test_tp2_x_pp2_engine_matches_tp1 (two TP ranks
# a stage), and gemma3_mqa's case checks the one-rank-a-stage path and layout (tied head too)
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "gemma3_mqa"])
def test_pp2_engine_matches_pp1_on_tiny_models(tmp_path: Path, arch: str) -> None:
    """Tiny Llama (2 layers: one per stage) and Gemma 3 (4 layers, tied head: the last stage loads
    the embedding as its LM head); the long prompt is chunked so prefill chunks and decodes share
    steps, and each step is cut into micro-batches."""
    model = str(make_tiny_model_dir(tmp_path, arch))
    start_ranks_ahead(engine_config(model, 1, 2))  # they import while pp 1 runs
    expected, _ = run_engine(model, 1, 1)
    got, layout = run_engine(model, 1, 2)
    assert got == expected
    assert layout["pp_size"] == 2 and layout["pp_rank"] == 1  # the engine process holds the last stage
    assert [(r["rank"], r["pp_rank"]) for r in layout["ranks"]] == [(0, 1), (1, 0)]
    assert layout["ranks"][1]["pid"] != os.getpid()


def test_pp2_with_one_sequence_per_micro_batch_matches_pp1(tmp_path: Path) -> None:
    model = str(make_tiny_model_dir(tmp_path, "qwen2"))
    start_ranks_ahead(engine_config(model, 1, 2, pp_max_micro_batch_size=1))
    expected, _ = run_engine(model, 1, 1)
    got, _ = run_engine(model, 1, 2, pp_max_micro_batch_size=1)
    assert got == expected


def test_tp2_x_pp2_engine_matches_tp1(tmp_path: Path) -> None:
    """Four ranks: two stages of two TP ranks each (each stage with its own all-reduce segment)."""
    model = str(make_tiny_model_dir(tmp_path, "llama"))
    start_ranks_ahead(engine_config(model, 2, 2))
    expected, _ = run_engine(model, 1, 1)
    got, layout = run_engine(model, 2, 2)
    assert got == expected
    assert layout["tp_size"] == 2 and layout["pp_size"] == 2
    assert [(r["tp_rank"], r["pp_rank"]) for r in layout["ranks"]] == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert all(r["num_kv_heads"] == 1 for r in layout["ranks"])  # GQA 4/2: one KV head a TP rank


def check_server_parity(model: str, num_new_tokens: int, parallel_flags: list[str]) -> dict[str, Any]:
    """The server's greedy tokens with ``parallel_flags`` equal the in-process PP=1 engine's; returns
    /get_server_info's parallel layout."""
    prompts, expected = reference_greedy(PARITY_PROMPTS, num_new_tokens, model=model, dtype="float32",
                                         num_threads=1, max_total_tokens=2048)
    with ServerProcess([model, *parallel_flags, "--dtype", "float32", "--num-threads", "1",
                        "--max-total-tokens", "2048"]) as server:
        got = [completion_tokens(server, prompt, num_new_tokens) for prompt in prompts]
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    assert got == expected
    return dict(info["parallel"])


@pytest.mark.slow   # the engine-level PP parity tests above run in the default suite
def test_pp2_server_matches_pp1_smollm2() -> None:
    """SmolLM2-135M: 30 layers, 15 per stage, tied head."""
    layout = check_server_parity("smollm2-135m", 16, ["--pp-size", "2"])
    assert layout["pp_size"] == 2 and len(layout["ranks"]) == 2


@pytest.mark.slow
def test_pp2_server_matches_pp1_qwen_coder_05b() -> None:
    layout = check_server_parity("qwen2.5-coder-0.5b", 24, ["--pipeline-parallel-size", "2"])
    assert layout["pp_size"] == 2


@pytest.mark.slow
def test_tp2_x_pp2_server_matches_pp1_gemma3_270m() -> None:
    """Gemma 3 270M: 18 layers in two stages, each stage's one KV head replicated on its 2 TP ranks."""
    layout = check_server_parity("gemma3-270m", 16, ["--tp", "2", "-pp", "2"])
    assert layout["tp_size"] == 2 and layout["pp_size"] == 2 and len(layout["ranks"]) == 4


def test_killing_a_stage_fails_the_request_and_ends_the_server(tmp_path: Path) -> None:
    """Rank 1 is the first stage: while the engine process (the last stage) waits for its hidden
    states, it is killed; the stream ends with an error naming it and the server exits."""
    check_killed_rank_ends_the_server(
        str(make_tiny_model_dir(tmp_path, "llama")), ["--pp-size", "2"],
        "pipeline stage 0 (rank 1, tp rank 0) (pid {pid}) was killed by SIGKILL", "pipeline stage 0")


def test_more_stages_than_layers_is_a_clear_error(tmp_path: Path) -> None:
    """The tiny Llama has 2 layers: 3 stages cannot each hold one. Start-up fails naming the flag
    (from whichever rank builds its stage first) and leaves no rank process behind."""
    model = str(make_tiny_model_dir(tmp_path, "llama"))
    with pytest.raises((ValueError, RankFailedError),
                       match="--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        run_engine(model, 1, 3)
    assert [child for child in psutil.Process().children(recursive=True)
            if "servelm.workers.worker" in " ".join(child.cmdline())] == []
