"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``.

Invariant: every error the server returns, including FastAPI's own validation errors (which it
would answer with 422) and unknown routes, goes through ``error_response``, so clients see one
shape and the status codes OpenAI uses (400 invalid input, 401 bad key, 404 unknown model or route,
500 engine failure).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.sampling.params import SamplingParamsError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """An error with its HTTP status, raised by route code and turned into an OpenAI error body."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


RETRY_AFTER_S = 1
"""Retry-After on 429 and 503 (busy, not broken): a second is about one engine step under load."""


def error_response(status_code: int, message: str, *, param: str | None = None,
                   code: str | None = None, type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    error_type = type or _TYPE_BY_STATUS.get(status_code, "server_error")
    all_headers = dict(headers or {})
    if status_code in (429, 503):
        all_headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return JSONResponse(error_body(message, error_type, param, code), status_code=status_code,
                        headers=all_headers or None)


def api_error_from(exc: Exception) -> APIError:
    """Map an exception raised while serving a request to the APIError the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, SamplingParamsError):
        message = str(exc)
        return APIError(400, message, param=message.split(" ", 1)[0])
    if isinstance(exc, EngineRequestError):
        return APIError(exc.status_code, str(exc))
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _is_union_member(item: str) -> bool:
    return "[" in item or item[:1].isupper() or item in ("str", "int", "float", "bool", "dict", "list")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable one-line summary of pydantic errors, and the first offending field."""
    parts: list[str] = []
    first_param: str | None = None
    for error in exc.errors():
        # Union members show up as loc items ("list[int]", "NativeSamplingParams"); our field
        # names are lower-case identifiers, so anything else is dropped.
        location = [str(item) for item in error.get("loc", ())
                    if item != "body" and not _is_union_member(str(item))]
        field = ".".join(location) or None
        first_param = first_param or field
        parts.append(f"{field}: {error.get('msg')}" if field else str(error.get("msg")))
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:5]) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through ``error_response``."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, param=exc.param, code=exc.code,
                              type=exc.type)

    for exc_type in (InvalidRequestError, SamplingParamsError, EngineRequestError, Exception):
        @app.exception_handler(exc_type)
        async def _mapped(_: Request, exc: Exception) -> JSONResponse:
            error = api_error_from(exc)
            return error_response(error.status_code, error.message, param=error.param,
                                  code=error.code, type=error.type)
