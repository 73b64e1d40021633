"""Prefill/decode disaggregation with tensor parallelism: a prefill and a decode LLMEngine in this
process (their ranks 1 in real worker processes, K/V over real pyzmq TCP sockets on 127.0.0.1),
tiny random-weight models, float32, one thread per rank.

Each side's pool holds its ranks' shares of the KV heads; a transfer carries every head, gathered
from the prefill ranks and split over the decode ranks, so prefill tp 1 -> decode tp 2, 2 -> 1
and 2 -> 2 all give the greedy tokens of one co-located single-rank engine, and both pools end
idle. GQA with the KV heads split (llama: 2 KV heads, one per rank), split unevenly
(llama_uneven: 3 KV heads, 2 + 1) and replicated (gemma3_mqa: one KV head on both ranks); float8
K/V through the shm backend.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from tests.e2e.server_process import free_port
from tests.e2e.test_disaggregation_tiny import PARAMS, assert_idle, prompts, run_pair, wait_for
from tests.engine_drive import greedy
from tests.tiny_models import make_tiny_model_dir

SLOW = pytest.mark.slow


def make_engine(path: Path, tp_size: int, mode: str = "null", port: int = 8998,
                **flags: object) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(dict(
        model=str(path), skip_tokenizer_init=True, dtype="float32", device="cpu", num_threads=1,
        tensor_parallel_size=tp_size, max_total_tokens=2048, page_size=8, chunked_prefill_size=64,
        max_prefill_tokens=256, disaggregation_mode=mode, disaggregation_bootstrap_port=port,
        disaggregation_transfer_timeout=20.0, **flags)))


@pytest.mark.parametrize("arch, prefill_tp, decode_tp, kv_dtype, backend", [
    ("llama", 2, 2, "auto", "zmq"),  # gathers and splits: the default run's case
    pytest.param("llama", 1, 2, "auto", "zmq", marks=SLOW),
    pytest.param("llama", 2, 1, "auto", "zmq", marks=SLOW),
    pytest.param("llama_uneven", 2, 1, "auto", "zmq", marks=SLOW),
    pytest.param("gemma3_mqa", 1, 2, "auto", "zmq", marks=SLOW),
    pytest.param("llama_uneven", 1, 2, "fp8_e4m3", "shm", marks=SLOW)])
def test_greedy_identical_to_single_rank_colocated(tmp_path: Path, arch: str, prefill_tp: int,
                                                   decode_tp: int, kv_dtype: str, backend: str) -> None:
    path = make_tiny_model_dir(tmp_path, arch)
    flags = dict(kv_cache_dtype=kv_dtype, disaggregation_transfer_backend=backend)
    reference = make_engine(path, 1, kv_cache_dtype=kv_dtype)
    token_lists = prompts(reference.runner.vocab_size)
    expected = greedy(reference, token_lists, PARAMS)
    reference.shutdown()
    port = free_port()
    prefill = make_engine(path, prefill_tp, "prefill", port, disaggregation_decode_tp=decode_tp, **flags)
    try:
        decode = make_engine(path, decode_tp, "decode", **flags)
        try:
            # the first alone: the decode side then holds the shared prefix, and later pulls skip it
            outputs = run_pair(prefill, decode, [("a0", token_lists[0])], port)
            outputs |= run_pair(prefill, decode, [(f"a{i}", t) for i, t in enumerate(token_lists) if i],
                                port)
            for index in range(len(token_lists)):
                output = outputs[f"a{index}"]
                assert output.finish_reason == "length", output.error
                assert output.new_token_ids == expected[index], index
            assert decode.stats()["disaggregation_bytes_received"] == \
                prefill.stats()["disaggregation_bytes_sent"]
            assert_idle(prefill, decode)
        finally:
            decode.shutdown()
    finally:
        prefill.shutdown()


def test_decode_tp_other_than_expected_is_a_clear_error(tmp_path: Path) -> None:
    """A prefill server without --disaggregation-decode-tp expects its own tp (SGLang's default):
    a decode server of another tp gets an error naming both sizes, and both pools end idle."""
    path = make_tiny_model_dir(tmp_path, "llama")
    port = free_port()
    prefill = make_engine(path, 1, "prefill", port)
    try:
        decode = make_engine(path, 2, "decode")
        try:
            outputs = run_pair(prefill, decode, [("m", [5, 6, 7, 8, 9, 10, 11, 12, 13])], port)
            assert outputs["m"].finish_reason == "error"
            assert "--tp-size 2" in (outputs["m"].error or "")
            assert "--disaggregation-decode-tp" in (outputs["m"].error or "")
            # the prefill side frees its parked K/V when the decode side's cancel arrives
            wait_for(lambda: prefill.stats()["disaggregation_num_parked_blocks"] == 0, prefill)
            assert_idle(prefill, decode)
        finally:
            decode.shutdown()
    finally:
        prefill.shutdown()


@SLOW
def test_router_over_a_tp1_prefill_and_a_tp2_decode_server_matches_one_server() -> None:
    """Real servers (SmolLM2-135M, float32, one thread per rank; its 3 KV heads split 2 + 1 on
    the decode server's ranks) behind `servelm router`: streaming and not, the greedy text of one
    co-located single-rank server, and both pools idle afterwards."""
    from .router_process import RouterProcess
    from .server_process import ServerProcess
    from .test_disaggregation_live import assert_idle as assert_servers_idle
    from .test_router import MODEL, WORKER_ARGS, streamed_text

    long_prompt = " ".join(f"item {i}," for i in range(60))
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
              for prompt in ("The capital of France is", long_prompt)]
    with ServerProcess(WORKER_ARGS) as colocated:
        expected = [httpx.post(f"{colocated.base_url}/v1/completions", json=body, timeout=120)
                    .json()["choices"][0]["text"] for body in bodies]
    bootstrap_port = free_port()
    with ServerProcess([*WORKER_ARGS, "--disaggregation-mode", "prefill", "--disaggregation-decode-tp",
                        "2", "--disaggregation-bootstrap-port", str(bootstrap_port)]) as prefill, \
            ServerProcess([*WORKER_ARGS, "--disaggregation-mode", "decode", "--tp-size", "2"]) as decode, \
            RouterProcess(["--prefill", prefill.base_url, str(bootstrap_port),
                           "--decode", decode.base_url]) as router:
        for body, text in zip(bodies, expected, strict=True):
            response = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
            assert streamed_text(router.base_url, "/v1/completions", body)[0] == text
        infos = [httpx.get(f"{s.base_url}/get_server_info", timeout=30).json() for s in (prefill, decode)]
        assert infos[1]["parallel"]["tp_size"] == 2
        assert [r["num_kv_heads"] for r in infos[1]["parallel"]["ranks"]] == [2, 1]
        assert infos[1]["disaggregation_num_transfers"] == 4
        assert_servers_idle({"prefill": prefill, "decode": decode})
