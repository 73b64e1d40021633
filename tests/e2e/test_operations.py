"""Metrics, request logs, the stats line, CORS and the body limit on a live SmolLM2 server."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.config import ServerConfig

from .conftest import OPS_MODEL, OPS_ORIGIN


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics keyed by (name, sorted labels)."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": OPS_MODEL, **labels}.items())))
    return samples.get(key, 0.0)


def test_metrics_count_known_traffic(ops_server):
    before = scrape(ops_server)
    usages = []
    for prompt in ("The capital of France is", "def add(a, b):", "One, two,"):
        body = {"model": OPS_MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{ops_server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    body = {"model": OPS_MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{ops_server.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                usages.append(json.loads(line[6:])["usage"])
    after = scrape(ops_server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    output_tokens = sum(u["completion_tokens"] for u in usages)
    assert len(usages) == 4 and output_tokens == 3 * 6 + 5
    assert delta("servelm:prompt_tokens_total") == prompt_tokens
    assert delta("servelm:generation_tokens_total") == output_tokens
    assert delta("servelm:request_finished_total", finish_reason="length") == 4
    assert delta("servelm:time_to_first_token_seconds_count") == 4
    assert delta("servelm:e2e_request_latency_seconds_count") == 4
    assert delta("servelm:inter_token_latency_seconds_count") == output_tokens - 4
    # Every request took more than 0 s and each fell in the +Inf bucket.
    assert delta("servelm:e2e_request_latency_seconds_sum") > 0
    assert delta("servelm:e2e_request_latency_seconds_bucket", le="+Inf") == 4
    # Gauges are read from the engine at scrape time: idle now.
    assert value(after, "servelm:num_requests_running") == 0
    assert value(after, "servelm:num_requests_waiting") == 0
    assert value(after, "servelm:kv_cache_usage_ratio") == 0
    assert ("servelm:prefix_cache_hit_rate", (("model_name", OPS_MODEL),)) in after


def test_request_log_and_stats_line(ops_server):
    body = {"model": OPS_MODEL, "prompt": "Tell me a long story about a dragon please", "max_tokens": 30,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{ops_server.base_url}/v1/completions", json=body, timeout=60)
    request_id = response.json()["id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and request_id not in ops_server.log_path.read_text():
        time.sleep(0.2)
    log = ops_server.log_path.read_text(errors="replace")
    line = next(x for x in log.splitlines() if request_id in x and "servelm.requests" in x)
    assert "finish_reason=length" in line and "output_tokens=30" in line
    assert "params=SamplingParams(max_tokens=30" in line  # level >= 1
    assert " output='" in line and "...(+" in line  # level 2, cut to --max-log-len 20
    assert "gen_throughput=" in log and "cache_hit_rate=" in log and "queued=" in log


def test_cors(ops_server):
    preflight = httpx.options(f"{ops_server.base_url}/v1/completions", headers={
        "Origin": OPS_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == OPS_ORIGIN
    models = httpx.get(f"{ops_server.base_url}/v1/models", headers={"Origin": OPS_ORIGIN})
    assert models.headers["access-control-allow-origin"] == OPS_ORIGIN
    other = httpx.get(f"{ops_server.base_url}/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_limit_is_413(ops_server, chunked):
    limit = ServerConfig().max_request_body_bytes   # the default (the ops server sets none)
    big = json.dumps({"model": OPS_MODEL, "prompt": "a" * (limit + (1 << 20))}).encode()
    content = iter([big[i:i + 65536] for i in range(0, len(big), 65536)]) if chunked else big
    response = httpx.post(f"{ops_server.base_url}/v1/completions", content=content,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "bytes" in error["message"]
    assert httpx.get(f"{ops_server.base_url}/health").status_code == 200


def test_real_prometheus_scrape(ops_server, tmp_path):
    """A real Prometheus (Debian package `prometheus`) scrapes /metrics; skipped without it."""
    import shutil
    import socket
    import subprocess

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    target = ops_server.base_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text("scrape_configs:\n  - job_name: servelm\n    scrape_interval: 1s\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
    httpx.post(f"{ops_server.base_url}/v1/completions", timeout=60, json={
        "model": OPS_MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    expected = value(scrape(ops_server), "servelm:generation_tokens_total")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, got = time.monotonic() + 60, None
        while time.monotonic() < deadline and got != expected:
            time.sleep(1)
            try:
                result = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5, params={
                    "query": 'servelm:generation_tokens_total{model_name="%s"}' % OPS_MODEL}).json()
                series = result["data"]["result"]
                got = float(series[0]["value"][1]) if series else None
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        assert got == expected
    finally:
        process.terminate()
        process.wait(timeout=30)
