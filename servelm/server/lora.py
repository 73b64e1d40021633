"""LoRA adapter routes: load and unload at run time, in SGLang's and vLLM's shapes.

- SGLang: ``POST /load_lora_adapter`` {"lora_name", "lora_path"} and ``POST /unload_lora_adapter``
  {"lora_name"} answer JSON ``{"success", "error_message", "loaded_adapters"}``.
- vLLM: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with the same bodies
  answer plain text ("Success: ...").
Failures are OpenAI error bodies on both: 400 naming the reason (malformed adapter, rank over
--max-lora-rank, a target it cannot serve, base-model mismatch, LoRA not enabled), 404 for
unloading an adapter that is not loaded. The engine (every data-parallel replica) decides; the
front end only passes the call on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import Response

from servelm.server.errors import APIError
from servelm.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from servelm.server.serving import ServingContext


def _serving(request: Request) -> ServingContext:
    serving: ServingContext | None = getattr(request.app.state, "serving", None)
    if serving is None:
        raise APIError(503, "the engine is not ready")
    return serving


def _check_enabled(serving: ServingContext) -> None:
    if not serving.config.lora.is_enabled:
        raise APIError(400, "LoRA is not enabled: start the server with --enable-lora (or "
                            "--lora-paths / --lora-modules)", code="lora_not_enabled")


async def _load(serving: ServingContext, body: LoadLoRAAdapterRequest) -> dict[str, Any]:
    _check_enabled(serving)
    name = body.lora_name
    if not name.strip() or ":" in name or name in serving.accepted_model_names:
        raise APIError(400, f"lora_name {name!r} cannot name an adapter: it must be non-empty, "
                            "without ':' (base:adapter is how requests pick one) and not the base "
                            "model's name", param="lora_name")
    if body.pinned:
        raise APIError(400, "pinned adapters are not supported: --max-loaded-loras only ever "
                            "drops adapters no request uses, and reloads them on demand",
                       param="pinned")
    if body.load_inplace:
        raise APIError(400, "load_inplace is not supported: unload the adapter, then load it "
                            "again", param="load_inplace")
    result = await serving.engine.load_lora_adapter(name, body.lora_path)
    if not result.get("success"):
        raise APIError(int(result.get("status") or 400), str(result.get("message")),
                       param="lora_path", code="invalid_lora_adapter")
    return result


async def _unload(serving: ServingContext, body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
    _check_enabled(serving)
    if body.lora_int_id is not None:
        raise APIError(400, "lora_int_id is not supported: name the adapter with lora_name",
                       param="lora_int_id")
    result = await serving.engine.unload_lora_adapter(body.lora_name)
    if not result.get("success"):
        raise APIError(int(result.get("status") or 400), str(result.get("message")),
                       param="lora_name", code="model_not_found")
    return result


def _loaded(serving: ServingContext) -> dict[str, str]:
    return {adapter["name"]: adapter.get("path", "") for adapter in serving.lora_adapters()}


def add_lora_routes(app: FastAPI) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        serving = _serving(request)
        result = await _load(serving, body)
        return JSONResponse({"success": True, "error_message": None,
                             "load_time_s": result.get("load_time_s"),
                             "loaded_adapters": _loaded(serving)})

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        serving = _serving(request)
        await _unload(serving, body)
        return JSONResponse({"success": True, "error_message": None,
                             "loaded_adapters": _loaded(serving)})

    @app.post("/v1/load_lora_adapter")
    async def v1_load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        await _load(_serving(request), body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def v1_unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        await _unload(_serving(request), body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
