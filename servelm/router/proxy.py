"""Data-parallel forwarding: one worker per request, retried elsewhere only if it never started.

Invariants:
- The request body goes to the worker byte for byte; the response comes back chunk by chunk.
- A request is sent again to another worker only when the first one cannot have started it: the
  connection was refused or timed out while connecting, or it answered 503/429 (busy, nothing
  generated). Any failure after the request was sent (a read error, a reset, a broken stream)
  ends the request with an error: a second worker would produce a second response.
- A stream that already started ends with an OpenAI error event and [DONE] when its worker fails.
- Every worker's ``num_in_flight`` goes back down exactly once per request (``Lease``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from servelm.router.errors import RouterError, error_event
from servelm.router.workers import Worker

logger = logging.getLogger(__name__)

RETRIED_STATUSES = frozenset({429, 503})
"""Statuses that mean "not taken": servelm answers 503 when its queue is full or it is draining."""

_HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                          "te", "trailer", "upgrade", "proxy-connection", "accept-encoding",
                          "content-encoding"})


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Request or response headers minus hop-by-hop ones (the body is relayed raw, uncompressed)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


class Lease:
    """A request's hold on a worker's in-flight count, released once."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        worker.num_in_flight += 1
        worker.num_requests += 1
        self._is_released = False

    def release(self, is_error: bool = False) -> None:
        if is_error:
            self.worker.num_errors += 1
        if not self._is_released:
            self._is_released = True
            self.worker.num_in_flight -= 1


async def open_response(client: httpx.AsyncClient, worker: Worker, method: str, path: str,
                        body: bytes, headers: dict[str, str]) -> httpx.Response:
    """Send a request and return once the worker's status and headers arrived (body unread).

    Raises httpx.ConnectError/ConnectTimeout when the worker was never reached (safe to retry),
    any other httpx.HTTPError when it was reached and failed (not safe).
    """
    request = client.build_request(method, worker.url + path, content=body,
                                   headers={**headers, "accept-encoding": "identity"})
    return await client.send(request, stream=True)


def is_unreached(error: BaseException) -> bool:
    """The worker never got the request: retrying it elsewhere cannot duplicate a response."""
    return isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))


async def relay(worker: Worker, lease: Lease, response: httpx.Response) -> Response:
    """Hand a worker's response to the client: streamed when it is an event stream."""
    headers = forwarded_headers(response.headers)
    is_error = response.status_code >= 500
    if "text/event-stream" in response.headers.get("content-type", ""):
        return StreamingResponse(relay_stream(worker, lease, response), status_code=response.status_code,
                                 headers=headers, background=BackgroundTask(_close, lease, response))
    try:
        body = await response.aread()
    except httpx.HTTPError as error:
        lease.release(is_error=True)
        raise RouterError(502, f"worker {worker.url} failed while answering: "
                               f"{type(error).__name__}: {error}") from None
    finally:
        await response.aclose()
    lease.release(is_error=is_error)
    return Response(body, status_code=response.status_code, headers=headers)


async def relay_stream(worker: Worker, lease: Lease, response: httpx.Response,
                       ) -> AsyncIterator[bytes]:
    """The worker's bytes as they come; a failure becomes an error event ending the stream."""
    ends_event = True
    try:
        async for chunk in response.aiter_raw():
            if chunk:
                ends_event = chunk.endswith(b"\n\n")
                yield chunk
        lease.release(is_error=response.status_code >= 500)
    except httpx.HTTPError as error:
        lease.release(is_error=True)
        logger.warning("worker %s failed mid-stream: %s", worker.url, error)
        prefix = b"" if ends_event else b"\n\n"
        yield prefix + error_event(502, f"worker {worker.url} failed during the response "
                                        f"({type(error).__name__}: {error}); the stream ends here")
    finally:
        await _close(lease, response)


async def _close(lease: Lease, response: httpx.Response) -> None:
    lease.release()
    await response.aclose()
