"""The one-sided transfer backends (nixl, mooncake: the prefill engine writes the K/V straight into
the decode engine's registered pool) between two real engines in this process, on a tiny
random-weight model (and DeepSeek-V3's latent pool): greedy outputs identical to one co-located engine with only the blocks the
decode side lacks written, float8 K/V as stored, a cancel acked before the decode side lets its
destination blocks go, a backend mismatch refused, a dead decode agent's write failing with the
prefill pool freed. Skipped, naming the pip command, where a backend's package is absent."""

from __future__ import annotations

import importlib

import pytest

from servelm.disagg.spec import KVTransfer
from tests.e2e.server_process import free_port
from tests.e2e.test_disaggregation_tiny import (PARAMS, assert_idle,
                                                check_greedy_identical_and_only_missing_blocks_sent,
                                                make_engine, run_pair, wait_for)
from tests.tiny_models import make_tiny_model_dir

INSTALL = {"nixl": ("pip install --no-deps nixl nixl-cu12", ("nixl._api", "nixl_cu12._api")),
           "mooncake": ("pip install mooncake-transfer-engine-non-cuda (and apt-get install "
                        "libibverbs1)", ("mooncake.engine",))}


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:  # absent, or present without its system library (libibverbs1)
        return False
    return True


def backend_param(name: str) -> object:
    command, modules = INSTALL[name]
    missing = not any(importable(m) for m in modules)
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"{name} absent: {command}"))


BACKENDS = [backend_param("nixl"), backend_param("mooncake")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_identical_to_colocated_and_only_missing_blocks_written(model_path, backend, kv_dtype):
    check_greedy_identical_and_only_missing_blocks_sent(model_path, kv_dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_holds_destination_blocks_until_the_cancel_is_acked(model_path, backend):
    port = free_port()
    prefill = make_engine(model_path, "prefill", port, backend=backend)
    decode = make_engine(model_path, "decode", backend=backend)
    try:
        assert decode.add_request("gone", list(range(3, 40)), PARAMS,
                                  kv_transfer=KVTransfer("decode", "10/0", "127.0.0.1", port)) is None
        decode.step()  # reserves 5 blocks, holds them for the writer, sends the pull
        wait_for(lambda: prefill.stats()["disaggregation_num_waiting_pulls"] == 1, prefill)
        assert decode.stats()["disaggregation_num_held_blocks"] == 5
        assert decode.abort_request("gone") is not None
        decode.step()  # sends the cancel; the blocks stay held until the prefill side answers
        assert decode.stats()["num_used_blocks"] == 5
        wait_for(lambda: prefill.stats()["disaggregation_num_waiting_pulls"] == 0, prefill)
        wait_for(lambda: decode.stats()["disaggregation_num_held_blocks"] == 0, decode)
        assert_idle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_mismatch_is_an_error_and_both_pools_go_idle(model_path, backend):
    port = free_port()
    prefill = make_engine(model_path, "prefill", port, backend=backend)
    decode = make_engine(model_path, "decode", backend="zmq")
    try:
        results = run_pair(prefill, decode, [("m", list(range(3, 30)))], port)
        assert results["m"].finish_reason == "error"
        assert f"--disaggregation-transfer-backend {backend}" in (results["m"].error or "")
        wait_for(lambda: prefill.stats()["disaggregation_num_parked_blocks"] == 0, prefill)
        assert_idle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_to_a_closed_decode_agent_fails_and_frees_the_prefill_blocks(model_path, backend):
    """The decode engine shuts down (its agent and registered memory gone) after its pull: the
    prefill side's write fails or is refused, and its parked blocks are freed."""
    port = free_port()
    prefill = make_engine(model_path, "prefill", port, backend=backend, timeout_s=2.0)
    decode = make_engine(model_path, "decode", backend=backend, timeout_s=2.0)
    tokens = list(range(3, 40))
    assert decode.add_request("d", tokens, PARAMS,
                              kv_transfer=KVTransfer("decode", "11/0", "127.0.0.1", port)) is None
    decode.step()
    wait_for(lambda: prefill.stats()["disaggregation_num_waiting_pulls"] == 1, prefill)
    decode.shutdown()
    try:
        assert prefill.add_request("p", tokens, PARAMS, kv_transfer=KVTransfer("prefill", "11/0")) is None
        wait_for(lambda: not prefill.has_unfinished() and prefill.stats()["num_used_blocks"] == 0
                 and prefill.stats()["disaggregation_num_sending"] == 0, prefill, timeout_s=10.0)
        assert prefill.stats()["disaggregation_num_transfers"] == 0
        assert_idle(prefill)
    finally:
        prefill.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_without_prefill_server_times_out_and_lets_its_blocks_go(model_path, backend):
    decode = make_engine(model_path, "decode", backend=backend, timeout_s=0.5)
    try:
        results = run_pair(None, decode, [("lost", list(range(5, 14)))], free_port())
        assert results["lost"].finish_reason == "error" and results["lost"].error_status == 503
        wait_for(lambda: decode.stats()["disaggregation_num_held_blocks"] == 0, decode)
        assert_idle(decode)
    finally:
        decode.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_latent_pool_over_a_one_sided_backend_equals_colocated(tmp_path, backend):
    """DeepSeek-V3's pool holds the compressed latent (an empty V side): the one-sided backends
    register and write that pool as they do per-head K/V, and greedy tokens equal one co-located
    engine's, with only the decode side's missing blocks written."""
    check_greedy_identical_and_only_missing_blocks_sent(make_tiny_model_dir(tmp_path, "deepseek_v3"), "auto",
                                                        backend)
