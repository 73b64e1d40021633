"""Running engine requests for one HTTP request: merging their outputs, SSE framing, disconnects.

Invariants:
- Each engine stream is consumed by its own task; when the HTTP request ends for any reason (done,
  error, client gone, handler cancelled) every such task is cancelled, which per the AsyncEngine
  contract aborts its engine request and frees its KV. Nothing waits on a client that left.
- A client disconnect is noticed while waiting for the engine (not only when the next chunk is
  written), for streaming and non-streaming requests alike.
- A streamed response starts (status 200, headers) only once the engine has taken the request:
  ``open_outputs`` waits for the first output, so a refusal (queue full: 503 with Retry-After;
  invalid: 400) is answered with its own status, never as an error event inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from servelm.disagg.spec import KVTransfer
from servelm.engine.frontdoor import EngineClient
from servelm.engine.outputs import RequestOutput
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.multimodal.inputs import MultimodalInputs
from servelm.sampling.params import SamplingParams

SSE_DONE = "data: [DONE]\n\n"
_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""``json.dumps(data, ensure_ascii=False, separators=(",", ":"))`` without building an encoder per
event (one per streamed token)."""


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {_SSE_JSON.encode(data)}\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


@dataclass(slots=True)
class Submission:
    """One engine request of an HTTP request: its choice index, id, prompt and parameters."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Scheduling priority (only with priority scheduling; validated by ServingContext)."""
    group: str = ""
    """The HTTP request's id, shared by all its submissions: the engine admits groups in turn."""
    lora_name: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    kv_transfer: KVTransfer | None = None
    """Its part in a prefill/decode transfer (server/disagg.py); None: co-located."""
    kv_transfer_params: dict[str, Any] | None = None
    """Set from the finished output of a vLLM-flow prefill request (the decode call's params)."""
    mm_inputs: MultimodalInputs | None = None
    """The prompt's images (SubmitRequest.mm_inputs); None: a text prompt."""


async def wait_disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has already been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_DISCONNECTED = object()
_DONE = object()


def _generate(engine: EngineClient, submission: Submission, is_grouped: bool) -> AsyncIterator[RequestOutput]:
    images = {"mm_inputs": submission.mm_inputs} if submission.mm_inputs is not None else {}
    return engine.generate(submission.request_id, submission.prompt_token_ids, submission.params,
                           priority=submission.priority, group=submission.group if is_grouped else "",
                           lora_name=submission.lora_name, kv_transfer=submission.kv_transfer, **images)


def stream_outputs(engine: EngineClient, submissions: list[Submission], request: Request | None
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) from all submissions as they arrive, in arrival order.

    Raises ClientDisconnected when ``request``'s client leaves, EngineRequestError when the engine
    cannot serve a request. Callers must close this generator (``contextlib.aclosing``) or run it
    to the end so the engine requests are cancelled promptly.
    """
    if len(submissions) == 1:
        return _stream_one(engine, submissions[0], request)
    return _stream_many(engine, submissions, request)


async def _stream_many(engine: EngineClient, submissions: list[Submission], request: Request | None
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``stream_outputs`` of several submissions: one pump task each, merged by one queue."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(submission: Submission) -> None:
        outputs = _generate(engine, submission, is_grouped=True)
        try:
            async for output in outputs:
                if output.kv_transfer_params is not None:
                    submission.kv_transfer_params = output.kv_transfer_params
                queue.put_nowait((submission.index, output))
                if output.is_finished:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the engine died or refused: report it to the consumer
            queue.put_nowait((submission.index, error))
        finally:
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()
        queue.put_nowait((submission.index, _DONE))

    async def watch() -> None:
        assert request is not None
        await wait_disconnected(request)
        queue.put_nowait((-1, _DISCONNECTED))

    tasks = [asyncio.create_task(pump(submission)) for submission in submissions]
    if request is not None:
        tasks.append(asyncio.create_task(watch()))
    try:
        remaining = len(submissions)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif item is _DISCONNECTED:
                raise ClientDisconnected()
            elif isinstance(item, InvalidRequestError):
                raise item  # e.g. a request id already in use: the client's mistake, a 400
            elif isinstance(item, Exception):
                raise EngineRequestError(f"engine failed: {type(item).__name__}: {item}") from item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _stream_one(engine: EngineClient, submission: Submission, request: Request | None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``stream_outputs`` of one submission, read by its consumer's own task: no pump task and no
    second queue between the engine's output and the consumer (one task wake-up per output instead
    of two: a served token's front-end CPU is mostly such machinery). The disconnect watcher
    cancels the consumer only while it waits for the engine (``waiting``), else it leaves a mark
    that the next read sees; either way the engine request is aborted as its stream closes."""
    outputs = _generate(engine, submission, is_grouped=False)
    waiting: asyncio.Task[Any] | None = None
    """The task awaiting the engine's next output now (None while the consumer is elsewhere)."""
    is_disconnected = False

    async def watch() -> None:
        nonlocal is_disconnected
        assert request is not None
        await wait_disconnected(request)
        is_disconnected = True
        if waiting is not None:
            waiting.cancel()

    watcher = asyncio.create_task(watch()) if request is not None else None
    try:
        while not is_disconnected:
            waiting = asyncio.current_task()
            try:
                output = await outputs.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if is_disconnected and waiting is not None:
                    waiting.uncancel()  # the watcher's cancel: reported as a disconnect
                    raise ClientDisconnected() from None
                raise
            except InvalidRequestError:
                raise  # e.g. a request id already in use: the client's mistake, a 400
            except Exception as error:  # the engine died or refused
                raise EngineRequestError(f"engine failed: {type(error).__name__}: {error}") from error
            finally:
                waiting = None
            if output.kv_transfer_params is not None:
                submission.kv_transfer_params = output.kv_transfer_params
            yield submission.index, output
            if output.is_finished:
                return
        raise ClientDisconnected()
    finally:
        if watcher is not None:
            watcher.cancel()
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()


async def open_outputs(engine: EngineClient, submissions: list[Submission], request: Request | None
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``stream_outputs``, started: returns once the first output has arrived.

    A refusal of the first output raises here (EngineRequestError with the engine's status,
    InvalidRequestError, ClientDisconnected), before the caller has sent any response header.
    The returned generator yields that first output, then the rest; close it like
    ``stream_outputs``.
    """
    stream = stream_outputs(engine, submissions, request)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return _chain(None, stream)
    except BaseException:
        await stream.aclose()
        raise
    if first[1].finish_reason == "error":
        await stream.aclose()
        raise EngineRequestError.from_output(first[1])
    return _chain(first, stream)


async def _chain(first: tuple[int, RequestOutput] | None,
                 rest: AsyncIterator[tuple[int, RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
