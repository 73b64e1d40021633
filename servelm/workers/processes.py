"""Rank processes (``python -m servelm.workers.worker``), started with their job or ahead of it.

A rank process imports what its job needs (torch, the runner: seconds of CPU), then reads its
``WorkerInit`` from stdin. ``spawn_worker`` starts one and writes its job at once; a process that
knows it will need ranks before it knows their jobs (an engine process waiting for its own job)
calls ``start_waiting_workers`` first, and ``spawn_worker`` then hands the jobs to those, so their
imports overlap the wait instead of following it (``preload``: what a process started ahead of its
job imports while it waits, a rank's or the engine process's own).

Invariants: a waiting process is given one job at most, and only if it was started with the
environment the job asks for (the OpenMP variables are read once, when it imports torch);
otherwise it is killed, as are those no job was given (``end_waiting_workers``); one left when this
process exits dies with it (``die_with_parent``). This module imports no torch: an engine process
starts its ranks before it imports the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import servelm
from servelm.model.threads import openmp_environment

if TYPE_CHECKING:
    from servelm.workers.messages import WorkerInit


def preload(modules: Iterable[str]) -> None:
    """Import ``modules`` now, in a process started ahead of its job, so their seconds of CPU overlap
    the wait. One that fails to import is skipped: it fails again where the job imports it, and is
    reported there."""
    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def worker_environment(omp_wait_policy: str) -> dict[str, str]:
    """The environment a rank process runs with: this process's, the OpenMP wait policy (read once,
    when the rank imports torch) and this servelm on its path."""
    package_root = str(Path(servelm.__file__).resolve().parents[1])
    env = dict(os.environ)
    env.update(openmp_environment(omp_wait_policy))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def _start_rank_process(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A ``servelm.workers.worker`` process: it imports its job's modules, then reads its job."""
    return subprocess.Popen([sys.executable, "-m", "servelm.workers.worker"], stdin=subprocess.PIPE, env=env)


_waiting: list[tuple[subprocess.Popen[bytes], dict[str, str]]] = []
"""Rank processes started before this process had their jobs (``start_waiting_workers``), with
their environments, oldest first. Each is given one job by ``spawn_worker`` or killed (it holds
nothing but its imports); one left when this process exits dies with it (``die_with_parent``)."""


def start_waiting_workers(count: int, omp_wait_policy: str) -> None:
    """Start ``count`` rank processes now, before their jobs exist: each imports torch and the
    runner (seconds of CPU) while this process waits for its own job, instead of after it, on the
    start-up's path. ``spawn_worker`` gives them their jobs."""
    env = worker_environment(omp_wait_policy)
    _waiting.extend((_start_rank_process(env), env) for _ in range(count))


def end_waiting_workers() -> None:
    """Kill the waiting rank processes no job was given (they may be importing for seconds still)."""
    while _waiting:
        _end(_waiting.pop(0)[0])


def _end(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    assert process.stdin is not None
    process.stdin.close()


def spawn_worker(init: WorkerInit) -> subprocess.Popen[bytes]:
    """A rank process (``servelm.workers.worker``) with ``init`` on its stdin: a waiting one
    started with the same environment, else a new one."""
    env = worker_environment(init.config.runtime.omp_wait_policy)
    process = None
    while _waiting and process is None:
        candidate, its_env = _waiting.pop(0)
        if candidate.poll() is None and its_env == env:
            process = candidate
        else:   # started for another environment (or died importing): no job for it
            _end(candidate)
    if process is None:
        process = _start_rank_process(env)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(init))
    process.stdin.close()
    return process
