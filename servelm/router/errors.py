"""OpenAI-shaped errors from the router itself (the workers' own errors pass through unchanged).

The router does not import servelm.server (the engine-side stack); the shape is the same as
servelm.server.errors: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

_TYPE_BY_STATUS = {400: "invalid_request_error", 404: "invalid_request_error",
                   429: "rate_limit_error"}


def error_body(status_code: int, message: str) -> dict[str, object]:
    return {"error": {"message": message, "type": _TYPE_BY_STATUS.get(status_code, "server_error"),
                      "param": None, "code": status_code}}


def error_response(status_code: int, message: str) -> JSONResponse:
    headers = {"Retry-After": "1"} if status_code in (429, 503) else None
    return JSONResponse(error_body(status_code, message), status_code=status_code, headers=headers)


def error_event(status_code: int, message: str) -> bytes:
    """The in-band error that ends a stream which already started, then [DONE]."""
    return (f"data: {json.dumps(error_body(status_code, message))}\n\n"
            "data: [DONE]\n\n").encode()


class RouterError(Exception):
    """A request the router cannot serve: its status and message become an OpenAI error."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
