"""The router's HTTP server: the OpenAI API in front, workers behind (servelm.router).

Routes: the generation routes (/v1/chat/completions, /v1/completions, /generate and the rest of
``GENERATION_PATHS``) go to one data-parallel worker, or to a prefill/decode pair once prefill and
decode servers are known; /v1/models and /get_model_info are answered by a worker; /health is the
router's own (200 while it runs); /metrics counts requests, errors and in-flight requests per
worker; /add_worker, /remove_worker, /list_workers and /register manage the workers.

Invariants: a request with no healthy worker to go to is answered 503 at once (never queued);
the health loop probes every worker every ``health_check_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from servelm.router.config import RouterConfig, normalise_url
from servelm.router.errors import RouterError, error_response
from servelm.router.pd import PairRequest
from servelm.router.policies import Policy, make_policy
from servelm.router.proxy import (RETRIED_STATUSES, Lease, forwarded_headers, is_unreached,
                                  open_response, relay)
from servelm.router.workers import Registry, Role, Worker

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings",
                    "/v1/responses", "/v1/rerank", "/encode")


def request_text(body: Any) -> str:
    """The prompt text cache-aware routing keys on ("" when there is none)."""
    if not isinstance(body, dict):
        return ""
    for key in ("text", "prompt", "input"):
        value = body.get(key)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return " ".join(map(str, value))
    if isinstance(body.get("messages"), list):
        parts = []
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}: {content or ''}\n")
        return "".join(parts)
    if isinstance(body.get("input_ids"), list):
        return " ".join(map(str, body["input_ids"]))
    return ""


class Router:
    """Workers, policies and the HTTP client shared by all requests."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = Registry()
        self.policies: dict[Role, Policy] = {role: make_policy(config.policy_for(role.value), config)
                                             for role in Role}
        for url in config.workers:
            self.registry.add(url, Role.NORMAL)
        for spec in config.prefill:
            self.registry.add(spec.url, Role.PREFILL, spec.bootstrap_port)
        for url in config.decode:
            self.registry.add(url, Role.DECODE)
        self.num_retries = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._health_task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.probe_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe round must never end the loop
                logger.exception("health check round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.registry.all()))

    async def probe(self, worker: Worker) -> bool:
        """One GET /health (and the bootstrap port of a prefill server that has none yet)."""
        try:
            response = await self.client.get(worker.url + "/health",
                                              timeout=self.config.health_check_timeout_s)
            is_ok = response.status_code == 200
            if is_ok and worker.role == Role.PREFILL and worker.bootstrap_port is None:
                is_ok = await self._fetch_bootstrap_port(worker)
        except httpx.HTTPError:
            is_ok = False
        if worker.record_probe(is_ok, self.config.health_failure_threshold,
                               self.config.health_success_threshold):
            logger.warning("worker %s is %s", worker.url, "in rotation" if is_ok else "out of rotation")
        return is_ok

    async def _fetch_bootstrap_port(self, worker: Worker) -> bool:
        response = await self.client.get(worker.url + "/get_server_info",
                                         timeout=self.config.health_check_timeout_s)
        port = response.json().get("disaggregation_bootstrap_port") if response.status_code == 200 else None
        if not isinstance(port, int):
            logger.warning("prefill server %s reports no disaggregation_bootstrap_port", worker.url)
            return False
        worker.bootstrap_port = port
        return True

    # --- workers --------------------------------------------------------------------------
    async def add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> Worker:
        worker = self.registry.add(url, role, bootstrap_port)
        await self.probe(worker)
        return worker

    def remove_worker(self, url: str) -> Worker | None:
        worker = self.registry.remove(url)
        if worker is not None:
            self.policies[worker.role].forget(url)
        return worker

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = None
        headers = forwarded_headers(request.headers)
        path = request.url.path
        prefills = self.registry.healthy(Role.PREFILL)
        decodes = self.registry.healthy(Role.DECODE)
        if prefills and decodes:
            if not isinstance(body, dict):
                raise RouterError(400, "the request body must be a JSON object")
            text = request_text(body)
            prefill = self.policies[Role.PREFILL].pick(prefills, text)
            decode = self.policies[Role.DECODE].pick(decodes, text)
            return await PairRequest(self.client, prefill, decode, path, body, headers).run()
        if self.registry.healthy(Role.NORMAL) or not self.registry.is_pd:
            return await self.forward(path, raw, headers, request_text(body))
        missing = "prefill" if not prefills else "decode"
        raise RouterError(503, f"no healthy {missing} server: the request cannot be served")

    async def forward(self, path: str, raw: bytes, headers: dict[str, str], text: str) -> Response:
        """Data parallel: one worker, others only if it never took the request."""
        tried: set[str] = set()
        last_failure = "no worker is registered"
        for attempt in range(self.config.max_retries + 1):
            candidates = [w for w in self.registry.healthy(Role.NORMAL) if w.url not in tried]
            if not candidates:
                break
            worker = self.policies[Role.NORMAL].pick(candidates, text)
            tried.add(worker.url)
            if attempt > 0:
                self.num_retries += 1
            lease = Lease(worker)
            try:
                response = await open_response(self.client, worker, "POST", path, raw, headers)
            except httpx.HTTPError as error:
                lease.release(is_error=True)
                if not is_unreached(error):
                    raise RouterError(502, f"worker {worker.url} failed after taking the request "
                                           f"({type(error).__name__}: {error}); not retried, so "
                                           "no response is duplicated") from None
                worker.mark_down()
                last_failure = f"worker {worker.url}: {type(error).__name__}: {error}"
                logger.warning("%s; trying another worker", last_failure)
                continue
            has_more = attempt < self.config.max_retries and any(
                w.url not in tried for w in self.registry.healthy(Role.NORMAL))
            if response.status_code in RETRIED_STATUSES and has_more:
                await response.aclose()
                lease.release(is_error=True)
                last_failure = f"worker {worker.url} answered {response.status_code}"
                continue
            return await relay(worker, lease, response)
        raise RouterError(503, f"no healthy worker could take the request ({last_failure})")

    async def get_from_worker(self, path: str) -> Response:
        """A read-only route answered by the first healthy worker (decode, else any)."""
        for role in (Role.NORMAL, Role.DECODE, Role.PREFILL):
            for worker in self.registry.healthy(role):
                try:
                    response = await self.client.get(worker.url + path)
                except httpx.HTTPError:
                    continue
                return Response(response.content, status_code=response.status_code,
                                headers=forwarded_headers(response.headers))
        raise RouterError(503, "no healthy worker to answer")

    def metrics_text(self) -> str:
        lines = []
        for name, kind, help_text, value in (
                ("servelm_router_requests_total", "counter", "Requests sent to the worker.",
                 lambda w: w.num_requests),
                ("servelm_router_errors_total", "counter", "Requests the worker failed or refused.",
                 lambda w: w.num_errors),
                ("servelm_router_in_flight", "gauge", "Requests open on the worker now.",
                 lambda w: w.num_in_flight),
                ("servelm_router_worker_healthy", "gauge", "1 while the worker is in rotation.",
                 lambda w: int(w.is_healthy))):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{worker="{w.url}",role="{w.role.value}"}} {value(w)}'
                      for w in self.registry.all()]
        lines += ["# HELP servelm_router_retries_total Requests sent again to another worker.",
                  "# TYPE servelm_router_retries_total counter",
                  f"servelm_router_retries_total {self.num_retries}"]
        return "\n".join(lines) + "\n"


def _role_of(text: str | None) -> Role:
    try:
        return Role((text or "normal").lower())
    except ValueError:
        raise RouterError(400, f"unknown worker role {text!r}: use normal, prefill or decode") from None


def _port_of(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise RouterError(400, f"bootstrap_port must be an integer, got {value!r}") from None
    if not 0 < port < 65536:
        raise RouterError(400, f"bootstrap_port must be in 1..65535, got {port}")
    return port


def _url_of(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise RouterError(400, "url is required (http://host:port)")
    try:
        return normalise_url(value, "url")
    except ValueError as error:
        raise RouterError(400, str(error)) from None


def build_app(config: RouterConfig) -> Starlette:
    """The router's ASGI app (the Router lives in ``app.state.router``)."""
    router = Router(config)

    async def generate(request: Request) -> Response:
        return await router.generate(request)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(_: Request) -> Response:
        if not any(w.is_healthy for w in router.registry.all()):
            raise RouterError(503, "no healthy worker")
        return Response(status_code=200)

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(router.metrics_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        return await router.get_from_worker(request.url.path)

    async def list_workers(_: Request) -> Response:
        workers = router.registry.all()
        return JSONResponse({
            "urls": [w.url for w in workers if w.role == Role.NORMAL],
            "prefill": [w.url for w in workers if w.role == Role.PREFILL],
            "decode": [w.url for w in workers if w.role == Role.DECODE],
            "workers": [w.describe() for w in workers]})

    async def add_worker(request: Request) -> Response:
        query = request.query_params
        url = _url_of(query.get("url"))
        role = _role_of(query.get("role") or query.get("worker_type"))
        worker = await router.add_worker(url, role, _port_of(query.get("bootstrap_port")))
        return JSONResponse({"status": "ok", "worker": worker.describe()})

    async def remove_worker(request: Request) -> Response:
        url = _url_of(request.query_params.get("url"))
        if router.remove_worker(url) is None:
            raise RouterError(404, f"worker {url} is not registered")
        return JSONResponse({"status": "ok", "removed": url})

    async def register(request: Request) -> Response:
        """LightLLM-style registration: {"url", "mode": prefill|decode|normal, "bootstrap_port"}."""
        if not config.is_pd_master:
            raise RouterError(404, "registration is for `servelm serve --run_mode pd_master`; "
                                   "use POST /add_worker?url=... on this router")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise RouterError(400, "the body must be JSON: {\"url\", \"mode\", \"bootstrap_port\"}") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object")
        role = _role_of(body.get("mode"))
        worker = await router.add_worker(_url_of(body.get("url")), role,
                                         _port_of(body.get("bootstrap_port")))
        return JSONResponse({"status": "ok", "worker": worker.describe()})

    async def server_info(_: Request) -> Response:
        return JSONResponse({"router": {"policy": config.policy, "is_pd_master": config.is_pd_master},
                             "workers": [w.describe() for w in router.registry.all()],
                             "num_retries": router.num_retries})

    async def on_router_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, RouterError)
        return error_response(error.status_code, error.message)

    async def on_http_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return error_response(error.status_code, str(error.detail))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [Route(path, generate, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/get_model_info", models, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/list_workers", list_workers, methods=["GET"]),
        Route("/add_worker", add_worker, methods=["POST"]),
        Route("/remove_worker", remove_worker, methods=["POST"]),
        Route("/register", register, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={RouterError: on_router_error, HTTPException: on_http_error})
    app.state.router = router
    return app


def run_router(config: RouterConfig) -> None:
    """Serve until stopped (SIGINT/SIGTERM)."""
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    uvicorn.run(build_app(config), host=config.host, port=config.port,
                log_level=config.log_level, timeout_keep_alive=30)
