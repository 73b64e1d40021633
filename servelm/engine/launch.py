"""The engine processes, started before the front end does its own start-up work.

Starting Python and importing torch, transformers and the engine takes an engine process seconds,
and so do the HTTP front end's own imports and checks (fastapi, the model check, the app). Done one
after the other they add up; ``EngineLaunch.begin`` starts the engine processes right after the
command line is parsed, so that both happen at once on two cores. Each process imports the engine
and then waits for its job (its config and socket addresses), which ``AsyncEngine.start`` sends.

Invariants:
- A process loads no model and logs nothing before it is sent its job, so a start the front end
  refuses (an unreadable model, a bad flag found late) shows only the front end's one-line error:
  ``close`` ends every process that got no job, and each dies with the front end anyway
  (``die_with_parent``).
- The environment a process runs with is the front end's at ``begin`` (the OpenMP wait policy
  is exported first: OpenMP reads it once, when torch loads).
- This module imports no torch: the CLI imports it before starting the processes.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

from servelm.config import EngineConfig
from servelm.model.threads import export_openmp_wait_policy, rank_cpu_slices

ENGINE_ENTRY = "servelm.engine.engine_process:run_engine_process"
"""The function each process runs its job with, as ``module:name`` (a benchmark may trace it);
importing its module is the import work the process does before its job."""


class EngineLaunch:
    """The engine processes of one start (one per data-parallel replica), each waiting for its job."""

    def __init__(self, cpu_slices: list[list[int]] | None) -> None:
        self.processes: list[BaseProcess] = []
        self.cpu_slices = cpu_slices
        """Each replica's CPUs (None at dp 1, or with fewer CPUs than replicas: not pinned)."""
        self._jobs: list[Connection | None] = []
        """The sending end of each process's pipe; None once its job was sent or it was ended."""

    @classmethod
    def begin(cls, config: EngineConfig) -> EngineLaunch:
        """Start the engine processes for ``config``; they import the engine meanwhile."""
        export_openmp_wait_policy(config.runtime.omp_wait_policy)  # read by the engine processes
        num_replicas = config.parallel.data_parallel_size
        slices = rank_cpu_slices(num_replicas) if num_replicas > 1 else None
        context = multiprocessing.get_context("spawn")
        launch = cls(slices)
        try:
            for index in range(num_replicas):
                receiver, sender = context.Pipe(duplex=False)
                launch._jobs.append(sender)
                process = context.Process(
                    target=run_when_sent, args=(receiver, os.getpid(), ENGINE_ENTRY,
                                                slices[index] if slices is not None else None,
                                                num_rank_processes(config),
                                                config.runtime.omp_wait_policy),
                    name=f"servelm-engine-{index}" if num_replicas > 1 else "servelm-engine",
                    daemon=True)
                launch.processes.append(process)
                process.start()
                receiver.close()  # the child's copy is the one left: it sees the end of the pipe
        except BaseException:
            launch.close()
            raise
        return launch

    def send(self, index: int, config: EngineConfig, input_address: str, output_address: str) -> None:
        """Give process ``index`` its job: it loads the model and serves the sockets."""
        sender = self._jobs[index]
        assert sender is not None, f"engine process {index} was already sent its job"
        self._jobs[index] = None
        try:
            sender.send((config, input_address, output_address))
        except BrokenPipeError:  # it died importing: the caller's wait for it reports its exit code
            pass
        finally:
            sender.close()

    def close(self) -> None:
        """End every process that was not sent its job (the start was refused or failed)."""
        for index, sender in enumerate(self._jobs):
            if sender is None:
                continue
            sender.close()
            self._jobs[index] = None
            if index < len(self.processes) and self.processes[index].is_alive():
                self.processes[index].kill()
                self.processes[index].join()

    def __enter__(self) -> EngineLaunch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def num_rank_processes(config: EngineConfig) -> int:
    """The rank processes each engine process of ``config`` starts on this node (its ranks but rank
    0, which it holds; none with Ray, which places them itself)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1:
        return 0
    return parallel.ranks_per_node - 1 if parallel.distributed_executor_backend == "mp" else 0


def run_when_sent(jobs: Connection, parent_pid: int, entry: str, cpus: list[int] | None,
                  num_ranks: int = 0, omp_wait_policy: str = "default") -> None:
    """An engine process: die with the front end, take its CPUs, import the engine, start its
    ``num_ranks`` rank processes (they import theirs meanwhile: ``workers.processes``),
    then run the job it is sent; exit quietly when the front end closes the pipe without one."""
    from servelm.distributed.lifetime import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's (it ends this process)
    die_with_parent(parent_pid)
    if cpus is not None:  # a data-parallel replica: its slice of the node (its TP ranks split it)
        os.sched_setaffinity(0, cpus)
    if num_ranks > 0:   # first: a rank imports more than the engine does, and is waited for first
        from servelm.workers.processes import start_waiting_workers

        start_waiting_workers(num_ranks, omp_wait_policy)
    module, name = entry.split(":")
    run: Any = getattr(importlib.import_module(module), name)
    try:
        job = jobs.recv()
    except EOFError:  # the start was refused: the front end says why
        return
    finally:
        jobs.close()
    run(*job)
