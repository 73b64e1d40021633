"""The front end's handle on the engine core, which runs in its own process behind ZMQ.

Processes (the engine side is engine_process.py):
- the caller (HTTP server or offline Engine) owns an AsyncEngine: it sends requests down a PUSH
  socket, and the event loop's own reader callback on the PULL socket (``_drain``) routes the
  core's outputs to one asyncio.Queue per request as they arrive: no task and no zmq.asyncio future
  sits between an engine step and the request's consumer (a served token's front-end CPU is mostly
  such per-message machinery, taken from the model's cores).
- the engine process runs ``LLMEngine.step()`` in a loop; between steps it drains its input
  socket (add, abort, info, shutdown), so a long forward pass never blocks the HTTP event loop.

Invariants:
- Every request given to ``generate`` ends with exactly one finished RequestOutput, or the
  consumer stops early, in which case the request is aborted and its KV freed. Outputs that
  queued up while the consumer was busy are yielded as one (``merge_outputs``): a slow client
  costs one chunk per wake-up, not one per engine step.
- If the engine process dies, every pending request fails with an error and ``is_alive`` is
  False (health checks then report 503).
- With ``--dp-size N`` there are N engine processes (replicas, each with its own model, KV pool
  and scheduler); the balancer (balancer.py) picks one per request, and the request's aborts
  and outputs stay with it. Any replica dying counts as the engine dying.
- Every message on the sockets is one of frontdoor.py's dataclasses; generation and embedding
  share one submission path (``_submit``).
Moving the engine elsewhere (another host) changes only this file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, cast

import zmq

from servelm.config import EngineConfig
from servelm.disagg.spec import KVTransfer
from servelm.engine.balancer import LoadBalancer
from servelm.engine.crash_dump import CrashRecorder
from servelm.engine.frontdoor import (PROTOCOL_VERSION, AbortRequest, CallResult, EngineCall,
                                      EngineFailed, EngineReady, ExpertDistributionCall, FlushCacheCall, FrontMessage,
                                      LoadLoRACall, ModelInfo, Shutdown, StatsCall, StepOutputs,
                                      SubmitRequest, UnloadLoRACall)
from servelm.engine.launch import EngineLaunch
from servelm.engine.monitor import acceptance_figures
from servelm.engine.outputs import RequestOutput, merge_outputs
from servelm.errors import InvalidRequestError
from servelm.multimodal.inputs import MultimodalInputs
from servelm.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_STARTUP_POLL_MS = 500
_DRAIN_LIMIT = 64
"""Messages one reader callback routes before it yields the loop to other callbacks (it continues
in the next loop iteration)."""
CALL_TIMEOUT_S = 30.0
"""Longest wait for the engine to answer a call (info, flush_cache) between two steps."""
INFO_WAIT_S = 2.0
"""get_server_info waits this long for fresh figures, then answers with the last known ones."""
HEALTH_RECENT_S = 5.0
"""/health_generate: tokens generated this recently prove the engine generates; no probe runs."""


class EngineDeadError(RuntimeError):
    """The engine process exited; no request can be served."""


@dataclass
class _Replica:
    """One engine process and its sockets, and the figures it last reported."""

    index: int
    process: multiprocessing.process.BaseProcess
    push: zmq.Socket[Any]
    pull: zmq.Socket[Any]
    """Read only by the event loop's reader callback (``AsyncEngine._drain``) once the engine is
    ready."""
    info: dict[str, Any] | None = None
    info_s: float = 0.0
    info_call: asyncio.Future[dict[str, Any]] | None = None


_SUMMED_STATS = ("num_running", "num_waiting", "num_used_blocks", "num_free_blocks",
                 "kv_pool_tokens", "num_cached_blocks", "num_evictable_blocks", "num_prompt_tokens",
                 "num_cached_prompt_tokens", "num_prefill_tokens", "num_shared_prompts", "num_preemptions",
                 "num_steps", "num_generated_tokens",
                 "spec_num_verify_passes", "spec_num_draft_tokens", "spec_num_accepted_tokens")


class AsyncEngine:
    """Submit requests to the engine process(es) and stream back their outputs."""

    def __init__(self, config: EngineConfig, replicas: list[_Replica], socket_dir: str,
                 model_info: ModelInfo, lora_adapters: list[dict[str, Any]] | None = None) -> None:
        self.config = config
        self.model_info = model_info
        self._lora_adapters = list(lora_adapters or [])
        """The adapters requests may name (as the engines reported them after the last change)."""
        self.tokenizer: Any = None
        self._replicas = replicas
        self._balancer = LoadBalancer(config.parallel.load_balance_method, len(replicas))
        self._socket_dir = socket_dir
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._owners: dict[str, int] = {}
        """The replica serving each unfinished request."""
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None
        self._dead = asyncio.Event()
        self._last_token_s: float | None = None
        """When the engine last sent a generated token (monotonic s)."""
        self._health_probe: asyncio.Task[bool] | None = None
        folder = config.observability.crash_dump_folder
        self._crash_recorder = CrashRecorder(folder) if folder else None

    @classmethod
    async def start(cls, config: EngineConfig, launch: EngineLaunch | None = None) -> AsyncEngine:
        """Send each engine process (one per data-parallel replica) its job and wait until every
        model is loaded. ``launch``: the processes, started early (the CLI starts them before its
        own imports); by default they are started here."""

        launch = launch if launch is not None else EngineLaunch.begin(config)
        replica_config = cls._replica_config(config, launch.cpu_slices)
        socket_dir = tempfile.mkdtemp(prefix="servelm-")
        sync_context: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
        replicas: list[_Replica] = []
        tokenizer: asyncio.Future[Any] | None = None
        try:
            for index, process in enumerate(launch.processes):
                input_address = f"ipc://{socket_dir}/input{index}"
                output_address = f"ipc://{socket_dir}/output{index}"
                push = sync_context.socket(zmq.PUSH)
                push.setsockopt(zmq.SNDHWM, 0)
                push.bind(input_address)
                pull = sync_context.socket(zmq.PULL)
                pull.bind(output_address)
                replicas.append(_Replica(index, process, push, pull))
                launch.send(index, replica_config, input_address, output_address)
            # the front end's tokenizer loads while the engines load their models (seconds of
            # every start-up); a GGUF tokenizer both convert at once is cached by whichever ends first
            tokenizer = asyncio.ensure_future(asyncio.to_thread(cls._load_tokenizer, config))
            readies = await asyncio.gather(*(cls._wait_ready(replica.process, replica.pull)
                                             for replica in replicas))
            loaded_tokenizer = await tokenizer
        except BaseException:
            if tokenizer is not None:   # its thread runs on; its outcome is not wanted
                tokenizer.add_done_callback(lambda done: done.cancelled() or done.exception())
            launch.close()
            for replica in replicas:
                if replica.process.is_alive():
                    replica.process.kill()
                replica.push.close(linger=0)
                replica.pull.close(linger=0)
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        num_replicas = len(replicas)
        model_info = readies[0].model_info
        if num_replicas > 1:
            model_info = dataclasses.replace(model_info, data_parallel_size=num_replicas)
        engine = cls(config, replicas, socket_dir, model_info, list(readies[0].lora_adapters))
        engine.tokenizer = loaded_tokenizer
        loop = asyncio.get_running_loop()
        for replica in replicas:
            loop.add_reader(replica.pull.FD, engine._drain, replica)
            loop.call_soon(engine._drain, replica)  # what came after the ready message
        engine._tasks = [asyncio.create_task(engine._watch_process(replica)) for replica in replicas]
        await engine.get_server_info()  # so a later busy engine is answered from known figures
        return engine

    @staticmethod
    def _replica_config(config: EngineConfig, slices: list[list[int]] | None) -> EngineConfig:
        """A replica's config: a pinned replica's default threads follow its slice (its affinity);
        an unpinned one (fewer CPUs than replicas) gets an equal share of the node's cores."""
        num_replicas = config.parallel.data_parallel_size
        if (num_replicas == 1 or slices is not None or config.runtime.num_threads is not None
                or config.parallel.tensor_parallel_size > 1):
            return config
        from servelm.model.threads import rank_num_threads

        threads = rank_num_threads(None, None, num_replicas)
        return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime,
                                                                       num_threads=threads))

    @staticmethod
    def check_model(config: EngineConfig) -> None:
        """Fail fast, before any engine process is sent its job, when the model cannot be found or
        read.

        Raises ValueError with a message for the user (unknown path, hub id, bad packaged model,
        a --lora-paths adapter that cannot be served).
        """
        from servelm.model.packaged import PackagedModelError
        from servelm.model.source import resolve_model_source

        try:
            source = resolve_model_source(config.model)
        except PackagedModelError as error:
            raise ValueError(str(error)) from error
        if config.lora.is_enabled:  # a bad --lora-paths adapter: one line, before any model loads
            from servelm.lora.adapter import BaseShapes, LoRAAdapterError
            from servelm.lora.manager import read_adapter

            shapes = BaseShapes.from_hf_config(source.hf_config)
            for lora_source in config.lora.sources:
                try:
                    read_adapter(config.lora, shapes, lora_source.name, lora_source.path)
                except LoRAAdapterError as error:
                    raise ValueError(f"--lora-paths: {error}") from None

    @staticmethod
    async def _wait_ready(process: multiprocessing.process.BaseProcess,
                          pull: zmq.Socket[Any]) -> EngineReady:
        while True:
            if _has_message(pull) or await _readable(pull, _STARTUP_POLL_MS / 1e3):
                message = pull.recv_pyobj(zmq.NOBLOCK)
                if isinstance(message, EngineReady):
                    if message.protocol_version != PROTOCOL_VERSION:
                        raise RuntimeError(
                            f"engine process speaks front-door protocol {message.protocol_version}, "
                            f"this front end {PROTOCOL_VERSION}: a mismatched servelm install")
                    return message
                if isinstance(message, EngineFailed):
                    raise RuntimeError(f"engine failed to start: {message.reason}")
            elif not process.is_alive():
                raise RuntimeError(f"engine process exited during start-up (exit code {process.exitcode})")

    @staticmethod
    def _load_tokenizer(config: EngineConfig) -> Any:
        """The front end's own tokenizer."""
        if config.model.skip_tokenizer_init:
            return None
        from servelm.model.source import resolve_model_source
        from servelm.model.tokenizer import load_tokenizer

        return load_tokenizer(config.model, resolve_model_source(config.model))

    # -- background work --------------------------------------------------------------------
    def _drain(self, replica: _Replica) -> None:
        """The reader callback of ``replica``'s PULL socket: route every message it holds. The
        socket's descriptor signals edges, not levels, so this reads until the socket is empty (or
        continues in the next loop iteration after _DRAIN_LIMIT messages)."""
        pull = replica.pull
        if pull.closed:
            return
        for _ in range(_DRAIN_LIMIT):
            if not _has_message(pull):
                return
            try:
                self._route(replica, pull.recv_pyobj(zmq.NOBLOCK))
            except Exception:   # one bad message must not leave the rest unread until the next edge
                logger.exception("engine output from replica %d could not be routed", replica.index)
        asyncio.get_running_loop().call_soon(self._drain, replica)

    def _route(self, replica: _Replica, message: Any) -> None:
        if isinstance(message, StepOutputs):
            for output in message.outputs:
                if output.new_token_ids and output.finish_reason != "error":
                    self._last_token_s = time.monotonic()
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif isinstance(message, CallResult):
            future = self._calls.pop(message.call_id, None)
            if future is not None and future is replica.info_call:
                replica.info, replica.info_s = dict(message.result), time.monotonic()
            if future is not None and not future.done():
                future.set_result(message.result)

    async def _watch_process(self, replica: _Replica) -> None:
        while replica.process.is_alive():
            await asyncio.sleep(0.5)
        if self._dead_reason is not None:  # another replica died first
            return
        if len(self._replicas) > 1:
            from servelm.workers.multiproc import describe_exit

            self._dead_reason = (f"data-parallel replica {replica.index} (engine process pid "
                                 f"{replica.process.pid}) {describe_exit(replica.process.exitcode or 0)}")
        else:
            self._dead_reason = f"engine process exited (exit code {replica.process.exitcode})"
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
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The engine processes, one per data-parallel replica."""
        return [replica.process for replica in self._replicas]

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    async def wait_dead(self) -> str:
        """Return (with the reason) once the engine process has died; pending requests have
        already been failed by then."""
        await self._dead.wait()
        return self._dead_reason or "engine process exited"

    def _send(self, replica: _Replica, message: FrontMessage) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        replica.push.send_pyobj(message)

    def _dispatch(self, request_id: str, num_tokens: int) -> _Replica:
        """The balancer's replica for a new request, remembered until ``_release``."""
        index = self._balancer.choose(num_tokens)
        self._owners[request_id] = index
        return self._replicas[index]

    def _release(self, request_id: str, num_tokens: int, abort: bool) -> None:
        index = self._owners.pop(request_id)
        self._balancer.finish(index, num_tokens)
        if abort and self._dead_reason is None:
            self._replicas[index].push.send_pyobj(AbortRequest(request_id))

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0,
                 group: str = "", lora_name: str | None = None,
                 kv_transfer: KVTransfer | None = None,
                 mm_inputs: MultimodalInputs | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; stopping early (cancel, close) aborts it.

        ``group`` names the client request this one is part of (see Request.group);
        ``lora_name`` the LoRA adapter it runs with (None: the base model); ``kv_transfer`` its
        part in a prefill/decode transfer (None: co-located); ``mm_inputs`` its images (the
        processor's result, whose ``prompt_token_ids`` are the ones to give here)."""
        return self._submit(SubmitRequest(request_id, list(prompt_token_ids), params, priority,
                                          group, lora_name, kv_transfer, mm_inputs))

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        """Embed one input (task embed): its finished output, with ``embedding`` or ``error``.
        Cancelling the call aborts the request."""
        request = SubmitRequest(request_id, list(prompt_token_ids), None, priority)
        async with aclosing(self._submit(request)) as outputs:  # type: ignore[type-var]
            async for output in outputs:
                if output.is_finished:
                    return output
        raise AssertionError(f"request {request_id} ended without a finished output")

    async def _submit(self, request: SubmitRequest) -> AsyncIterator[RequestOutput]:
        """The one submission path (generation and embedding): dispatch to a replica, send, and
        yield the request's outputs until the finished one; stopping early aborts it."""
        request_id = request.request_id
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="rid")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        is_finished = False
        num_output_tokens = 0
        finish_reason: str | None = None
        load = request.load_tokens
        replica = self._dispatch(request_id, load)
        try:
            self._send(replica, request)
            if self._crash_recorder is not None:
                self._crash_recorder.record(request_id, request.prompt_token_ids,
                                            request.params if request.params is not None
                                            else {"task": "embed"}, request.priority)
            held: RequestOutput | Exception | None = None
            while True:
                output = held if held is not None else await queue.get()
                held = None
                if isinstance(output, Exception):
                    is_finished = True
                    raise output
                while not output.is_finished and not queue.empty():  # the consumer fell behind
                    later = queue.get_nowait()
                    if isinstance(later, Exception):
                        held = later
                        break
                    output = merge_outputs(output, later)
                is_finished = output.is_finished
                num_output_tokens, finish_reason = output.num_output_tokens, output.finish_reason
                yield output
                if is_finished:
                    return
        finally:
            del self._queues[request_id]
            if self._crash_recorder is not None and self._dead_reason is None:
                self._crash_recorder.finish(request_id, finish_reason, num_output_tokens)
            self._release(request_id, load, abort=not is_finished)

    async def abort(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None and self._dead_reason is None:
            self._replicas[index].push.send_pyobj(AbortRequest(request_id))

    async def get_server_info(self) -> dict[str, Any]:
        """The engine's live figures, with ``stats_age_s`` (seconds since the engine reported them).

        The engine answers between steps; while it is inside a long one, this waits at most
        INFO_WAIT_S and then answers with the last known figures (their age says how stale).
        Concurrent callers share one outstanding call, so a busy engine is never flooded.
        With data parallelism the figures are summed over the replicas, and ``dp_replicas``
        lists each one's running/queued requests and how many requests it was given.
        """
        infos = await asyncio.gather(*(self._replica_info(r) for r in self._replicas))
        if len(infos) == 1:
            return infos[0]
        total: dict[str, Any] = {**infos[0]}
        for key in _SUMMED_STATS:
            if all(key in info for info in infos):
                total[key] = sum(info[key] for info in infos)
        used, free = total.get("num_used_blocks", 0), total.get("num_free_blocks", 0)
        total["token_usage"] = round(used / max(1, used + free), 4)
        total["cache_hit_rate"] = round(total.get("num_cached_prompt_tokens", 0)
                                        / max(1, total.get("num_prompt_tokens", 0)), 4)
        if "spec_num_verify_passes" in total:
            total.update(acceptance_figures(total["spec_num_verify_passes"],
                                            total["spec_num_draft_tokens"],
                                            total["spec_num_accepted_tokens"]))
        total["stats_age_s"] = max(info["stats_age_s"] for info in infos)
        total["dp_replicas"] = [
            {"replica": index, "pid": self._replicas[index].process.pid,
             "num_running": info.get("num_running"), "num_waiting": info.get("num_waiting"),
             "num_requests_dispatched": self._balancer.loads[index].served_requests,
             "num_unfinished_requests": self._balancer.loads[index].running_requests,
             "num_generated_tokens": info.get("num_generated_tokens"),
             "token_usage": info.get("token_usage"), "stats_age_s": info["stats_age_s"]}
            for index, info in enumerate(infos)]
        return total

    async def _replica_info(self, replica: _Replica) -> dict[str, Any]:
        if replica.info_call is None or replica.info_call.done():
            replica.info_call = self._start_call(replica, StatsCall)
        call = replica.info_call
        try:
            await asyncio.wait_for(asyncio.shield(call),
                                   INFO_WAIT_S if replica.info is not None else CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            if replica.info is None:
                raise
        assert replica.info is not None
        return {**replica.info, "stats_age_s": round(time.monotonic() - replica.info_s, 3)}

    async def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache of every replica: {"success": bool, "message": str} (refused
        while busy)."""
        results = await asyncio.gather(*(self._call(r, FlushCacheCall) for r in self._replicas))
        if len(results) == 1:
            return results[0]
        failed = [f"replica {i}: {result.get('message')}" for i, result in enumerate(results)
                  if not result.get("success")]
        if failed:
            return {"success": False, "message": "; ".join(failed)}
        return {"success": True, "message": f"cache flushed on {len(results)} replicas"}

    async def expert_distribution(self, action: str) -> dict[str, Any]:
        """The expert distribution recorder of every replica: start, stop or dump (one replica's
        answer; with --dp-size > 1 ``replicas`` lists each one's)."""
        results = await asyncio.gather(*(self._call(r, lambda call_id: ExpertDistributionCall(call_id, action))
                                         for r in self._replicas))
        if len(results) == 1:
            return results[0]
        return {"success": all(result.get("success") for result in results), "replicas": results,
                "message": "; ".join(str(result.get("message")) for result in results)}

    @property
    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapters requests may name (as the engine reported them after the last change)."""
        return list(self._lora_adapters)

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load an adapter on every replica: {"success", "status", "message", ...}. A replica that
        refuses it (400, naming the reason) leaves it loaded on none."""
        results = await asyncio.gather(*(self._call(r, lambda call_id: LoadLoRACall(call_id, name, path)) for r in self._replicas))
        failed = next((result for result in results if not result.get("success")), None)
        if failed is not None:
            for replica, result in zip(self._replicas, results):
                if result.get("success"):  # keep the replicas in agreement
                    await self._call(replica, lambda call_id: UnloadLoRACall(call_id, name))
            return failed
        self._set_adapters(name, path, results)
        return results[0]

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unload an adapter on every replica; its running requests finish first."""
        results = await asyncio.gather(*(self._call(r, lambda call_id: UnloadLoRACall(call_id, name)) for r in self._replicas))
        if any(result.get("success") for result in results):
            self._lora_adapters = [a for a in self._lora_adapters if a["name"] != name]
        return next((r for r in results if not r.get("success")), results[0])

    def _set_adapters(self, name: str, path: str, results: list[dict[str, Any]]) -> None:
        adapters = [a for a in self._lora_adapters if a["name"] != name]
        adapters.append({"name": name, "path": path, "load_time_s": results[0].get("load_time_s")})
        self._lora_adapters = adapters

    def _start_call(self, replica: _Replica, make: Callable[[int], EngineCall]
                    ) -> asyncio.Future[dict[str, Any]]:
        """Send the call ``make(call_id)``; its future resolves when the engine answers (between
        two steps)."""
        call_id = next(self._call_ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(replica, make(call_id))
        return future

    async def _call(self, replica: _Replica, make: Callable[[int], EngineCall]) -> dict[str, Any]:
        future = self._start_call(replica, make)
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
        if self.model_info.task == "embed":  # an embedding model's one-step request
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
        loop = asyncio.get_running_loop()
        for replica in self._replicas:
            if not replica.pull.closed:
                loop.remove_reader(replica.pull.FD)
        for replica in self._replicas:
            if replica.process.is_alive():
                try:
                    replica.push.send_pyobj(Shutdown())
                except zmq.ZMQError:
                    pass
        for replica in self._replicas:
            await asyncio.to_thread(replica.process.join, 10)
            if replica.process.is_alive():
                replica.process.kill()
                await asyncio.to_thread(replica.process.join, 5)
        for replica in self._replicas:
            replica.push.close(linger=0)
            replica.pull.close(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def _has_message(pull: zmq.Socket[Any]) -> bool:
    """A message can be read from ``pull`` without waiting (this also clears its descriptor's
    readiness, which zmq sets on any change of state)."""
    return bool(cast(int, pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


async def _readable(pull: zmq.Socket[Any], timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for a message on ``pull`` (start-up, before ``_drain`` reads it)."""
    loop = asyncio.get_running_loop()
    signalled: asyncio.Future[None] = loop.create_future()
    fd = pull.FD

    def wake() -> None:
        if not signalled.done():
            signalled.set_result(None)

    loop.add_reader(fd, wake)
    try:
        if not _has_message(pull):
            await asyncio.wait_for(signalled, timeout_s)
    except asyncio.TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)
    return _has_message(pull)
