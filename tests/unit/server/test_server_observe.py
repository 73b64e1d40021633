"""Metrics and request logs through build_app on the fake engine (exact counts, no model)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, make_config

from servelm.config import EngineConfig, ObservabilityConfig
from servelm.server.app import build_app


def observed_client(engine: FakeEngine, **observability):
    from fastapi.testclient import TestClient

    base = make_config()
    config = EngineConfig(model=base.model, server=base.server,
                          observability=ObservabilityConfig(**observability))
    return TestClient(build_app(engine, config), raise_server_exceptions=False)


def samples(client) -> dict:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_after_known_traffic(engine: FakeEngine) -> None:
    client = observed_client(engine, enable_metrics=True, bucket_time_to_first_token=[0.5, 1.0])
    label = (("model_name", "tiny-model"),)
    for max_tokens in (3, 5):  # "Hi there" is 8 tokens: both end on length
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": max_tokens}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "xy"}).status_code == 200  # 8 + EOS: stop
    got = samples(client)
    assert got[("servelm:request_finished_total", tuple(sorted(label + (("finish_reason", "length"),))))] == 2
    assert got[("servelm:request_finished_total", tuple(sorted(label + (("finish_reason", "stop"),))))] == 1
    assert got[("servelm:prompt_tokens_total", label)] == 1 + 1 + 2
    assert got[("servelm:generation_tokens_total", label)] == 3 + 5 + 9
    assert got[("servelm:time_to_first_token_seconds_count", label)] == 3
    assert got[("servelm:inter_token_latency_seconds_count", label)] == 2 + 4 + 8
    assert got[("servelm:e2e_request_latency_seconds_count", label)] == 3
    # --bucket-time-to-first-token sets the bounds.
    bounds = {dict(k[1])["le"] for k in got if k[0] == "servelm:time_to_first_token_seconds_bucket"}
    assert bounds == {"0.5", "1.0", "+Inf"}
    assert got[("servelm:prefix_cache_hit_rate", label)] == 0.0


def test_metrics_route_only_when_enabled(engine: FakeEngine) -> None:
    response = observed_client(engine).get("/metrics")
    assert response.status_code == 404 and response.json()["error"]["message"]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_request_log_levels(engine: FakeEngine, caplog: pytest.LogCaptureFixture, level: int) -> None:
    client = observed_client(engine, log_requests=True, log_requests_level=level, max_log_len=4)
    logger = logging.getLogger("servelm.requests")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="servelm.requests"):
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    finally:
        logger.removeHandler(caplog.handler)
    (line,) = {r.getMessage() for r in caplog.records if r.name == "servelm.requests"}
    assert "finish_reason=length" in line and "output_tokens=5" in line
    assert ("params=SamplingParams" in line) == (level >= 1)
    assert (" output='" in line) == (level >= 2)
    if level == 2:
        assert "output='Hi ...(+" in line  # cut to --max-log-len 4
    if level == 3:
        assert "output='Hi th'" in line


def test_no_request_log_by_default(engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="servelm.requests"):
        observed_client(engine).post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert not [r for r in caplog.records if r.name == "servelm.requests"]


def test_body_limit_and_cors(engine: FakeEngine) -> None:
    from fastapi.testclient import TestClient

    base = make_config(max_request_body_bytes=1000, allowed_origins='["http://a.example"]')
    client = TestClient(build_app(engine, base), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),
                          headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    small = client.post("/v1/completions", content=iter([b'{"prompt": "x", ', b'"max_tokens": 2}']),
                        headers={"Content-Type": "application/json"})
    assert small.status_code == 200, small.text  # a chunked body under the limit is replayed
    allowed = client.get("/v1/models", headers={"Origin": "http://a.example"})
    assert allowed.headers["access-control-allow-origin"] == "http://a.example"
    assert "access-control-allow-origin" not in client.get(
        "/v1/models", headers={"Origin": "http://b.example"}).headers
