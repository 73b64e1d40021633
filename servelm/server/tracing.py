"""OpenTelemetry tracing of requests (--enable-trace, --otlp-traces-endpoint, --collect-detailed-traces).

``RequestTracer`` makes one span ("llm_request") per engine request in the server process. The
span starts when a route hands the request to the engine and ends when its finished output
arrives. Its phases come from the engine's wall-clock timings (``RequestOutput.timings``, same
host): events ``queued`` (the engine received it), ``scheduled`` (first computed), ``first_token``
and ``finished``; with --collect-detailed-traces also child spans ``queue``, ``prefill``,
``decode`` and ``detokenize`` (the last is the sum of the request's detokenize slices, placed
just before its end). Spans go out in batches over OTLP/HTTP (protobuf).

``RequestHeadersMiddleware`` keeps the headers a request's observation needs (``traceparent``,
``tracestate`` and the custom metric labels header) in a context variable that the engine
wrapper reads; an incoming W3C ``traceparent`` makes the span a child of the caller's span.

The SDK is optional (``servelm[tracing]``); ``check_sdk_available`` refuses the flags at
start-up when it is missing, and nothing here is imported otherwise.
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.config import EngineConfig

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
TRACE_HEADERS = ("traceparent", "tracestate")

REQUEST_HEADERS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar(
    "servelm_request_headers", default={})
"""The observed headers of the HTTP request being served (lower-case names)."""


def check_sdk_available() -> None:
    """ValueError with the install line when the SDK or its OTLP/HTTP exporter is missing."""
    for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(
                "--enable-trace/--otlp-traces-endpoint need the OpenTelemetry SDK and its "
                f"OTLP/HTTP exporter ({name} is not installed): pip install 'servelm[tracing]' "
                "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)")


def endpoint_url(value: str | None) -> str:
    """The collector URL: host:port gets http:// and /v1/traces; a URL without a path gets
    /v1/traces; unset: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else localhost:4318."""
    if value is None:
        return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or DEFAULT_ENDPOINT
    url = value.strip()
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if "/" not in rest:
        url = f"{scheme}://{rest}/v1/traces"
    return url


class RequestHeadersMiddleware:
    """Keeps the listed request headers in REQUEST_HEADERS while the request is served."""

    def __init__(self, app: ASGIApp, names: tuple[str, ...]) -> None:
        self.app = app
        self.names = {name.lower().encode("latin-1") for name in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kept = {name.decode("latin-1"): value.decode("latin-1")
                for name, value in scope.get("headers") or [] if name.lower() in self.names}
        token = REQUEST_HEADERS.set(kept)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_HEADERS.reset(token)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Spans of requests, exported in batches to the OTLP/HTTP collector."""

    def __init__(self, config: EngineConfig, exporter: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        observability = config.observability
        self.endpoint = endpoint_url(observability.otlp_traces_endpoint)
        self.detailed = observability.collect_detailed_traces is not None
        self.model_name = config.model.name
        self._provider = TracerProvider(resource=Resource.create(
            {"service.name": "servelm", "servelm.model": self.model_name}))
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter if exporter is not None else OTLPSpanExporter(endpoint=self.endpoint)))
        self._tracer = self._provider.get_tracer("servelm")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, request_id: str, prompt_tokens: int, params: Any) -> Any:
        """The request's span, a child of the incoming ``traceparent`` when there is one."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier=REQUEST_HEADERS.get())
        attributes: dict[str, Any] = {"gen_ai.request.id": request_id,
                                      "gen_ai.response.model": self.model_name,
                                      "gen_ai.usage.prompt_tokens": prompt_tokens}
        if params is not None:
            for name, key in (("max_tokens", "gen_ai.request.max_tokens"),
                              ("temperature", "gen_ai.request.temperature"),
                              ("top_p", "gen_ai.request.top_p"), ("n", "gen_ai.request.n")):
                value = getattr(params, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    attributes[key] = value
        return self._tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                       attributes=attributes)

    def finish(self, span: Any, record: Any) -> None:
        """End ``span`` with the request's outcome and phases (``record``: observe.RequestRecord)."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        end_s = time.time()
        span.set_attribute("gen_ai.usage.prompt_tokens", record.num_prompt_tokens)
        span.set_attribute("gen_ai.usage.completion_tokens", record.num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [record.finish_reason or "abort"])
        span.set_attribute("gen_ai.latency.e2e", end_s - record.start_wall_s)
        if record.first_token_wall_s is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token",
                               record.first_token_wall_s - record.start_wall_s)
        timings = record.timings or {}
        phases = phase_durations(timings)
        for name, key in (("queue", "gen_ai.latency.time_in_queue"),
                          ("prefill", "gen_ai.latency.time_in_model_prefill"),
                          ("decode", "gen_ai.latency.time_in_model_decode"),
                          ("detokenize", "servelm.latency.time_in_detokenize")):
            if name in phases:
                span.set_attribute(key, phases[name])
        for event in ("arrival", "scheduled", "first_token", "finished"):
            if event in timings:
                span.add_event("queued" if event == "arrival" else event,
                               timestamp=_ns(timings[event]))
        if "first_token" not in timings and record.first_token_wall_s is not None:
            span.add_event("first_token", timestamp=_ns(record.first_token_wall_s))
        if self.detailed:
            context = trace.set_span_in_context(span)
            for name, start_s, stop_s in phase_spans(timings):
                child = self._tracer.start_span(name, context=context, start_time=_ns(start_s))
                child.end(end_time=_ns(stop_s))
        if record.error:
            span.set_status(Status(StatusCode.ERROR, record.error))
        span.end(end_time=_ns(end_s))

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return bool(self._provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self._provider.shutdown()


def phase_durations(timings: dict[str, float]) -> dict[str, float]:
    """Seconds in each phase the engine's timings cover: queue, prefill, decode, detokenize."""
    durations: dict[str, float] = {}
    for name, start, stop in (("queue", "arrival", "scheduled"),
                              ("prefill", "scheduled", "first_token"),
                              ("decode", "first_token", "finished")):
        if start in timings and stop in timings:
            durations[name] = max(0.0, timings[stop] - timings[start])
    if "detokenize_s" in timings:
        durations["detokenize"] = timings["detokenize_s"]
    return durations


def phase_spans(timings: dict[str, float]) -> list[tuple[str, float, float]]:
    """(name, start, stop) of the child spans --collect-detailed-traces adds."""
    spans = []
    for name, start, stop in (("queue", "arrival", "scheduled"),
                              ("prefill", "scheduled", "first_token"),
                              ("decode", "first_token", "finished")):
        if start in timings and stop in timings:
            spans.append((name, timings[start], max(timings[start], timings[stop])))
    if "finished" in timings and "detokenize_s" in timings:
        spans.append(("detokenize", timings["finished"] - timings["detokenize_s"], timings["finished"]))
    return spans
