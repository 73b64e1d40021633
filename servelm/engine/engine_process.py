"""The engine process's job: load the model, then step, draining the front end's socket
between steps (frontdoor.py's messages: submit, abort, the calls, shutdown). One per data-parallel
replica; async_engine.py is the other end of its sockets.

The process was started by launch.py (which made it die with the front end and pinned a
data-parallel replica to its CPUs); importing this module is its import work before the job
arrives, so the engine's imports stay at the top.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import zmq

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.frontdoor import (AbortRequest, CallResult, EngineFailed, EngineReady,
                                      ExpertDistributionCall, FlushCacheCall, FrontMessage, LoadLoRACall, ModelInfo,
                                      Shutdown, StatsCall, StepOutputs, SubmitRequest,
                                      UnloadLoRACall)
from servelm.engine.heap import IdleTrim
from servelm.engine.monitor import StatsLogger, Watchdog
from servelm.engine.warmup import freeze_start_up_objects, warm_up_for_serving
from servelm.logging_utils import configure_logging, watch_gc
from servelm.workers.processes import preload

PRELOADED = ("transformers.activations", "servelm.model.source", "servelm.model.runner", "xgrammar")
"""Modules every job's load imports, imported with this module, before the job: ``LLMEngine`` imports
them lazily (an engine given its own runner needs none), and after the job arrives they would be
seconds of CPU on the start-up's path, while now they overlap the front end's own start-up work on
another core. transformers builds every model's config (its activations module pulls in what the
config classes import: torch.distributed.tensor, sympy); xgrammar is the default grammar backend."""


preload(PRELOADED)

logger = logging.getLogger(__name__)


def run_engine_process(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The engine process's job: load the model, then step until told to stop."""
    # Ctrl-C and SIGTERM are the front end's to handle: it drains requests, then sends "shutdown".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.server.log_level)
    watch_gc(config.observability.gc_warning_threshold_secs, "engine process")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    parent_pid = os.getppid()  # launch.py's die_with_parent ran: still the front end
    try:
        start_s = time.monotonic()
        engine = LLMEngine(config)
        loaded_s = time.monotonic()
        warm_up_for_serving(engine)
        logger.info("%d start-up objects frozen out of the garbage collector's passes", freeze_start_up_objects())
        if config.observability.show_time_cost:
            logger.info("time cost: model load and KV pool %.2f s, warm-up %.2f s",
                        loaded_s - start_s, time.monotonic() - loaded_s)
    except ValueError as error:  # a configuration the user can fix: the message says how
        logger.error("engine failed to start: %s", error)
        outputs.send_pyobj(EngineFailed(str(error)))
        return
    except Exception as error:
        logger.exception("engine failed to start")
        outputs.send_pyobj(EngineFailed(f"{type(error).__name__}: {error}"))
        return
    outputs.send_pyobj(EngineReady(ModelInfo.from_engine(engine.model_info),
                                   tuple(engine.model_info.get("lora_adapters", ()))))
    stats = StatsLogger(engine, config.observability)
    timeout_s = config.observability.watchdog_timeout
    watchdog = Watchdog(timeout_s) if timeout_s > 0 else None
    idle_trim = IdleTrim()  # freed heap pages back to the OS once idle a while after requests
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    transfer_sockets = engine.disaggregation.sockets() if engine.disaggregation is not None else []
    for socket in transfer_sockets:  # a decode server's pull wakes an idle prefill engine
        poller.register(socket, zmq.POLLIN)
    while True:
        is_transferring = engine.disaggregation is not None and engine.disaggregation.is_waiting
        timeout_ms = 0 if engine.has_unfinished() or is_transferring else 1000
        events = dict(poller.poll(timeout_ms))
        if inputs in events:
            while True:
                message = inputs.recv_pyobj()
                if isinstance(message, Shutdown):
                    return
                _handle(engine, message, outputs)
                if not inputs.poll(0):
                    break
        elif os.getppid() != parent_pid:
            logger.error("front end process exited; engine stopping")
            return
        is_busy = engine.has_unfinished()
        if is_busy or engine.disaggregation is not None:  # transfers expire even when idle
            if watchdog is not None:
                watchdog.step_started()
            step_start_s = time.perf_counter()
            step_outputs = engine.step()
            stats.record_step(time.perf_counter() - step_start_s)
            if watchdog is not None:
                watchdog.step_finished()
            if step_outputs:
                outputs.send_pyobj(StepOutputs(step_outputs))
        idle_trim.update(engine.has_unfinished(), time.monotonic())
        stats.maybe_log()


def _handle(engine: LLMEngine, message: FrontMessage, outputs: zmq.Socket[Any]) -> None:
    """Apply one front-end message between two steps."""
    if isinstance(message, SubmitRequest):
        rejected = engine.submit(message)
        if rejected is not None:
            outputs.send_pyobj(StepOutputs([rejected]))
    elif isinstance(message, AbortRequest):
        aborted = engine.abort_request(message.request_id)
        if aborted is not None:
            outputs.send_pyobj(StepOutputs([aborted]))
    elif isinstance(message, StatsCall):
        outputs.send_pyobj(CallResult(message.call_id, engine.stats()))
    elif isinstance(message, FlushCacheCall):
        outputs.send_pyobj(CallResult(message.call_id, engine.flush_cache()))
    elif isinstance(message, ExpertDistributionCall):
        outputs.send_pyobj(CallResult(message.call_id, engine.expert_distribution(message.action)))
    elif isinstance(message, LoadLoRACall):
        outputs.send_pyobj(CallResult(message.call_id, engine.load_lora_adapter(message.name, message.path)))
    elif isinstance(message, UnloadLoRACall):
        outputs.send_pyobj(CallResult(message.call_id, engine.unload_lora_adapter(message.name)))
    else:
        raise AssertionError(f"unknown front-end message {message!r}")
