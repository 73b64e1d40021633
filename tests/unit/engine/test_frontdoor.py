"""The front door (servelm.engine.frontdoor): typed messages between the front end and an engine
process, one submission path for generation and embedding, a frozen ModelInfo."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import zmq

from servelm.config import EngineConfig
from servelm.engine.async_engine import AsyncEngine, _Replica
from servelm.engine.frontdoor import (PROTOCOL_VERSION, AbortRequest, EngineReady, ModelInfo,
                                      SubmitRequest)
from servelm.engine.outputs import RequestOutput
from servelm.sampling.params import SamplingParams

ENGINE_INFO = {  # what LLMEngine.model_info holds for a PD prefill server with LoRA
    "model_path": "/models/m", "served_model_name": "m", "architecture": "LlamaForCausalLM",
    "vocab_size": 300, "description": "d", "kv_cache_bytes": 1024, "load_time_s": 0.5,
    "device": "cpu", "parallel": {"tp_size": 1}, "context_length": 64, "eos_token_ids": [2],
    "num_blocks": 8, "block_size": 16, "kv_pool_tokens": 128, "task": "generate",
    "is_generation": True, "lora": {"max_loras_per_batch": 2, "max_lora_rank": 8},
    "lora_adapters": [{"name": "a", "path": "/a"}], "disaggregation_mode": "prefill",
    "disaggregation_bootstrap_port": 8998, "disaggregation_transfer_backend": "zmq",
    "disaggregation_engine_id": "e"}


def test_model_info_is_frozen_and_answers_get_model_info_as_before() -> None:
    info = ModelInfo.from_engine(ENGINE_INFO)
    assert info.context_length == 64 and info.eos_token_ids == (2,) and info.is_generation
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.context_length = 1  # type: ignore[misc]
    flat = info.as_dict()
    expected = {k: v for k, v in ENGINE_INFO.items() if k != "lora_adapters"}
    assert flat == expected  # every key the engine reported, and nothing else
    embed = ModelInfo.from_engine({"context_length": 32, "task": "embed", "embedding_size": 8})
    assert not embed.is_generation and embed.as_dict()["is_generation"] is False


class Wire:
    """An AsyncEngine with one replica whose sockets we hold the other ends of."""

    def __init__(self) -> None:
        address = f"ipc:///tmp/servelm-test-frontdoor-{os.getpid()}-{id(self)}"
        self.push = zmq.Context.instance().socket(zmq.PUSH)
        self.push.bind(address)
        self.engine_side = zmq.Context.instance().socket(zmq.PULL)
        self.engine_side.connect(address)
        replica = _Replica(0, process=None, push=self.push, pull=None)  # type: ignore[arg-type]
        self.engine = AsyncEngine(EngineConfig(), [replica], socket_dir="",
                                  model_info=ModelInfo(context_length=64))

    def received(self) -> object:
        assert self.engine_side.poll(2000), "nothing was sent"
        return self.engine_side.recv_pyobj()

    def close(self) -> None:
        self.push.close(linger=0)
        self.engine_side.close(linger=0)


def test_generate_and_encode_send_one_submit_message_each() -> None:
    wire = Wire()

    async def run() -> tuple[RequestOutput, list[RequestOutput]]:
        encoded = asyncio.ensure_future(wire.engine.encode("e", [1, 2, 3], priority=2))
        while "e" not in wire.engine._queues:
            await asyncio.sleep(0)
        wire.engine._queues["e"].put_nowait(
            RequestOutput("e", [], "", finish_reason="stop", embedding=[0.5]))
        stream = wire.engine.generate("g", [4, 5], SamplingParams(max_tokens=3), group="grp",
                                      lora_name="a")
        first = asyncio.ensure_future(stream.__anext__())
        while "g" not in wire.engine._queues:
            await asyncio.sleep(0)
        wire.engine._queues["g"].put_nowait(RequestOutput("g", [7], "x", finish_reason="length"))
        return await encoded, [await first]

    try:
        embedded, generated = asyncio.run(run())
        assert embedded.embedding == [0.5] and generated[0].new_token_ids == [7]
        embed_message, generate_message = wire.received(), wire.received()
        assert embed_message == SubmitRequest("e", [1, 2, 3], None, 2)
        assert isinstance(generate_message, SubmitRequest) and not generate_message.is_embedding
        assert (generate_message.group, generate_message.lora_name) == ("grp", "a")
        assert generate_message.load_tokens == 2 + 3
        assert not wire.engine._queues and not wire.engine._owners  # both released, no abort sent
        assert not wire.engine_side.poll(100)
    finally:
        wire.close()


def test_a_cancelled_encode_is_aborted_by_message() -> None:
    wire = Wire()

    async def run() -> None:
        encoded = asyncio.ensure_future(wire.engine.encode("e", [1]))
        while "e" not in wire.engine._queues:
            await asyncio.sleep(0)
        encoded.cancel()
        with pytest.raises(asyncio.CancelledError):
            await encoded

    try:
        asyncio.run(run())
        assert isinstance(wire.received(), SubmitRequest)
        assert wire.received() == AbortRequest("e")
    finally:
        wire.close()


def test_an_engine_of_another_protocol_version_is_refused() -> None:
    address = f"ipc:///tmp/servelm-test-frontdoor-ready-{os.getpid()}"

    class Alive:
        def is_alive(self) -> bool:
            return True

    async def run(version: int) -> EngineReady:
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.bind(address)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        try:
            push.send_pyobj(EngineReady(ModelInfo(context_length=8), protocol_version=version))
            return await AsyncEngine._wait_ready(Alive(), pull)  # type: ignore[arg-type]
        finally:
            push.close(linger=0)
            pull.close(linger=0)

    assert asyncio.run(run(PROTOCOL_VERSION)).model_info.context_length == 8
    with pytest.raises(RuntimeError, match="front-door protocol 999"):
        asyncio.run(run(999))
