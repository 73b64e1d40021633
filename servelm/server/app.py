"""HTTP routes (OpenAI-compatible, plus SGLang/vLLM native endpoints) and the uvicorn entry point.

Invariants:
- Routes reach the engine only through the AsyncEngine interface (``app.state.serving.engine``);
  model work runs in the engine process, so no handler blocks the event loop on it.
- With --api-key, every route but /health, /health_generate and the playground page (not the API
  calls it makes) needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib
import importlib.metadata
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.config import EngineConfig
from servelm.engine.frontdoor import EngineClient
from servelm.engine.launch import EngineLaunch
from servelm.logging_utils import watch_gc
from servelm.server import clients, embeddings, native, tgi
from servelm.server.chat import load_chat_template
from servelm.server.disagg import register_when_serving
from servelm.server.errors import APIError, error_response, install_error_handlers
from servelm.server.http_limits import connection_limit, guarded_protocol, install_repeat_filter
from servelm.server.lora import add_lora_routes
from servelm.server.middleware import install_middleware
from servelm.multimodal.front_door import ImageProcessor
from servelm.server.observe import ObservedEngine, ServerMetrics
from servelm.server.openai_serving import create_chat_completion, create_completion
from servelm.server.playground import PUBLIC_PATHS, install_playground
from servelm.server.push import MetricsPusher
from servelm.server.tracing import TRACE_HEADERS, RequestHeadersMiddleware, RequestTracer
from servelm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     EmbeddingRequest, EncodeRequest, GenerateRequest,
                                     TokenizeRequest)
from servelm.server.responses import ResponsesRequest, create_response
from servelm.server.serving import ServingContext

logger = logging.getLogger(__name__)

AUTH_EXEMPT_PATHS = frozenset({"/health", "/health_generate"})
HEALTH_GENERATE_TIMEOUT_S = 30.0


def server_version() -> str:
    version = getattr(importlib.import_module("servelm"), "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("servelm")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


class ApiKeyMiddleware:
    """Answers 401 (OpenAI error JSON) unless the Bearer token equals the configured key."""

    def __init__(self, app: ASGIApp, api_key: str, exempt_paths: frozenset[str] = AUTH_EXEMPT_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.exempt_paths = exempt_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or (
                scope["path"] in self.exempt_paths and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "missing or incorrect API key; send 'Authorization: "
                                      "Bearer KEY'", code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _serving(request: Request) -> ServingContext:
    serving = getattr(request.app.state, "serving", None)
    if serving is None:
        raise APIError(503, "the engine is not ready")
    return serving


def _expert_distribution_route(action: str) -> Callable[[Request], Awaitable[Response]]:
    """SGLang's /start_, /stop_ and /dump_expert_distribution_record: the recorder of
    --expert-distribution-recorder-mode (400 without it)."""
    async def route(request: Request) -> Response:
        result = await _serving(request).engine.expert_distribution(action)
        if not result.get("success"):
            raise APIError(400, str(result.get("message", "no expert distribution recorder")))
        return JSONResponse(result)
    return route


def _generation(request: Request, api: str) -> ServingContext:
    """The serving context of a generation route; 400 on an embedding server."""
    serving = _serving(request)
    serving.require_task("generate", api)
    return serving


def _flat_config(config: EngineConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section in dataclasses.fields(config):
        flat.update(dataclasses.asdict(getattr(config, section.name)))
    if flat.get("api_key"):
        flat["api_key"] = "***"
    return flat


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> Response:
        serving = app.state.serving
        is_alive = serving is not None and serving.engine.is_alive
        return Response(status_code=200 if is_alive else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        serving = _serving(request)
        try:
            is_healthy = await asyncio.wait_for(serving.engine.health_generate(),
                                                HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, Exception):  # any failure means unhealthy
            logger.warning("health_generate failed", exc_info=True)
            is_healthy = False
        if not is_healthy:
            return error_response(503, "the engine cannot generate")
        return Response(status_code=200)

    if app.state.metrics is not None and app.state.serve_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            serving, collectors = app.state.serving, app.state.metrics
            if serving is not None and serving.engine.is_alive:
                try:
                    stats = await asyncio.wait_for(serving.engine.get_server_info(), 10)
                    collectors.set_engine_stats(stats)
                except Exception:  # a scrape must not fail because the engine is busy or gone
                    logger.warning("metrics: engine stats unavailable", exc_info=True)
            body, content_type = collectors.render()
            return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """Empty the prefix cache; 400 while requests are running or queued (retry when idle)."""
        result = await _serving(request).engine.flush_cache()
        if not result.get("success"):
            raise APIError(400, str(result.get("message", "the cache could not be flushed")))
        return JSONResponse(result)

    for action in ("start", "stop", "dump"):
        app.add_api_route(f"/{action}_expert_distribution_record", _expert_distribution_route(action),
                          methods=["GET", "POST"])

    @app.get("/v1/models")
    @app.get("/models")  # Open WebUI and others call it without /v1
    async def models(request: Request) -> dict[str, Any]:
        serving = _serving(request)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": app.state.created,
            "owned_by": "servelm", "root": serving.config.model.model, "parent": None,
            "max_model_len": serving.context_length} for name in serving.config.model.served_names]
            + [{"id": adapter["name"], "object": "model", "created": app.state.created,
                "owned_by": "servelm", "root": adapter.get("path"),
                "parent": serving.served_model_name, "max_model_len": serving.context_length}
               for adapter in serving.lora_adapters()]}

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        """llama.cpp's /props, which its web UI reads for the model, context and template."""
        return clients.llama_cpp_props(_serving(request))

    @app.get("/slots")
    async def slots() -> Response:
        return error_response(404, "servelm has no llama.cpp slots (requests are batched "
                              "continuously); see /get_server_info for running and queued requests",
                              code="not_found")

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        serving = _serving(request)
        info = serving.engine.model_info.as_dict()
        info.setdefault("model_path", serving.config.model.model)
        if serving.engine.model_info.lora is not None:
            info["lora_adapters"] = serving.engine.lora_adapters
        info["served_model_name"] = serving.served_model_name
        info["tokenizer_path"] = serving.config.model.tokenizer or serving.config.model.model
        preferred = serving.config.server.preferred_sampling_params
        info["preferred_sampling_params"] = json.loads(preferred) if preferred else None
        return info

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        serving = _serving(request)
        engine_info = await serving.engine.get_server_info()
        return {**_flat_config(serving.config), **engine_info, "version": server_version(),
                "served_model_name": serving.served_model_name}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(_generation(request, "Completions"), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(_generation(request, "Chat Completions"), body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(_generation(request, "Responses"), body, request)

    if app.state.use_tgi_api:
        @app.post("/generate")
        async def tgi_generate(body: tgi.TGIRequest, request: Request) -> Response:
            return await tgi.route(_generation(request, "generate"), body, request, path="/generate")

        @app.post("/generate_stream")
        async def tgi_generate_stream(body: tgi.TGIRequest, request: Request) -> Response:
            return await tgi.route(_generation(request, "generate"), body, request,
                                   path="/generate_stream")

        @app.post("/")
        async def tgi_compat(body: tgi.TGIRequest, request: Request) -> Response:
            return await tgi.route(_generation(request, "generate"), body, request, path="/")
    else:
        @app.post("/generate")
        async def generate(body: GenerateRequest, request: Request) -> Response:
            return await native.generate(_generation(request, "generate"), body, request)

    @app.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        """TGI's model description (the text-generation client and TGI dashboards read it)."""
        return tgi.info(_serving(request), server_version())

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create_embedding(_serving(request), body)

    @app.post("/encode")
    async def encode(body: EncodeRequest, request: Request) -> Response:
        return await embeddings.encode(_serving(request), body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await native.tokenize(_serving(request), body))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        return native.tokenizer_info(_serving(request))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await native.detokenize(_serving(request), body))


def _create_app(config: EngineConfig, lifespan: Any = None) -> FastAPI:
    docs: dict[str, Any] = {}
    if config.server.disable_fastapi_docs:
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="servelm", version=server_version(), lifespan=lifespan, **docs)
    app.state.serving = None
    app.state.created = int(time.time())
    observability = config.observability
    app.state.serve_metrics = observability.enable_metrics
    app.state.metrics = ServerMetrics(config) \
        if observability.enable_metrics or observability.metric_gateway else None
    app.state.pusher = MetricsPusher(config, app.state.metrics) \
        if observability.metric_gateway else None
    app.state.tracer = RequestTracer(config) if observability.tracing else None
    app.state.use_tgi_api = config.server.use_tgi_api
    install_error_handlers(app)
    _add_routes(app)
    add_lora_routes(app)
    exempt_paths = AUTH_EXEMPT_PATHS
    if not config.server.disable_playground:
        install_playground(app)
        exempt_paths = exempt_paths | PUBLIC_PATHS
    if config.server.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.server.api_key, exempt_paths=exempt_paths)
    install_middleware(app, config.server)
    observed_headers = TRACE_HEADERS if observability.tracing else ()
    if observability.tokenizer_metrics_allowed_custom_labels:
        observed_headers += (observability.tokenizer_metrics_custom_labels_header,)
    if observed_headers:
        app.add_middleware(RequestHeadersMiddleware, names=observed_headers)
    return app


def _serving_context(app: FastAPI, engine: EngineClient, config: EngineConfig,
                     image_processor: ImageProcessor | None | Literal["load"] = "load"
                     ) -> ServingContext:
    return ServingContext(ObservedEngine(engine, config, app.state.metrics, app.state.tracer),
                          config, image_processor)


def build_app(engine: EngineClient, config: EngineConfig,
              image_processor: ImageProcessor | None | Literal["load"] = "load") -> FastAPI:
    """The FastAPI app serving ``engine`` (an AsyncEngine, or a test's fake of the protocol);
    ``image_processor``: the model's (loaded from the model by default), or a test's."""
    app = _create_app(config)
    app.state.serving = _serving_context(app, engine, config, image_processor)
    return app


def run_server(config: EngineConfig, launch: EngineLaunch | None = None) -> None:
    """Start the engine, serve HTTP on config.server.host:port until stopped, then shut down.
    ``launch``: the engine processes, when the caller started them early (servelm.engine.launch)."""
    import uvicorn

    from servelm.engine.async_engine import AsyncEngine
    # A model that cannot be read fails here, with one line, before any model loads (a bad
    # --chat-template was refused when the config was built, --ssl-keyfile alone when it was parsed).
    try:
        load_chat_template(config.server.chat_template)
        AsyncEngine.check_model(config)
    except (OSError, ValueError) as error:
        raise SystemExit(f"servelm: {error}") from None

    server_config = config.server
    engine_death: list[str] = []
    watch_gc(config.observability.gc_warning_threshold_secs, "server process")

    async def exit_when_engine_dies(engine: AsyncEngine, server: uvicorn.Server) -> None:
        reason = await engine.wait_dead()
        engine_death.append(reason)
        logger.critical("%s; the HTTP server is exiting", reason)
        server.should_exit = True

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        install_repeat_filter()  # after uvicorn has configured its loggers
        engine = await AsyncEngine.start(config, launch)
        watcher = asyncio.create_task(exit_when_engine_dies(engine, server))
        registration = asyncio.create_task(register_when_serving(config, server, engine_death))
        pusher: MetricsPusher | None = app.state.pusher
        pushing = None if pusher is None else asyncio.create_task(pusher.run(lambda: engine))
        try:
            app.state.serving = _serving_context(app, engine, config)
            scheme = "https" if server_config.ssl_certfile else "http"
            logger.info("serving %s on %s://%s:%d%s", config.model.name, scheme, server_config.host,
                        server_config.port, server_config.root_path or "")
            yield
            logger.info("HTTP server stopped; stopping the engine")
        finally:
            watcher.cancel()
            registration.cancel()
            if pushing is not None and pusher is not None:
                pushing.cancel()
                await pusher.try_push(engine)  # the final counts
            if app.state.tracer is not None:
                app.state.tracer.shutdown()  # exports the spans still batched
            serving = app.state.serving
            app.state.serving = None
            if serving is not None:
                serving.close()
            await engine.shutdown()

    try:
        app = _create_app(config, lifespan)
    except ValueError as error:  # e.g. --enable_monitor_auth without its credentials
        raise SystemExit(f"servelm: {error}") from None
    http_level = config.observability.log_level_http or server_config.log_level
    http_protocol = guarded_protocol(connection_limit(server_config.max_connections),
                                     server_config.http_header_timeout_s,
                                     server_config.http_body_timeout_s)
    server = uvicorn.Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level=http_level,
        http=http_protocol,
        timeout_graceful_shutdown=int(math.ceil(server_config.shutdown_timeout_s)),
        root_path=server_config.root_path or "", ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile, ssl_ca_certs=server_config.ssl_ca_certs,
        ssl_cert_reqs=server_config.ssl_cert_reqs))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    if engine_death:
        raise SystemExit(f"servelm: {engine_death[0]}")
