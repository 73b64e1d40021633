"""Server side of the prefix cache and scheduling: /flush_cache, cached-token reporting, the
per-request priority field and the statuses of requests the engine refuses up front."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.testclient import TestClient
from server_fakes import MODEL_NAME, FakeEngine, make_config

from servelm.config import SchedulerConfig
from servelm.engine.frontdoor import ModelInfo
from servelm.server.app import build_app


class PoolEngine(FakeEngine):
    """A fake engine whose KV pool holds 40 tokens."""

    @property
    def model_info(self) -> ModelInfo:
        return dataclasses.replace(super().model_info, kv_pool_tokens=40)


def client_for(engine: FakeEngine, **scheduler: Any) -> TestClient:
    config = dataclasses.replace(make_config(), scheduler=SchedulerConfig(**scheduler))
    return TestClient(build_app(engine, config), raise_server_exceptions=False)


def complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", **body})


def test_flush_cache_when_idle_and_refused_while_busy(engine: FakeEngine, client) -> None:
    response = client.post("/flush_cache")
    assert response.status_code == 200 and response.json()["success"] is True
    engine.requests.append(("busy", [1], None))  # one request still in flight
    response = client.post("/flush_cache")
    assert response.status_code == 400
    assert "running" in response.json()["error"]["message"]


def test_expert_distribution_routes_without_a_recorder_say_why(client) -> None:
    for action in ("start", "stop", "dump"):
        response = client.post(f"/{action}_expert_distribution_record")
        assert response.status_code == 400
        assert "--expert-distribution-recorder-mode" in response.json()["error"]["message"]


def test_priority_needs_priority_scheduling(engine: FakeEngine, client) -> None:
    response = complete(client, priority=3, max_tokens=2)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "--enable-priority-scheduling" in error["message"]
    assert complete(client, max_tokens=2).status_code == 200
    assert engine.priorities == [0]


def test_priority_reaches_the_engine(engine: FakeEngine) -> None:
    client = client_for(engine, enable_priority_scheduling=True)
    assert complete(client, priority=7, max_tokens=2).status_code == 200
    response = client.post("/generate", json={"text": "hi", "priority": -2,
                                              "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200, response.text
    chat = client.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "priority": 1,
        "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert engine.priorities == [7, -2, 1]


def test_engine_refusals_keep_their_status(engine: FakeEngine, client) -> None:
    engine.error, engine.error_status = "the server is busy: 4 requests are waiting", 503
    response = complete(client, max_tokens=2)
    assert response.status_code == 503 and "busy" in response.json()["error"]["message"]
    engine.error_status = 400
    assert complete(client, max_tokens=2).status_code == 400
    native = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert native.status_code == 400
    engine.error_status = None  # a failure while running stays a 500
    assert complete(client, max_tokens=2).status_code == 500


def test_request_that_can_never_fit_the_pool_is_400_up_front(tokenizer: Any) -> None:
    engine = PoolEngine(tokenizer)
    client = client_for(engine)
    response = complete(client, max_tokens=50)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "pool" in error["message"]
    assert engine.requests == []  # refused before reaching the engine
    # A default max_tokens is capped to what the pool holds instead.
    assert complete(client).status_code == 200
    assert engine.requests[-1][2].max_tokens <= 40


class DPAttentionPoolEngine(FakeEngine):
    """A fake DP-attention engine: 80 tokens of KV over two ranks, 40 a rank (a request runs on one)."""

    @property
    def model_info(self) -> ModelInfo:
        return dataclasses.replace(super().model_info, kv_pool_tokens=80, kv_tokens_per_request=40)


def test_a_dp_attention_request_must_fit_one_rank_s_pool(tokenizer: Any) -> None:
    """A request that fits all ranks' pools together but not one rank's is a 400 naming the rank's
    pool, never sent to the engine; a default max_tokens is capped to one rank's pool."""
    engine = DPAttentionPoolEngine(tokenizer)
    client = client_for(engine)
    response = complete(client, max_tokens=50)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "one DP-attention rank's KV cache pool" in error["message"]
    assert "(40 tokens" in error["message"]
    assert engine.requests == []
    assert complete(client, max_tokens=30).status_code == 200
    assert complete(client).status_code == 200
    assert engine.requests[-1][2].max_tokens <= 40
