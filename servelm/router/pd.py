"""Prefill/decode pairs in SGLang's protocol: one request goes to a prefill and a decode server.

The router adds ``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its KV
bootstrap port) and ``bootstrap_room`` (a random 63-bit id) to the JSON body and sends the same
body to both servers at once. The decode server fetches the prompt's K/V from the prefill server
through the bootstrap rendezvous and answers the client; the prefill server's answer is read to its
end (closing it early would abort the prefill) and dropped, except for prompt logprobs.

Batches follow SGLang: a list of prompts (``text``/``input_ids``, or ``prompt`` of
/v1/completions) gets lists of host, port and room, one per prompt; ``n > 1`` keeps one room and
the servers give sample i room + i (so the room is drawn small enough to leave that headroom).

Invariants: if either side fails before answering, the other is closed (which aborts it there)
and the client gets that side's error; a failure after the decode stream started ends the stream
with an error event. Prompt logprobs (/generate ``return_logprob``) are the prefill server's,
followed by any the decode server returned, as SGLang's router merges them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from servelm.router.errors import RouterError, error_event, error_response
from servelm.router.proxy import Lease, forwarded_headers, is_unreached, open_response
from servelm.router.workers import Worker

MAX_ROOM = 2 ** 63 - 1
_ROOM_HEADROOM = 1 << 20
"""Rooms are drawn below MAX_ROOM - this, so room + i for n samples stays a 63-bit integer."""
_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def new_room() -> int:
    return random.randint(0, MAX_ROOM - _ROOM_HEADROOM)


def batch_size(body: dict[str, Any]) -> int | None:
    """Prompts in a batched request (None: a single prompt), as SGLang's router counts them."""
    for key in ("text", "prompt"):
        value = body.get(key)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            return len(value)
        if value is not None:
            return None
    input_ids = body.get("input_ids")
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return len(input_ids)
    return None


def with_bootstrap(body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    """The body both servers get: the client's fields plus the bootstrap triple."""
    assert prefill.bootstrap_port is not None
    size = batch_size(body)
    if size is None:
        extra: dict[str, Any] = {"bootstrap_host": prefill.bootstrap_host,
                                 "bootstrap_port": prefill.bootstrap_port,
                                 "bootstrap_room": new_room()}
    else:
        extra = {"bootstrap_host": [prefill.bootstrap_host] * size,
                 "bootstrap_port": [prefill.bootstrap_port] * size,
                 "bootstrap_room": [new_room() for _ in range(size)]}
    return {**body, **extra}


def merge_prompt_logprobs(prefill_json: Any, decode_json: Any) -> Any:
    """Put the prefill server's prompt logprobs in front of the decode server's (per item)."""
    if isinstance(decode_json, list) and isinstance(prefill_json, list):
        return [merge_prompt_logprobs(p, d) for p, d in zip(prefill_json, decode_json)]
    if not (isinstance(decode_json, dict) and isinstance(prefill_json, dict)):
        return decode_json
    prefill_meta = prefill_json.get("meta_info") or {}
    decode_meta = decode_json.get("meta_info")
    if isinstance(decode_meta, dict):
        for key in _LOGPROB_KEYS:
            if isinstance(prefill_meta.get(key), list):
                decode_meta[key] = prefill_meta[key] + list(decode_meta.get(key) or [])
    return decode_json


def _wants_prompt_logprobs(path: str, body: dict[str, Any]) -> bool:
    return path == "/generate" and bool(body.get("return_logprob"))


class PairRequest:
    """One request on a prefill/decode pair."""

    def __init__(self, client: httpx.AsyncClient, prefill: Worker, decode: Worker, path: str,
                 body: dict[str, Any], headers: dict[str, str]) -> None:
        self.client, self.prefill, self.decode, self.path = client, prefill, decode, path
        self.body = with_bootstrap(body, prefill)
        self.raw = json.dumps(self.body).encode()
        self.headers = {**headers, "content-type": "application/json"}
        self.wants_logprobs = _wants_prompt_logprobs(path, body)

    async def run(self) -> Response:
        leases = {self.prefill: Lease(self.prefill), self.decode: Lease(self.decode)}
        tasks = {worker: asyncio.create_task(open_response(
            self.client, worker, "POST", self.path, self.raw, self.headers)) for worker in leases}
        failure = await self._wait_both(tasks, leases)
        if failure is not None:
            return failure
        prefill_response, decode_response = tasks[self.prefill].result(), tasks[self.decode].result()
        prefill_task = asyncio.create_task(self._read_prefill(prefill_response, leases[self.prefill]))
        if "text/event-stream" in decode_response.headers.get("content-type", ""):
            return StreamingResponse(self._stream(prefill_task, decode_response, leases[self.decode]),
                                     status_code=200, headers=forwarded_headers(decode_response.headers))
        return await self._whole(prefill_task, decode_response, leases[self.decode])

    async def _wait_both(self, tasks: dict[Worker, asyncio.Task[httpx.Response]],
                         leases: dict[Worker, Lease]) -> Response | None:
        """Wait for both sides' status; the first that fails closes the other (None: both 200)."""
        pending = set(tasks.values())
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for worker, task in tasks.items():
                if task not in done:
                    continue
                failure = await self._failure_of(worker, task, leases[worker])
                if failure is None:
                    continue
                for other, other_task in tasks.items():
                    if other is worker:
                        continue
                    other_task.cancel()  # an open connection closed: the server aborts the request
                    with contextlib.suppress(BaseException):
                        response = await other_task
                        await response.aclose()
                    leases[other].release()
                return failure
        return None

    async def _failure_of(self, worker: Worker, task: asyncio.Task[httpx.Response],
                          lease: Lease) -> Response | None:
        error = task.exception()
        if error is not None:
            if is_unreached(error):
                worker.mark_down()
            lease.release(is_error=True)
            return error_response(503 if is_unreached(error) else 502,
                          f"{worker.role.value} server {worker.url} failed: "
                          f"{type(error).__name__}: {error}")
        response = task.result()
        if response.status_code == 200:
            return None
        body = await _read_quietly(response)
        lease.release(is_error=response.status_code >= 500)
        return Response(body, status_code=response.status_code,
                        headers=forwarded_headers(response.headers))

    async def _read_prefill(self, response: httpx.Response, lease: Lease) -> bytes:
        """The prefill server's whole answer; raises RouterError when it failed mid-way."""
        try:
            body = await response.aread()
        except httpx.HTTPError as error:
            lease.release(is_error=True)
            raise RouterError(502, f"prefill server {self.prefill.url} failed: "
                                   f"{type(error).__name__}: {error}") from None
        finally:
            lease.release()  # also when cancelled (the decode side failed first)
            await response.aclose()
        if body.lstrip().startswith(b'{"error"') or b'data: {"error"' in body \
                or b'data:{"error"' in body:
            self.prefill.num_errors += 1
            raise RouterError(502, f"prefill server {self.prefill.url} reported an error: "
                                   f"{body[:500].decode(errors='replace')}")
        return body

    async def _whole(self, prefill_task: asyncio.Task[bytes], decode_response: httpx.Response,
                     decode_lease: Lease) -> Response:
        decode_task = asyncio.create_task(decode_response.aread())
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task},
                                         return_when=asyncio.FIRST_EXCEPTION)
            if prefill_task in done and prefill_task.exception() is not None:
                decode_task.cancel()
                raise prefill_task.exception()  # type: ignore[misc]
            try:
                decode_body = await decode_task
            except httpx.HTTPError as error:
                raise RouterError(502, f"decode server {self.decode.url} failed: "
                                       f"{type(error).__name__}: {error}") from None
            prefill_body = await prefill_task
        except BaseException:
            prefill_task.cancel()
            decode_lease.release(is_error=True)
            await decode_response.aclose()
            raise
        await decode_response.aclose()
        decode_lease.release()
        if self.wants_logprobs:
            decode_body = json.dumps(merge_prompt_logprobs(
                json.loads(prefill_body), json.loads(decode_body))).encode()
        return Response(decode_body, status_code=200,
                        headers=forwarded_headers(decode_response.headers))

    async def _stream(self, prefill_task: asyncio.Task[bytes], decode_response: httpx.Response,
                      decode_lease: Lease) -> AsyncIterator[bytes]:
        lines = decode_response.aiter_lines()
        prefill_json: Any = None
        try:
            while True:
                next_line = asyncio.ensure_future(lines.__anext__())
                waiting: set[asyncio.Future[Any]] = {next_line}
                if not prefill_task.done():
                    waiting.add(prefill_task)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None:
                    next_line.cancel()
                    error = prefill_task.exception()
                    message = error.message if isinstance(error, RouterError) else str(error)
                    yield b"\n\n" + error_event(502, message)
                    decode_lease.release(is_error=True)
                    return
                if next_line not in done:
                    await asyncio.wait({next_line})
                try:
                    line = next_line.result()
                except StopAsyncIteration:
                    break
                if self.wants_logprobs and line.startswith("data:") and "[DONE]" not in line:
                    if prefill_json is None:
                        prefill_json = _first_event(await prefill_task)
                    event = merge_prompt_logprobs(prefill_json, json.loads(line[5:]))
                    line = "data: " + json.dumps(event)
                yield (line + "\n").encode()
            decode_lease.release()
        except httpx.HTTPError as error:
            decode_lease.release(is_error=True)
            yield b"\n\n" + error_event(502, f"decode server {self.decode.url} failed during the "
                                             f"response ({type(error).__name__}: {error})")
        finally:
            decode_lease.release()
            if not prefill_task.done():
                prefill_task.cancel()
            await decode_response.aclose()


def _first_event(body: bytes) -> Any:
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data:") and "[DONE]" not in line:
            return json.loads(line[5:])
    return None


async def _read_quietly(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await response.aclose()
