"""Tensor parallelism: TP=2 greedy tokens are TP=1's (float32), in the engine and through the server,
and a rank killed mid-generation fails the request and ends the server with no orphan process.

Rank 1 is a real process and the ranks meet in real gloo collectives; each rank gets one thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import PARITY_PROMPTS, greedy, reference_greedy, start_ranks_ahead
from tests.tiny_models import make_tiny_model_dir

from .conftest import OPS_MODEL
from .server_process import KILL_TEST_FLAGS, ServerProcess, check_killing_rank_1_ends

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def engine_config(model: str, tp_size: int, **flags: Any) -> EngineConfig:
    return EngineConfig.from_flat(dict(model=model, dtype="float32", device="cpu", num_threads=1,
                                       tensor_parallel_size=tp_size, **flags))


def run_engine(model: str, tp_size: int, prompts: list[list[int]], **flags: Any) -> tuple[list[list[int]], dict[str, Any]]:
    engine = LLMEngine(engine_config(model, tp_size, **flags))
    try:
        return greedy(engine, prompts, PARAMS), engine.stats()["parallel"]
    finally:
        engine.shutdown()


# llama with -m slow: the same tiny Llama (GQA 4/2: one KV head a rank) at TP=2 with the same
# chunked prefill and pages runs in the default suite in test_pipeline_parallel's
# test_tp2_x_pp2_engine_matches_tp1 (two TP ranks in each of two stages; it checks the one KV head
# a rank too), and test_tp2_server_matches_tp1_smollm2 runs a GQA model at TP=2 without stages
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "gemma3_mqa"])
def test_tp2_engine_matches_tp1_on_tiny_models(tmp_path: Path, arch: str) -> None:
    """Tiny Llama (GQA 4/2) and a Gemma 3 with one KV head (replicated on both ranks); the long
    prompt is chunked (--chunked-prefill-size 8) so prefill chunks and decodes share steps."""
    model = str(make_tiny_model_dir(tmp_path, arch))
    prompts = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
    flags = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
    start_ranks_ahead(engine_config(model, 2, **flags))  # they import while tp 1 runs
    expected, _ = run_engine(model, 1, prompts, **flags)
    got, layout = run_engine(model, 2, prompts, **flags)
    assert got == expected
    assert layout["tp_size"] == 2 and [r["rank"] for r in layout["ranks"]] == [0, 1]
    assert layout["ranks"][1]["pid"] != os.getpid()
    assert all(r["num_kv_heads"] == 1 for r in layout["ranks"])


def completion_tokens(server: ServerProcess, prompt: list[int], max_tokens: int) -> list[int]:
    response = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True}}, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


def check_server_parity(model: str, num_new_tokens: int, tp1_server: ServerProcess | None = None,
                        tp2_server: ServerProcess | None = None) -> None:
    """The TP=2 server's greedy tokens equal TP=1's: ``tp1_server``'s (a running float32 server of
    ``model``), or else an in-process TP=1 engine's. The TP=2 server is ``tp2_server`` (a running
    float32 one of ``model``, one thread per rank), or else one started here."""
    if tp1_server is None:
        prompts, expected = reference_greedy(PARITY_PROMPTS, num_new_tokens, model=model, dtype="float32",
                                             num_threads=1, max_total_tokens=2048)
    else:
        prompts = [httpx.post(f"{tp1_server.base_url}/tokenize", json={"prompt": text}, timeout=30)
                   .json()["tokens"] for text in PARITY_PROMPTS]
        expected = [completion_tokens(tp1_server, prompt, num_new_tokens) for prompt in prompts]
    with contextlib.ExitStack() as stack:
        server = tp2_server or stack.enter_context(ServerProcess(
            [model, "--tp", "2", "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "2048"]))
        got = [completion_tokens(server, prompt, num_new_tokens) for prompt in prompts]
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    assert got == expected
    assert info["parallel"]["tp_size"] == 2 and len(info["parallel"]["ranks"]) == 2


@pytest.fixture(scope="module")
def tp2_servers() -> Iterator[Callable[[], ServerProcess]]:
    """The module's TP=2 SmolLM2-135M server (float32, one thread per rank, passive OpenMP waits):
    the parity test's, then the rank-kill test's, which ends it; a call after it ended (the kill
    test run first or alone) starts another. One start saved per run."""
    servers: list[ServerProcess] = []

    def running() -> ServerProcess:
        if not servers or servers[-1].process is None or servers[-1].process.poll() is not None:
            servers.append(ServerProcess([OPS_MODEL, "--tp", "2", *KILL_TEST_FLAGS, "--max-total-tokens", "2048"]))
            servers[-1].__enter__()
        return servers[-1]

    try:
        yield running
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def test_tp2_server_matches_tp1_smollm2(ops_server: ServerProcess,
                                       tp2_servers: Callable[[], ServerProcess]) -> None:
    """SmolLM2-135M: 9 query heads over 3 KV heads, split 6/2 and 3/1 across the two ranks. TP=1 is
    the session's operations server (the same model in float32, one engine): no engine of its own."""
    check_server_parity(OPS_MODEL, 16, tp1_server=ops_server, tp2_server=tp2_servers())


@pytest.mark.slow
def test_tp2_server_matches_tp1_qwen_coder_05b() -> None:
    check_server_parity("qwen2.5-coder-0.5b", 24)


@pytest.mark.slow
def test_tp2_server_matches_tp1_gemma3_270m() -> None:
    check_server_parity("gemma3-270m", 24)



def test_killing_a_rank_fails_the_request_and_ends_the_server(tp2_servers: Callable[[], ServerProcess]) -> None:
    """On the parity test's TP=2 server (after it: this ends the server)."""
    check_killing_rank_1_ends(tp2_servers(), "tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL",
                              "tensor-parallel rank 1")


def test_a_rank_that_never_joins_is_a_clear_error(tmp_path: Path) -> None:
    """A rank process needs seconds to import torch: with --dist-timeout 0.5 it cannot say hello
    in time. The engine fails naming the rank and the timeout, and leaves no process behind."""
    from servelm.distributed.errors import RankFailedError

    model = str(make_tiny_model_dir(tmp_path, "llama"))
    with pytest.raises(RankFailedError, match=r"ranks \[1\] did not start within --dist-timeout 0.5 s"):
        run_engine(model, 2, [[1, 2]], skip_tokenizer_init=True, max_total_tokens=256, dist_timeout=0.5)
    assert [child for child in psutil.Process().children(recursive=True)
            if "servelm.workers.worker" in " ".join(child.cmdline())] == []
