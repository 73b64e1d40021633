"""The front end's handle on the engine core, which runs in its own process behind ZMQ.

Processes:
- the caller (HTTP server or offline Engine) owns an AsyncEngine: it sends requests down a PUSH
  socket and a background task routes the core's outputs to one asyncio.Queue per request.
- the engine process runs ``LLMEngine.step()`` in a loop; between steps it drains its input
  socket (add, abort, info, shutdown), so a long forward pass never blocks the HTTP event loop.

Invariants:
- Every request given to ``generate`` ends with exactly one finished RequestOutput, or the
  consumer stops early, in which case the request is aborted and its KV freed.
- If the engine process dies, every pending request fails with an error and ``is_alive`` is
  False (health checks then report 503).
Moving the engine elsewhere (another host, several replicas) changes only this file.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from servelm.config import EngineConfig
from servelm.engine.crash_dump import CrashRecorder
from servelm.engine.outputs import RequestOutput
from servelm.errors import InvalidRequestError
from servelm.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_STARTUP_POLL_MS = 500
CALL_TIMEOUT_S = 30.0
"""Longest wait for the engine to answer a call (info, flush_cache) between two steps."""
INFO_WAIT_S = 2.0
"""get_server_info waits this long for fresh figures, then answers with the last known ones."""
HEALTH_RECENT_S = 5.0
"""/health_generate: tokens generated this recently prove the engine generates; no probe runs."""


class EngineDeadError(RuntimeError):
    """The engine process exited; no request can be served."""


def run_engine_process(config: EngineConfig, input_address: str, output_address: str,
                       parent_pid: int | None = None) -> None:
    """Entry point of the engine process: load the model, then step until told to stop.

    ``parent_pid`` is the front end's pid, read before the spawn: this process dies with it
    (even when the front end is SIGKILLed and runs no cleanup), so the KV pool is never orphaned.
    """
    from servelm.distributed.lifetime import die_with_parent

    die_with_parent(parent_pid)
    from servelm.engine.engine import LLMEngine
    from servelm.engine.monitor import StatsLogger, Watchdog
    from servelm.logging_utils import configure_logging

    # Ctrl-C and SIGTERM are the front end's to handle: it drains requests, then sends "shutdown".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.server.log_level)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    parent_pid = os.getppid()  # after die_with_parent: still the front end
    try:
        engine = LLMEngine(config)
    except ValueError as error:  # a configuration the user can fix: the message says how
        logger.error("engine failed to start: %s", error)
        outputs.send_pyobj(("failed", str(error)))
        return
    except Exception as error:
        logger.exception("engine failed to start")
        outputs.send_pyobj(("failed", f"{type(error).__name__}: {error}"))
        return
    outputs.send_pyobj(("ready", engine.model_info))
    stats = StatsLogger(engine, config.observability)
    timeout_s = config.observability.watchdog_timeout
    watchdog = Watchdog(timeout_s) if timeout_s > 0 else None
    while True:
        timeout_ms = 0 if engine.has_unfinished() else 1000
        if inputs.poll(timeout_ms):
            while True:
                message = inputs.recv_pyobj()
                if message[0] == "shutdown":
                    return
                _handle(engine, message, outputs)
                if not inputs.poll(0):
                    break
        elif os.getppid() != parent_pid:
            logger.error("front end process exited; engine stopping")
            return
        if engine.has_unfinished():
            if watchdog is not None:
                watchdog.step_started()
            step_outputs = engine.step()
            if watchdog is not None:
                watchdog.step_finished()
            if step_outputs:
                outputs.send_pyobj(("outputs", step_outputs))
        stats.maybe_log()


def _handle(engine: Any, message: tuple[Any, ...], outputs: zmq.Socket[Any]) -> None:
    kind = message[0]
    if kind == "add":
        _, request_id, prompt_token_ids, params, priority, group = message
        rejected = engine.add_request(request_id, prompt_token_ids, params, priority, group=group)
        if rejected is not None:
            outputs.send_pyobj(("outputs", [rejected]))
    elif kind == "embed":
        _, request_id, prompt_token_ids, priority = message
        rejected = engine.add_embedding_request(request_id, prompt_token_ids, priority)
        if rejected is not None:
            outputs.send_pyobj(("outputs", [rejected]))
    elif kind == "abort":
        aborted = engine.abort_request(message[1])
        if aborted is not None:
            outputs.send_pyobj(("outputs", [aborted]))
    elif kind == "info":
        outputs.send_pyobj(("info", message[1], engine.stats()))
    elif kind == "flush_cache":  # answered like "info": a call id and a dict
        outputs.send_pyobj(("info", message[1], engine.flush_cache()))
    else:
        raise AssertionError(f"unknown engine message {kind!r}")


class AsyncEngine:
    """Submit requests to the engine process and stream back their outputs."""

    def __init__(self, config: EngineConfig, process: multiprocessing.process.BaseProcess,
                 socket_dir: str, push: zmq.Socket[Any], pull: zmq.asyncio.Socket,
                 model_info: dict[str, Any]) -> None:
        self.config = config
        self.model_info = model_info
        self.tokenizer: Any = None
        self._process = process
        self._socket_dir = socket_dir
        self._push = push
        self._pull = pull
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None
        self._dead = asyncio.Event()
        self._info: dict[str, Any] | None = None
        """The engine's figures as last reported, and when (monotonic s)."""
        self._info_s = 0.0
        self._info_call: asyncio.Future[dict[str, Any]] | None = None
        self._last_token_s: float | None = None
        """When the engine last sent a generated token (monotonic s)."""
        self._health_probe: asyncio.Task[bool] | None = None
        folder = config.observability.crash_dump_folder
        self._crash_recorder = CrashRecorder(folder) if folder else None

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Spawn the engine process and wait until its model is loaded."""
        socket_dir = tempfile.mkdtemp(prefix="servelm-")
        input_address = f"ipc://{socket_dir}/input"
        output_address = f"ipc://{socket_dir}/output"
        sync_context: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
        push = sync_context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.bind(input_address)
        pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        pull.bind(output_address)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, input_address, output_address, os.getpid()),
            name="servelm-engine", daemon=True)
        process.start()
        try:
            model_info = await cls._wait_ready(process, pull)
        except BaseException:
            process.kill()
            push.close(linger=0)
            pull.close(linger=0)
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        engine = cls(config, process, socket_dir, push, pull, model_info)
        engine.tokenizer = await asyncio.to_thread(engine._load_tokenizer)
        engine._tasks = [asyncio.create_task(engine._route_outputs()),
                         asyncio.create_task(engine._watch_process())]
        await engine.get_server_info()  # so a later busy engine is answered from known figures
        return engine

    @staticmethod
    def check_model(config: EngineConfig) -> None:
        """Fail fast, before any process starts, when the model cannot be found or read.

        Raises ValueError with a message for the user (unknown path, hub id, bad packaged model).
        """
        from servelm.model.packaged import PackagedModelError
        from servelm.model.source import resolve_model_source

        try:
            resolve_model_source(config.model)
        except PackagedModelError as error:
            raise ValueError(str(error)) from error

    @staticmethod
    async def _wait_ready(process: multiprocessing.process.BaseProcess,
                          pull: zmq.asyncio.Socket) -> dict[str, Any]:
        while True:
            if await pull.poll(_STARTUP_POLL_MS):
                message = await pull.recv_pyobj()
                if message[0] == "ready":
                    return dict(message[1])
                if message[0] == "failed":
                    raise RuntimeError(f"engine failed to start: {message[1]}")
            elif not process.is_alive():
                raise RuntimeError(f"engine process exited during start-up (exit code {process.exitcode})")

    def _load_tokenizer(self) -> Any:
        """The front end's own tokenizer (the engine process has already cached conversions)."""
        if self.config.model.skip_tokenizer_init:
            return None
        from servelm.model.source import resolve_model_source
        from servelm.model.tokenizer import load_tokenizer

        return load_tokenizer(self.config.model, resolve_model_source(self.config.model))

    # -- background tasks -------------------------------------------------------------------
    async def _route_outputs(self) -> None:
        while True:
            message = await self._pull.recv_pyobj()
            if message[0] == "outputs":
                for output in message[1]:
                    if output.new_token_ids and output.finish_reason != "error":
                        self._last_token_s = time.monotonic()
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif message[0] == "info":
                future = self._calls.pop(message[1], None)
                if future is not None and future is self._info_call:
                    self._info, self._info_s = dict(message[2]), time.monotonic()
                if future is not None and not future.done():
                    future.set_result(message[2])

    async def _watch_process(self) -> None:
        while self._process.is_alive():
            await asyncio.sleep(0.5)
        self._dead_reason = f"engine process exited (exit code {self._process.exitcode})"
        logger.error(self._dead_reason)
        if self._crash_recorder is not None:
            self._crash_recorder.dump(self._dead_reason)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self._dead_reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(self._dead_reason))
        self._dead.set()

    # -- public API -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    async def wait_dead(self) -> str:
        """Return (with the reason) once the engine process has died; pending requests have
        already been failed by then."""
        await self._dead.wait()
        return self._dead_reason or "engine process exited"

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        self._push.send_pyobj(message)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       group: str = "") -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; stopping early (cancel, close) aborts it.

        ``group`` names the client request this one is part of (see Request.group)."""
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="rid")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        is_finished = False
        num_output_tokens = 0
        finish_reason: str | None = None
        try:
            self._send(("add", request_id, list(prompt_token_ids), params, priority, group))
            if self._crash_recorder is not None:
                self._crash_recorder.record(request_id, prompt_token_ids, params, priority)
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    is_finished = True
                    raise output
                is_finished = output.is_finished
                num_output_tokens, finish_reason = output.num_output_tokens, output.finish_reason
                yield output
                if is_finished:
                    return
        finally:
            del self._queues[request_id]
            if self._crash_recorder is not None and self._dead_reason is None:
                self._crash_recorder.finish(request_id, finish_reason, num_output_tokens)
            if not is_finished and self._dead_reason is None:
                self._push.send_pyobj(("abort", request_id))

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        """Embed one input (task embed): its finished output, with ``embedding`` or ``error``.
        Cancelling the call aborts the request."""
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="rid")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        is_finished = False
        try:
            self._send(("embed", request_id, list(prompt_token_ids), priority))
            if self._crash_recorder is not None:
                self._crash_recorder.record(request_id, prompt_token_ids, {"task": "embed"}, priority)
            while True:
                output = await queue.get()
                is_finished = isinstance(output, Exception) or output.is_finished
                if isinstance(output, Exception):
                    raise output
                if output.is_finished:
                    if self._crash_recorder is not None:
                        self._crash_recorder.finish(request_id, output.finish_reason, 0)
                    return output
        finally:
            del self._queues[request_id]
            if not is_finished and self._dead_reason is None:
                self._push.send_pyobj(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        if self._dead_reason is None:
            self._push.send_pyobj(("abort", request_id))

    async def get_server_info(self) -> dict[str, Any]:
        """The engine's live figures, with ``stats_age_s`` (seconds since the engine reported them).

        The engine answers between steps; while it is inside a long one, this waits at most
        INFO_WAIT_S and then answers with the last known figures (their age says how stale).
        Concurrent callers share one outstanding call, so a busy engine is never flooded.
        """
        if self._info_call is None or self._info_call.done():
            self._info_call = self._start_call("info")
        call = self._info_call
        try:
            await asyncio.wait_for(asyncio.shield(call),
                                   INFO_WAIT_S if self._info is not None else CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            if self._info is None:
                raise
        assert self._info is not None
        return {**self._info, "stats_age_s": round(time.monotonic() - self._info_s, 3)}

    async def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache: {"success": bool, "message": str} (refused while busy)."""
        return await self._call("flush_cache")

    def _start_call(self, kind: str) -> asyncio.Future[dict[str, Any]]:
        """Send a call; its future resolves when the engine answers (between two steps)."""
        call_id = next(self._call_ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send((kind, call_id))
        return future

    async def _call(self, kind: str) -> dict[str, Any]:
        future = self._start_call(kind)
        try:
            return await asyncio.wait_for(future, timeout=CALL_TIMEOUT_S)
        finally:
            for call_id, pending in list(self._calls.items()):
                if pending is future:
                    del self._calls[call_id]

    async def health_generate(self) -> bool:
        """True when the engine generates (SGLang's semantics, kept cheap).

        Tokens sent in the last HEALTH_RECENT_S prove it without any work. Otherwise one
        one-token probe runs, shared by every concurrent caller, so health checks take at most
        one queue slot. A probe the engine refuses as busy (queue full, status 503) still proves
        its loop runs: a busy server is healthy.
        """
        if self._dead_reason is not None:
            return False
        if self._last_token_s is not None and time.monotonic() - self._last_token_s < HEALTH_RECENT_S:
            return True
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.create_task(self._probe())
        return await asyncio.shield(self._health_probe)

    async def _probe(self) -> bool:
        request_id = f"health-{next(self._call_ids)}-{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        if self.model_info.get("task") == "embed":  # an embedding model's one-step request
            try:
                output = await self.encode(request_id, [0])
                return output.finish_reason != "error" or output.error_status == 503
            except EngineDeadError:
                return False
        try:
            async for output in self.generate(request_id, [0], params):
                if output.is_finished:
                    return output.finish_reason != "error" or output.error_status == 503
        except EngineDeadError:
            return False
        return False

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._process.is_alive():
            try:
                self._push.send_pyobj(("shutdown",))
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
