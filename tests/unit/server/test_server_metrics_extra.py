"""Token histograms, custom labels from a request header, the request time stats log, and the
push of the metrics to a Prometheus Pushgateway (Debian's prometheus-pushgateway when installed,
and a local HTTP receiver that checks the request itself)."""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, make_config

from servelm import cli_args
from servelm.config import EngineConfig, ObservabilityConfig, token_buckets
from servelm.engine.outputs import RequestOutput
from servelm.server.app import build_app
from servelm.server.push import PASSWORD_ENV, USER_ENV


def app_for(engine: FakeEngine, **observability: Any) -> Any:
    base = make_config()
    config = EngineConfig(model=base.model, server=base.server,
                          observability=ObservabilityConfig(**observability))
    return build_app(engine, config)


def client_for(app: Any) -> Any:
    from fastapi.testclient import TestClient

    return TestClient(app, raise_server_exceptions=False)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_bucket_rules() -> None:
    """SGLang's rules: tse is MIDDLE and MIDDLE +- BASE^i, i = 1..ceil(COUNT/2), floored at 0."""
    assert token_buckets("--x", ["tse", "1000", "2", "5"], ()) == [992, 996, 998, 1000, 1002, 1004, 1008]
    assert token_buckets("--x", ["tse", "3", "2", "4"], ()) == [0, 1, 3, 5, 7]
    assert token_buckets("--x", ["custom", "10", "1", "5"], ()) == [1, 5, 10]
    assert token_buckets("--x", ["default"], (5.0, 1.0)) == [1, 5]
    for bad in (["tse", "1", "1", "3"], ["tse", "1", "2"], ["custom"], ["linear", "1"], ["custom", "a"]):
        with pytest.raises(ValueError, match="--x"):
            token_buckets("--x", bad, ())


def test_token_histograms_and_custom_labels(engine: FakeEngine) -> None:
    app = app_for(engine, enable_metrics=True, collect_tokens_histogram=True,
                  prompt_tokens_buckets=["custom", "1", "2", "4"],
                  generation_tokens_buckets=["tse", "5", "2", "4"],
                  tokenizer_metrics_allowed_custom_labels=["tenant", "tier"])
    client = client_for(app)
    header = {"x-custom-labels": '{"tenant": "acme", "other": "ignored"}'}
    for max_tokens in (3, 4):
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": max_tokens},
                           headers=header).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 5}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"x-custom-labels": "not json"}).status_code == 200
    got = samples(client.get("/metrics").text)
    acme = (("model_name", "tiny-model"), ("tenant", "acme"), ("tier", ""))
    none = (("model_name", "tiny-model"), ("tenant", ""), ("tier", ""))
    assert got[("servelm:generation_tokens_total", acme)] == 3 + 4
    assert got[("servelm:generation_tokens_total", none)] == 5 + 1
    assert got[("servelm:time_to_first_token_seconds_count", acme)] == 2
    assert got[("servelm:request_finished_total", tuple(sorted(acme + (("finish_reason", "length"),))))] == 2

    def buckets(name: str, labels: tuple[tuple[str, str], ...]) -> dict[str, float]:
        return {dict(key[1])["le"]: value for key, value in got.items()
                if key[0] == name + "_bucket" and tuple(p for p in key[1] if p[0] != "le") == labels}

    # Prompt "x" is 1 token, "xy" 2; bounds 1, 2, 4 (custom); outputs 3, 4 / 5, 1 in 1, 3, 5, 7, 9.
    assert buckets("servelm:prompt_tokens_histogram", acme) == {"1.0": 2, "2.0": 2, "4.0": 2, "+Inf": 2}
    assert buckets("servelm:prompt_tokens_histogram", none) == {"1.0": 1, "2.0": 2, "4.0": 2, "+Inf": 2}
    assert buckets("servelm:generation_tokens_histogram", acme) == {
        "1.0": 0, "3.0": 1, "5.0": 2, "7.0": 2, "9.0": 2, "+Inf": 2}
    assert got[("servelm:generation_tokens_histogram_sum", none)] == 6
    # Engine gauges carry the model name only.
    assert got[("servelm:num_requests_running", (("model_name", "tiny-model"),))] == 0


def test_custom_label_values_are_bounded(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.server import observe

    monkeypatch.setattr(observe, "MAX_LABEL_SETS", 2)
    client = client_for(app_for(engine, enable_metrics=True,
                                tokenizer_metrics_allowed_custom_labels=["tenant"]))
    for tenant in ("a", "b", "c", "a", "x" * 200):
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                    headers={"x-custom-labels": f'{{"tenant": "{tenant}"}}'})
    got = samples(client.get("/metrics").text)
    counts = {dict(key[1])["tenant"]: value for key, value in got.items()
              if key[0] == "servelm:generation_tokens_total"}
    assert counts == {"a": 2, "b": 1, "": 2}  # c: past the bound; the long value: too long


def test_histograms_off_by_default(engine: FakeEngine) -> None:
    client = client_for(app_for(engine, enable_metrics=True))
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    names = {key[0] for key in samples(client.get("/metrics").text)}
    assert "servelm:generation_tokens_total" in names
    assert not any("tokens_histogram" in name for name in names)


def test_metric_flags_need_their_feature() -> None:
    with pytest.raises(cli_args.CliError, match="--collect-tokens-histogram has no effect without --enable-metrics"):
        cli_args.build_config(["--collect-tokens-histogram"])
    with pytest.raises(cli_args.CliError, match="--prompt-tokens-buckets"):
        cli_args.build_config(["--enable-metrics", "--collect-tokens-histogram",
                               "--prompt-tokens-buckets", "tse", "1", "0.5", "3"])
    with pytest.raises(cli_args.CliError, match="not a usable Prometheus label"):
        cli_args.build_config(["--tokenizer-metrics-allowed-custom-labels", "bad-name"])
    with pytest.raises(cli_args.CliError, match="--push_interval has no effect without --metric-gateway"):
        cli_args.build_config(["--push_interval", "5"])
    with pytest.raises(cli_args.CliError, match="KEY=VALUE"):
        cli_args.build_config(["--metric_gateway", "h:1", "--grouping_key", "novalue"])
    config = cli_args.build_config(["--metric_gateway", "h:1", "--grouping_key", "a=1", "b=2",
                                    "--job_name", "j", "--push_interval", "2.5"])
    assert config.observability.grouping_key_dict == {"a": "1", "b": "2"}


class TimedEngine(FakeEngine):
    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        arrival = time.time()
        async for output in super().generate(*args, **kwargs):
            if output.is_finished:
                output.timings = {"arrival": arrival, "scheduled": arrival + 0.25,
                                  "first_token": arrival + 0.75, "finished": arrival + 2.0,
                                  "detokenize_s": 0.125}
            yield output


def test_request_time_stats_log(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(app_for(TimedEngine(tokenizer), enable_request_time_stats_logging=True))
    logger = logging.getLogger("servelm.requests")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="servelm.requests"):
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    finally:
        logger.removeHandler(caplog.handler)
    (line,) = {r.getMessage() for r in caplog.records if "time stats" in r.getMessage()}
    assert "queue=0.2500s prefill=0.5000s decode=1.2500s detokenize=0.1250s" in line
    assert "ttft=" in line and "e2e=" in line and "output_tokens=4" in line


# --- push ----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def pushgateway() -> Iterator[str]:
    """Debian's prometheus-pushgateway on a free loopback port."""
    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        pytest.skip("prometheus-pushgateway is not installed (apt-get install prometheus-pushgateway)")
    address = f"127.0.0.1:{_free_port()}"
    # Debian's default persists to /var/lib/prometheus/pushgateway.data: memory only here.
    process = subprocess.Popen([binary, f"--web.listen-address={address}", "--persistence.file="],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://{address}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "pushgateway did not start"
            time.sleep(0.1)
        yield address
    finally:
        process.terminate()
        process.wait(10)


def test_push_to_a_real_pushgateway(engine: FakeEngine, pushgateway: str) -> None:
    app = app_for(engine, metric_gateway=pushgateway, job_name="servelm-test",
                  grouping_key=["instance=node1"], collect_tokens_histogram=False)
    client = client_for(app)
    assert client.get("/metrics").status_code == 404  # pushing does not serve /metrics
    for max_tokens in (2, 3):
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": max_tokens})
    asyncio.run(app.state.pusher.push_once(app.state.serving.engine))
    got = samples(httpx.get(f"http://{pushgateway}/metrics", timeout=5).text)
    labels = (("instance", "node1"), ("job", "servelm-test"), ("model_name", "tiny-model"))
    assert got[("servelm:generation_tokens_total", labels)] == 5
    assert got[("servelm:prompt_tokens_total", labels)] == 2
    assert got[("servelm:kv_cache_usage_ratio", labels)] == 0.0  # engine gauges are pushed too
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    asyncio.run(app.state.pusher.push_once(app.state.serving.engine))
    got = samples(httpx.get(f"http://{pushgateway}/metrics", timeout=5).text)
    assert got[("servelm:generation_tokens_total", labels)] == 9  # a push replaces the group


class Receiver:
    """A local HTTP server recording each request's method, path, headers and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append((self.command, self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_PUT = do_POST = _record  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_push_loop_request_and_basic_auth(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push itself: PUT /metrics/job/<job>/<key>/<value> of the text exposition, every
    --push-interval, with basic auth under --enable_monitor_auth."""
    monkeypatch.setenv(USER_ENV, "prom")
    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    receiver = Receiver()
    try:
        app = app_for(engine, metric_gateway=receiver.address, job_name="j", push_interval=0.05,
                      grouping_key=["zone=a"], enable_monitor_auth=True)
        client_for(app).post("/v1/completions", json={"prompt": "x", "max_tokens": 3})

        async def run_a_while() -> None:
            task = asyncio.create_task(app.state.pusher.run(lambda: app.state.serving.engine))
            await asyncio.sleep(0.5)
            task.cancel()

        asyncio.run(run_a_while())
    finally:
        receiver.close()
    assert len(receiver.requests) >= 3
    method, path, headers, body = receiver.requests[0]
    assert (method, path) == ("PUT", "/metrics/job/j/zone/a")
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"prom:s3cret").decode()
    got = samples(body.decode())
    assert got[("servelm:generation_tokens_total", (("model_name", "tiny-model"),))] == 3


def test_monitor_auth_needs_credentials(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(USER_ENV, raising=False)
    with pytest.raises(ValueError, match=USER_ENV):
        app_for(engine, metric_gateway="127.0.0.1:1", enable_monitor_auth=True)
