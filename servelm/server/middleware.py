"""ASGI middleware of the HTTP front end: request body size limit and CORS.

Invariants:
- No request body larger than ``--max-request-body-bytes`` reaches a route: a declared
  Content-Length over the limit is refused before reading, and a chunked body is read (at most
  limit + one chunk) and refused as soon as it passes the limit. Both get 413 in OpenAI format,
  and the connection is closed after it.
- CORS headers are sent only when ``--allowed-origins`` is set.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.config import ServerConfig
from servelm.server.errors import error_response


def _too_large(limit: int) -> Any:
    # The unread rest of the body is still on the wire: close the connection after answering,
    # or the HTTP server would parse it as the next request (or wait on it).
    return error_response(413, f"request body is larger than {limit} bytes (--max-request-body-bytes)",
                          type="invalid_request_error", code="request_too_large",
                          headers={"Connection": "close"})


class BodySizeLimitMiddleware:
    """Answers 413 for request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                is_over = int(declared) > self.max_bytes
            except ValueError:
                is_over = False  # the HTTP server refuses a malformed Content-Length itself
            if is_over:
                await _too_large(self.max_bytes)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No declared length (chunked): buffer up to the limit, then replay to the app.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await _too_large(self.max_bytes)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def split_list(value: str) -> list[str]:
    """A JSON list (vLLM's form) or a comma-separated list."""
    text = value.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"expected a JSON list, got {value!r}")
        return [str(item) for item in items]
    return [item.strip() for item in text.split(",") if item.strip()]


def install_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Body limit inside, CORS outermost (so even 401 and 413 answers carry CORS headers)."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=split_list(config.allowed_origins),
                           allow_methods=split_list(config.allowed_methods),
                           allow_headers=split_list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
