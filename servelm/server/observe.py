"""Per-request observation in the server process: Prometheus metrics and request log lines.

``ObservedEngine`` wraps the AsyncEngine handle that the routes use. Every engine request a route
starts goes through its ``generate``, so latency is measured where the outputs reach the HTTP
layer (after the ZMQ hop), which is what a client sees.

Invariants:
- A request is counted once, when its finished output arrives (or when its consumer stops early:
  finish_reason "abort"); prompt and generation token counters grow by exactly its usage.
- Time to first token is observed once per request that produced a token; inter-token latency once
  per output token after the first (a delta of n tokens counts n gaps of equal length).
- Gauges (running, waiting, KV use, prefix-cache hit rate, speculative accept length and
  acceptance rate) are read from the engine at scrape time.
- Health probes (``health_generate``) bypass the wrapper and are never counted.
- Per-request metrics carry the labels --tokenizer-metrics-allowed-custom-labels names, valued
  from the request's --tokenizer-metrics-custom-labels-header JSON object ("" when not given, or
  longer than MAX_LABEL_VALUE_CHARS, or a new combination past MAX_LABEL_SETS); engine gauges
  carry only the model name.
- With tracing on, every observed request ends exactly one span (servelm.server.tracing).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from servelm.config import EngineConfig, token_buckets
from servelm.disagg.spec import KVTransfer
from servelm.engine.frontdoor import EngineClient, ModelInfo
from servelm.engine.monitor import cache_hit_rate
from servelm.engine.outputs import RequestOutput
from servelm.errors import InvalidRequestError
from servelm.multimodal.inputs import MultimodalInputs
from servelm.sampling.params import SamplingParams

logger = logging.getLogger("servelm.requests")

DEFAULT_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 60.0)
DEFAULT_ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0)
DEFAULT_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
DEFAULT_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(0, 6) for m in (1, 2, 5)) + (1e6,)
"""Prompt and generation token histogram bounds: 1, 2, 5, 10, ... 500000, 1000000."""
_DEFAULT_MAX_LOG_LEN = 2048
MAX_LABEL_SETS = 1000
"""Most distinct combinations of custom label values: later new ones count under "" (clients
choose the values, and each combination is a set of series held for the server's lifetime)."""
MAX_LABEL_VALUE_CHARS = 128


class ServerMetrics:
    """The Prometheus collectors of one server, in a private registry, labelled by model name."""

    def __init__(self, config: EngineConfig) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        observability = config.observability
        self.model_name = config.model.name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.custom_labels = tuple(observability.tokenizer_metrics_allowed_custom_labels or ())
        self.custom_labels_header = observability.tokenizer_metrics_custom_labels_header.lower()
        request_labels = labels + list(self.custom_labels)
        self._label_sets: set[tuple[str, ...]] = set()
        """Custom label values seen so far (at most MAX_LABEL_SETS)."""

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, request_labels, buckets=tuple(buckets), registry=self.registry)

        self.ttft = histogram("servelm:time_to_first_token_seconds", "Time to first token.",
                              observability.bucket_time_to_first_token or DEFAULT_TTFT_BUCKETS_S)
        self.itl = histogram("servelm:inter_token_latency_seconds", "Time between output tokens.",
                             observability.bucket_inter_token_latency or DEFAULT_ITL_BUCKETS_S)
        self.e2e = histogram("servelm:e2e_request_latency_seconds", "Whole-request latency.",
                             observability.bucket_e2e_request_latency or DEFAULT_E2E_BUCKETS_S)
        self.prompt_tokens = Counter("servelm:prompt_tokens", "Prompt tokens processed.",
                                     request_labels, registry=self.registry)
        self.generation_tokens = Counter("servelm:generation_tokens", "Output tokens generated.",
                                         request_labels, registry=self.registry)
        self.requests = Counter("servelm:request_finished", "Finished requests by finish reason.",
                                request_labels + ["finish_reason"], registry=self.registry)
        self.prompt_tokens_histogram = self.generation_tokens_histogram = None
        if observability.collect_tokens_histogram:
            self.prompt_tokens_histogram = histogram(
                "servelm:prompt_tokens_histogram", "Prompt tokens per request.",
                token_buckets("--prompt-tokens-buckets", observability.prompt_tokens_buckets or [],
                              DEFAULT_TOKEN_BUCKETS))
            self.generation_tokens_histogram = histogram(
                "servelm:generation_tokens_histogram", "Output tokens per request.",
                token_buckets("--generation-tokens-buckets",
                              observability.generation_tokens_buckets or [], DEFAULT_TOKEN_BUCKETS))
        self.running = Gauge("servelm:num_requests_running", "Requests in the running batch.",
                             labels, registry=self.registry)
        self.waiting = Gauge("servelm:num_requests_waiting", "Requests queued for admission.",
                             labels, registry=self.registry)
        self.kv_usage = Gauge("servelm:kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                              labels, registry=self.registry)
        self.cache_hit_rate = Gauge("servelm:prefix_cache_hit_rate",
                                    "Fraction of prompt tokens served from the prefix cache.",
                                    labels, registry=self.registry)
        self.spec_accept_length = Gauge(
            "servelm:spec_accept_length", "Speculative decoding: mean tokens emitted per verify "
            "pass of a request (accepted drafts + the model's own token); 0 when off.",
            labels, registry=self.registry)
        self.spec_acceptance_rate = Gauge(
            "servelm:spec_acceptance_rate", "Speculative decoding: share of drafted tokens "
            "the model accepted; 0 when off.", labels, registry=self.registry)
        self.spec_draft_tokens = Gauge(
            "servelm:spec_num_draft_tokens", "Speculative decoding: drafted tokens verified so far.",
            labels, registry=self.registry)
        self.spec_accepted_tokens = Gauge(
            "servelm:spec_num_accepted_tokens", "Speculative decoding: drafted tokens accepted "
            "so far.", labels, registry=self.registry)
        self.hicache = {key: Gauge(f"servelm:{key}", help_text, labels, registry=self.registry)
                        for key, help_text in HICACHE_GAUGES.items()}
        self.replica_running = Gauge(
            "servelm:dp_replica_num_requests_running", "Requests in each data-parallel replica's "
            "running batch (--dp-size > 1).", labels + ["dp_replica"], registry=self.registry)
        self.replica_waiting = Gauge(
            "servelm:dp_replica_num_requests_waiting", "Requests queued in each data-parallel "
            "replica (--dp-size > 1).", labels + ["dp_replica"], registry=self.registry)
        parallel = config.parallel
        self.parallel_layout = Gauge(
            "servelm:parallel_layout", "The model's parallel layout (the value is 1): tensor-parallel "
            "ranks, the nodes they span, ranks per node, and the executor that started them.",
            labels + ["tp_size", "nnodes", "ranks_per_node", "executor"], registry=self.registry)
        self.parallel_layout.labels(
            self.model_name, str(parallel.tensor_parallel_size), str(parallel.nnodes),
            str(parallel.ranks_per_node), parallel.distributed_executor_backend).set(1)
        self.experts = (ExpertMetrics(labels, self.registry)
                        if observability.enable_expert_distribution_metrics else None)

    def request_labels(self, headers: dict[str, str]) -> tuple[str, ...]:
        """Label values of a request: the model name, then each allowed custom label's value in
        the request's labels header (a JSON object; "" for a label it does not set, and for all
        of them when the header is not a JSON object of strings)."""
        if not self.custom_labels:
            return (self.model_name,)
        given: dict[str, Any] = {}
        text = headers.get(self.custom_labels_header)
        if text:
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                given = parsed
        values = tuple(value if isinstance(value, str) and len(value) <= MAX_LABEL_VALUE_CHARS
                       else "" for value in (given.get(label) for label in self.custom_labels))
        if values not in self._label_sets:
            if len(self._label_sets) >= MAX_LABEL_SETS:  # clients pick the values: bound the series
                values = ("",) * len(self.custom_labels)
            else:
                self._label_sets.add(values)
        return (self.model_name, *values)

    def observe_finish(self, record: RequestRecord) -> None:
        labels = record.labels or (self.model_name,) + ("",) * len(self.custom_labels)
        self.e2e.labels(*labels).observe(record.elapsed_s())
        self.prompt_tokens.labels(*labels).inc(record.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(record.num_output_tokens)
        self.requests.labels(*labels, record.finish_reason or "abort").inc()
        if self.prompt_tokens_histogram is not None and self.generation_tokens_histogram is not None:
            self.prompt_tokens_histogram.labels(*labels).observe(record.num_prompt_tokens)
            self.generation_tokens_histogram.labels(*labels).observe(record.num_output_tokens)

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        name = self.model_name
        self.running.labels(name).set(stats.get("num_running", 0))
        self.waiting.labels(name).set(stats.get("num_waiting", 0))
        self.kv_usage.labels(name).set(stats.get("token_usage", 0.0))
        self.cache_hit_rate.labels(name).set(cache_hit_rate(stats))
        self.spec_accept_length.labels(name).set(stats.get("spec_accept_length", 0.0))
        self.spec_acceptance_rate.labels(name).set(stats.get("spec_acceptance_rate", 0.0))
        self.spec_draft_tokens.labels(name).set(stats.get("spec_num_draft_tokens", 0))
        self.spec_accepted_tokens.labels(name).set(stats.get("spec_num_accepted_tokens", 0))
        for key, gauge in self.hicache.items():
            gauge.labels(name).set(stats.get(key, 0))
        if self.experts is not None and stats.get("moe"):
            self.experts.set(name, stats["moe"])
        for replica in stats.get("dp_replicas") or ():
            index = str(replica["replica"])
            self.replica_running.labels(name, index).set(replica.get("num_running") or 0)
            self.replica_waiting.labels(name, index).set(replica.get("num_waiting") or 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ExpertMetrics:
    """--enable-expert-distribution-metrics: the MoE routing counted since start (engine stats'
    ``moe``; model/expert_load.py), as gauges read at scrape time."""

    def __init__(self, labels: list[str], registry: Any) -> None:
        from prometheus_client import Gauge

        self.expert_rows = Gauge(
            "servelm:moe_expert_rows", "Rows (token, chosen expert) each MoE layer routed to each "
            "expert since start.", labels + ["layer", "expert"], registry=registry)
        self.rank_rows = Gauge(
            "servelm:moe_ep_rank_rows", "Rows each expert-parallel rank computed per MoE layer since "
            "start (--ep-size > 1).", labels + ["layer", "ep_rank"], registry=registry)
        self.balancedness = Gauge(
            "servelm:moe_ep_balancedness", "Mean over MoE layers of mean / max rows per "
            "expert-parallel rank since start (1: even; --ep-size > 1).", labels, registry=registry)
        self.rebalances = Gauge(
            "servelm:eplb_rebalances", "Expert placements EPLB has moved to (--enable-eplb).",
            labels, registry=registry)

    def set(self, name: str, moe: dict[str, Any]) -> None:
        for layer, rows in zip(moe["layers"], moe["expert_rows"]):
            for expert, count in enumerate(rows):
                self.expert_rows.labels(name, str(layer), str(expert)).set(count)
        for layer, rows in zip(moe["layers"], moe.get("ep_rank_rows") or ()):
            for rank, count in enumerate(rows):
                self.rank_rows.labels(name, str(layer), str(rank)).set(count)
        if moe.get("balancedness") is not None:
            self.balancedness.labels(name).set(moe["balancedness"])
        self.rebalances.labels(name).set(moe.get("eplb_rebalances", 0))


HICACHE_GAUGES = {
    "hicache_host_hit_tokens": "Hierarchical cache: prompt tokens whose K/V came back from the "
                               "host tier (0 when off).",
    "hicache_storage_hit_tokens": "Hierarchical cache: prompt tokens whose K/V came back from "
                                  "the storage tier (disk).",
    "hicache_demoted_blocks": "Hierarchical cache: blocks the KV pool evicted into the host tier.",
    "hicache_host_write_bytes": "Hierarchical cache: bytes copied into the host tier.",
    "hicache_host_read_bytes": "Hierarchical cache: bytes copied from the host tier into the pool.",
    "hicache_storage_write_bytes": "Hierarchical cache: block bytes written to storage files.",
    "hicache_storage_read_bytes": "Hierarchical cache: block bytes read (prefetched) from storage.",
    "hicache_prefetch_waits": "Hierarchical cache: requests held back until their blocks were "
                              "read from storage (wait_complete / timeout policies).",
    "hicache_storage_invalid_files": "Hierarchical cache: storage files skipped as truncated, "
                                     "corrupt or written by another model.",
}
"""stats() key -> help: the hierarchical cache's figures, as gauges (they count since start)."""


class RequestRecord:
    """What the server saw of one engine request, for metrics and its log line."""

    __slots__ = ("request_id", "prompt_token_ids", "params", "start_s", "last_token_s",
                 "num_prompt_tokens", "num_output_tokens", "finish_reason", "error", "text",
                 "token_ids", "lora_name", "labels", "start_wall_s", "first_token_wall_s",
                 "timings", "span")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.start_s = time.perf_counter()
        self.last_token_s: float | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.lora_name: str | None = None
        """The LoRA adapter the request ran with (None: the base model)."""
        self.labels: tuple[str, ...] = ()
        """Metric label values (ServerMetrics.request_labels); empty: the model name only."""
        self.start_wall_s = time.time()
        self.first_token_wall_s: float | None = None
        self.timings: dict[str, float] | None = None
        """The engine's phase times (RequestOutput.timings), from the finished output."""
        self.span: Any = None
        """The request's trace span while tracing."""

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s


class ObservedEngine:
    """The engine as the routes see it (an EngineClient around an EngineClient), with metrics and
    request logging around ``generate`` and ``encode`` (embeddings).

    Everything else is passed through to the wrapped engine.
    """

    def __init__(self, engine: EngineClient, config: EngineConfig, metrics: ServerMetrics | None,
                 tracer: Any = None) -> None:
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._tracer = tracer
        """A servelm.server.tracing.RequestTracer while tracing, else None."""

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self._engine.model_info

    @property
    def lora_adapters(self) -> list[dict[str, Any]]:
        return self._engine.lora_adapters

    @property
    def is_alive(self) -> bool:
        return self._engine.is_alive

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def get_server_info(self) -> dict[str, Any]:
        return await self._engine.get_server_info()

    async def flush_cache(self) -> dict[str, Any]:
        return await self._engine.flush_cache()

    async def expert_distribution(self, action: str) -> dict[str, Any]:
        return await self._engine.expert_distribution(action)

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        return await self._engine.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return await self._engine.unload_lora_adapter(name)

    async def health_generate(self) -> bool:
        return await self._engine.health_generate()

    async def shutdown(self) -> None:
        await self._engine.shutdown()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, group: str = "",
                       lora_name: str | None = None,
                       kv_transfer: KVTransfer | None = None,
                       mm_inputs: MultimodalInputs | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's stream, observed."""
        self._check_logprobs(params)
        record = self._start(request_id, prompt_token_ids, params)
        record.lora_name = lora_name
        keep_text = self._config.observability.log_requests_level >= 2
        images = {"mm_inputs": mm_inputs} if mm_inputs is not None else {}
        outputs = self._engine.generate(request_id, prompt_token_ids, params, priority, group,
                                        lora_name, kv_transfer, **images)
        try:
            async for output in outputs:
                self._observe(record, output, keep_text)
                yield output
        except Exception as error:
            record.finish_reason, record.error = "error", f"{type(error).__name__}: {error}"
            raise
        finally:
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()
            self._finish(record)

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        """The engine's embedding call, counted and logged like a request with no output tokens."""
        record = self._start(request_id, prompt_token_ids, None)
        try:
            output: RequestOutput = await self._engine.encode(request_id, prompt_token_ids, priority)
            record.finish_reason, record.error = output.finish_reason, output.error
            return output
        except Exception as error:
            record.finish_reason, record.error = "error", f"{type(error).__name__}: {error}"
            raise
        finally:
            self._finish(record)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """--max-logprobs: every API's logprobs reach the engine through here."""
        limit = self._config.server.max_logprobs
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > limit:
                raise InvalidRequestError(f"{name}: at most {limit} alternatives per token "
                                          f"(--max-logprobs), got {value}", name)

    def _start(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams | None) -> RequestRecord:
        record = RequestRecord(request_id, list(prompt_token_ids), params)
        if self._metrics is not None and self._metrics.custom_labels:
            from servelm.server.tracing import REQUEST_HEADERS

            record.labels = self._metrics.request_labels(REQUEST_HEADERS.get())
        if self._tracer is not None:
            record.span = self._tracer.start(request_id, record.num_prompt_tokens, params)
        return record

    def _finish(self, record: RequestRecord) -> None:
        if record.finish_reason is None:
            record.finish_reason = "abort"  # the consumer stopped early (client left)
        if self._metrics is not None:
            self._metrics.observe_finish(record)
        if record.span is not None:
            try:
                self._tracer.finish(record.span, record)
            except Exception:  # a tracing failure must not fail the request
                logger.warning("tracing: could not end the span of %s", record.request_id,
                               exc_info=True)
        if self._config.observability.log_requests:
            log_request(record, self._config)
        if self._config.observability.enable_request_time_stats_logging:
            log_time_stats(record)

    def _observe(self, record: RequestRecord, output: RequestOutput, keep_text: bool) -> None:
        now = time.perf_counter()
        num_new = len(output.new_token_ids)
        if num_new and self._metrics is not None:
            labels = record.labels or (self._metrics.model_name,) + ("",) * len(self._metrics.custom_labels)
            if record.last_token_s is None:
                self._metrics.ttft.labels(*labels).observe(now - record.start_s)
                gaps = num_new - 1
                gap_s = 0.0
            else:
                gaps = num_new
                gap_s = (now - record.last_token_s) / num_new
            for _ in range(gaps):
                self._metrics.itl.labels(*labels).observe(gap_s)
        if num_new:
            if record.last_token_s is None:
                record.first_token_wall_s = time.time()
            record.last_token_s = now
        record.num_output_tokens += num_new
        if output.num_prompt_tokens:
            record.num_prompt_tokens = output.num_prompt_tokens
        if keep_text:
            record.text.append(output.new_text)
            record.token_ids.extend(output.new_token_ids)
        if output.is_finished:
            record.finish_reason, record.error = output.finish_reason, output.error
            record.timings = output.timings


def _cut(value: Any, limit: int | None) -> str:
    text = str(value)
    if limit is not None and len(text) > limit:
        return f"{text[:limit]}...(+{len(text) - limit} chars)"
    return text


def log_request(record: RequestRecord, config: EngineConfig) -> None:
    """One line per finished request; what it holds grows with --log-requests-level."""
    level = config.observability.log_requests_level
    parts = [f"request {record.request_id} finish_reason={record.finish_reason} "
             f"prompt_tokens={record.num_prompt_tokens} output_tokens={record.num_output_tokens} "
             f"latency={record.elapsed_s():.3f}s"]
    if record.lora_name is not None:
        parts.append(f"lora={record.lora_name}")
    if record.error:
        parts.append(f"error={record.error!r}")
    if level >= 1:
        parts.append(f"params={record.params!r}")
    if level >= 2:
        max_log_len = config.observability.max_log_len
        limit = None if level >= 3 else (_DEFAULT_MAX_LOG_LEN if max_log_len is None else max_log_len)
        parts.append(f"prompt_token_ids={_cut(record.prompt_token_ids, limit)}")
        parts.append(f"output={_cut(repr(''.join(record.text)), limit)}")
    logger.info(" ".join(parts))


def log_time_stats(record: RequestRecord) -> None:
    """--enable-request-time-stats-logging: one line of a finished request's phase times."""
    from servelm.server.tracing import phase_durations

    parts = [f"request {record.request_id} time stats:"]
    phases = phase_durations(record.timings or {})
    for name in ("queue", "prefill", "decode", "detokenize"):
        if name in phases:
            parts.append(f"{name}={phases[name]:.4f}s")
    if record.first_token_wall_s is not None:
        parts.append(f"ttft={record.first_token_wall_s - record.start_wall_s:.4f}s")
    parts.append(f"e2e={record.elapsed_s():.4f}s")
    parts.append(f"prompt_tokens={record.num_prompt_tokens} output_tokens={record.num_output_tokens}")
    logger.info(" ".join(parts))
