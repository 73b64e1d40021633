"""Request traces reach a real OTLP/HTTP receiver: a server in the test that accepts POST
/v1/traces and decodes the body with OpenTelemetry's own protobuf messages
(opentelemetry-proto's ExportTraceServiceRequest)."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from server_fakes import FakeEngine, make_config

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from servelm import cli_args  # noqa: E402
from servelm.config import EngineConfig, ObservabilityConfig  # noqa: E402
from servelm.engine.outputs import RequestOutput  # noqa: E402
from servelm.server.app import build_app  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
# Offsets of the engine's phases from the request's arrival there (seconds).
PHASES = {"scheduled": 0.25, "first_token": 0.5, "finished": 1.5}
DETOKENIZE_S = 0.125


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps every decoded ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = trace_service_pb2.ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.requests.append(message)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[Any]:
        return [span for message in self.requests for resource in message.resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


class TimedEngine(FakeEngine):
    """The fake engine, with the phase timings a real engine puts on a finished output."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        arrival = time.time()
        async for output in super().generate(*args, **kwargs):
            if output.is_finished:
                output.timings = {"arrival": arrival, "detokenize_s": DETOKENIZE_S,
                                  **{name: arrival + offset for name, offset in PHASES.items()}}
                self.timings = output.timings
            yield output


def traced_app(engine: FakeEngine, port: int, **observability: Any) -> Any:
    base = make_config()
    config = EngineConfig(model=base.model, server=base.server, observability=ObservabilityConfig(
        otlp_traces_endpoint=f"127.0.0.1:{port}", **observability))
    return build_app(engine, config)


def attributes(span: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for item in span.attributes:
        value = item.value
        kind = value.WhichOneof("value")
        result[item.key] = ([v.string_value for v in value.array_value.values]
                            if kind == "array_value" else getattr(value, kind))
    return result


def complete(app: Any, headers: dict[str, str]) -> None:
    from fastapi.testclient import TestClient

    client = TestClient(app, raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 5}, headers=headers)
    assert response.status_code == 200, response.text
    assert app.state.tracer.force_flush()


def test_span_per_request_continues_the_callers_trace(tokenizer: Any, receiver: Receiver) -> None:
    engine = TimedEngine(tokenizer)
    app = traced_app(engine, receiver.port)
    complete(app, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"})
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    (span,) = receiver.spans()
    assert span.name == "llm_request"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    got = attributes(span)
    ((request_id, prompt_ids, _),) = engine.requests
    assert got["gen_ai.request.id"] == request_id
    assert got["gen_ai.usage.prompt_tokens"] == len(prompt_ids)
    assert got["gen_ai.usage.completion_tokens"] == 5
    assert got["gen_ai.response.finish_reasons"] == ["length"]
    assert got["gen_ai.request.max_tokens"] == 5
    assert got["gen_ai.latency.time_in_queue"] == pytest.approx(PHASES["scheduled"])
    assert got["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        PHASES["first_token"] - PHASES["scheduled"])
    assert got["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        PHASES["finished"] - PHASES["first_token"])
    assert got["servelm.latency.time_in_detokenize"] == pytest.approx(DETOKENIZE_S)
    # The phases are events at the engine's times (nanoseconds since the epoch).
    events = {event.name: event.time_unix_nano for event in span.events}
    assert set(events) == {"queued", "scheduled", "first_token", "finished"}
    for name, offset in PHASES.items():
        assert events[name] / 1e9 == pytest.approx(engine.timings["arrival"] + offset, abs=1e-6)
    assert resource_service(receiver) == "servelm"


def resource_service(receiver: Receiver) -> str:
    (message,) = receiver.requests
    (resource,) = message.resource_spans
    return {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]


def test_detailed_traces_add_a_child_span_per_phase(tokenizer: Any, receiver: Receiver) -> None:
    engine = TimedEngine(tokenizer)
    app = traced_app(engine, receiver.port, collect_detailed_traces="all")
    complete(app, {})  # no traceparent: a trace of its own
    spans = {span.name: span for span in receiver.spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode", "detokenize"}
    root = spans.pop("llm_request")
    assert not root.parent_span_id and root.trace_id.hex() != TRACE_ID
    arrival = engine.timings["arrival"]
    bounds = {"queue": (0.0, PHASES["scheduled"]),
              "prefill": (PHASES["scheduled"], PHASES["first_token"]),
              "decode": (PHASES["first_token"], PHASES["finished"]),
              "detokenize": (PHASES["finished"] - DETOKENIZE_S, PHASES["finished"])}
    for name, span in spans.items():
        assert span.trace_id == root.trace_id and span.parent_span_id == root.span_id, name
        start, stop = bounds[name]
        assert span.start_time_unix_nano / 1e9 == pytest.approx(arrival + start, abs=1e-6), name
        assert span.end_time_unix_nano / 1e9 == pytest.approx(arrival + stop, abs=1e-6), name


def test_error_request_span_has_error_status(tokenizer: Any, receiver: Receiver) -> None:
    engine = FakeEngine(tokenizer, error="boom")
    app = traced_app(engine, receiver.port)
    from fastapi.testclient import TestClient

    TestClient(app, raise_server_exceptions=False).post("/v1/completions", json={"prompt": "x"})
    assert app.state.tracer.force_flush()
    (span,) = receiver.spans()
    assert span.status.code == span.status.STATUS_CODE_ERROR and "boom" in span.status.message


@pytest.mark.parametrize("value, url", [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("https://collector.example", "https://collector.example/v1/traces"),
    ("http://c:1/custom/path", "http://c:1/custom/path")])
def test_endpoint_forms(value: str, url: str) -> None:
    from servelm.server.tracing import endpoint_url

    assert endpoint_url(value) == url


def test_missing_sdk_is_a_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name.startswith("opentelemetry.sdk") else real(name, *a))
    with pytest.raises(cli_args.CliError, match=r"pip install 'servelm\[tracing\]'"):
        cli_args.build_config(["--enable-trace"])
    assert cli_args.build_config([]).observability.tracing is False


def test_detailed_traces_need_tracing() -> None:
    with pytest.raises(cli_args.CliError, match="--collect-detailed-traces needs tracing"):
        cli_args.build_config(["--collect-detailed-traces", "model"])
    with pytest.raises(cli_args.CliError, match="model, worker or all"):
        cli_args.build_config(["--enable-trace", "--collect-detailed-traces", "gpu"])
    config = cli_args.build_config(["--enable-trace", "--collect-detailed-traces", "model,worker"])
    assert config.observability.tracing
