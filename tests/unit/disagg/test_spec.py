"""A request's transfer fields (SGLang's bootstrap_*, vLLM's kv_transfer_params) and the flags:
what each server role accepts, and the 400s naming the field."""

from __future__ import annotations

import pytest

from servelm.config import DisaggregationConfig, EngineConfig, parse_kv_transfer_config
from servelm.disagg.spec import KVTransfer, TransferRequestError, parse_transfers

SGLANG = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 9000, "bootstrap_room": 42}


def test_sglang_fields_key_each_choice_by_room_and_index():
    assert parse_transfers(SGLANG, "prefill", 2) == [KVTransfer("prefill", "42/0"),
                                                     KVTransfer("prefill", "42/1")]
    assert parse_transfers(SGLANG, "decode", 1) == [KVTransfer("decode", "42/0", "10.0.0.1", 9000)]
    batch = {"bootstrap_host": ["a", "b"], "bootstrap_port": [1, 2], "bootstrap_room": [7, 8]}
    assert parse_transfers(batch, "decode", 2) == [KVTransfer("decode", "7/0", "a", 1),
                                                   KVTransfer("decode", "8/0", "b", 2)]
    assert parse_transfers({}, "decode", 3) == [None] * 3  # a plain request runs co-located


@pytest.mark.parametrize("extra, mode, param", [
    (SGLANG, "null", "bootstrap_room"),
    ({**SGLANG, "bootstrap_room": "x"}, "decode", "bootstrap_room"),
    ({**SGLANG, "bootstrap_room": -1}, "prefill", "bootstrap_room"),
    ({**SGLANG, "bootstrap_port": 70000}, "decode", "bootstrap_port"),
    ({"bootstrap_room": 1}, "decode", "bootstrap_host"),
    ({**SGLANG, "kv_transfer_params": {"do_remote_decode": True}}, "prefill", "kv_transfer_params"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "decode", "kv_transfer_params"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}}, "decode",
     "kv_transfer_params"),
    ({"kv_transfer_params": "yes"}, "prefill", "kv_transfer_params"),
])
def test_bad_transfer_fields_name_the_field(extra, mode, param):
    with pytest.raises(TransferRequestError) as error:
        parse_transfers(extra, mode, 1)
    assert error.value.param == param


def test_vllm_two_call_flow_params():
    assert parse_transfers({"kv_transfer_params": {"do_remote_decode": True}}, "prefill", 1) == [
        KVTransfer("prefill", None, is_vllm=True)]
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 8998,
              "remote_request_id": "cmpl-1-0", "remote_block_ids": [3], "remote_engine_id": "e"}
    assert parse_transfers({"kv_transfer_params": params}, "decode", 1) == [
        KVTransfer("decode", "cmpl-1-0", "h", 8998)]
    with pytest.raises(TransferRequestError):
        parse_transfers({"kv_transfer_params": {"do_remote_decode": True}}, "prefill", 2)


def test_kv_transfer_config_maps_roles_and_connectors():
    assert parse_kv_transfer_config('{"kv_role": "kv_producer"}') == ("prefill", "zmq")
    assert parse_kv_transfer_config(
        '{"kv_role": "kv_consumer", "kv_connector": "ShmConnector"}') == ("decode", "shm")
    with pytest.raises(ValueError, match="kv_both"):
        parse_kv_transfer_config('{"kv_role": "kv_both", "kv_connector": "NixlConnector"}')
    with pytest.raises(ValueError, match="P2pNcclConnector"):
        parse_kv_transfer_config('{"kv_role": "kv_producer", "kv_connector": "P2pNcclConnector"}')
    config = DisaggregationConfig(kv_transfer_config='{"kv_role": "kv_consumer"}')
    assert config.mode == "decode" and config.is_enabled


def test_transfer_backends_needing_packages_are_refused_by_name(monkeypatch):
    """Without its package a backend is refused at start-up with the pip command (the package
    lookup is made to fail: the packages are installed on the machines that run the nixl tests)."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name in (
        "nixl", "nixl_cu12", "mooncake") else real_find_spec(name, *args))
    for backend, package in (("nixl", "--no-deps nixl nixl-cu12"),
                             ("mooncake", "mooncake-transfer-engine-non-cuda")):
        with pytest.raises(ValueError, match=f"pip install {package}"):
            DisaggregationConfig(disaggregation_mode="prefill", disaggregation_transfer_backend=backend)
    with pytest.raises(ValueError, match="pip install --no-deps nixl nixl-cu12"):
        DisaggregationConfig(kv_transfer_config='{"kv_role": "kv_consumer", "kv_connector": "NixlConnector"}')
    with pytest.raises(ValueError, match="--disaggregation-decode-dp 2.*servelm router"):
        DisaggregationConfig(disaggregation_decode_dp=2)


def test_decode_tp_is_a_prefill_servers_flag():
    assert DisaggregationConfig(disaggregation_mode="prefill", disaggregation_decode_tp=2).disaggregation_decode_tp == 2
    with pytest.raises(ValueError, match="--disaggregation-decode-tp is a prefill server's flag"):
        DisaggregationConfig(disaggregation_mode="decode", disaggregation_decode_tp=2)
    with pytest.raises(ValueError, match="--disaggregation-decode-tp must be at least 1"):
        DisaggregationConfig(disaggregation_mode="prefill", disaggregation_decode_tp=0)


def test_pd_servers_take_tensor_parallel_but_leave_data_parallel_to_the_router():
    config = EngineConfig.from_flat(dict(disaggregation_mode="decode", tensor_parallel_size=2))
    assert config.parallel.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="--dp-size > 1: data parallelism of PD servers is the router's"):
        EngineConfig.from_flat(dict(disaggregation_mode="decode", data_parallel_size=2))
    with pytest.raises(ValueError, match="--pp-size > 1"):
        EngineConfig.from_flat(dict(disaggregation_mode="prefill", pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="--distributed-executor-backend mp"):
        EngineConfig.from_flat(dict(disaggregation_mode="prefill", tensor_parallel_size=2,
                                    distributed_executor_backend="ray"))


def test_ib_device_only_with_the_nixl_backend():
    with pytest.raises(ValueError, match="--disaggregation-ib-device"):
        DisaggregationConfig(disaggregation_mode="decode", disaggregation_ib_device="mlx5_0:1")


def test_vllm_nixl_and_mooncake_connectors_select_their_backends():
    import importlib.util

    for connector, backend, modules in (("NixlConnector", "nixl", ("nixl", "nixl_cu12")),
                                        ("MooncakeConnector", "mooncake", ("mooncake",))):
        if all(importlib.util.find_spec(m) is None for m in modules):
            continue  # refused with the pip command: the test above
        config = DisaggregationConfig(
            kv_transfer_config=f'{{"kv_role": "kv_producer", "kv_connector": "{connector}"}}')
        assert (config.mode, config.transfer_backend) == ("prefill", backend)
