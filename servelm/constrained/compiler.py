"""Grammar compilation off the engine step: worker threads, a time budget and a result cache.

The engine submits a request's (kind, spec) and keeps stepping; the request waits in the queue
(the scheduler skips it) until its ``CompileJob`` is done, then gets a matcher. vLLM and SGLang
do the same with a thread pool: xgrammar and llguidance release the GIL while they compile, so a
compile costs the decode loop a core, never the loop itself.

Invariants:
- Every spec passes ``check_spec`` (size budget, satisfiability) before the backend sees it; that
  check, the compile and the backend's creation (2.5 s for xgrammar, up to 8 s for llguidance
  under load) all run on a worker: the engine thread never parses or compiles a spec.
- With a ``BackendRecipe`` (the engine's default), each worker first has the spec compiled in
  its own child process (``compile_process``) within ``timeout_s``: past it the child is killed,
  so a timed-out compile stops using a core and its memory at the deadline, and the job fails (a
  GrammarError naming --grammar-compile-timeout). Only a spec the child compiled in time is
  compiled in this process, and only the backend's compile runs here: the size budget,
  satisfiability and can-start checks the child passed are not repeated. So a spec costs one
  compile in the child and one here (the compiled grammar cannot cross the process boundary:
  xgrammar's JSON form of a 300-property schema is 20 MB and 1.3 s to write against a 0.04 s
  compile, llguidance has none), and each distinct spec is compiled once per engine (``_jobs``).
- Without one (--disable-grammar-compile-process), a job that runs longer than ``timeout_s``
  fails the same way, but a thread cannot be stopped: the compile runs on to its end in the
  background (the spec budget keeps that to seconds); its thread is written off and a new
  worker takes its place, so the queue behind it keeps moving. At most
  ``MAX_ABANDONED_WORKERS`` are written off at a time: past that, compiles wait for a worker.
- Failures are cached like results: a later request for the same spec fails at once.
- Workers are daemon threads: a compile still running never holds up the engine's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from servelm.constrained.compile_process import (IDLE_S, BackendRecipe, CompileProcess,
                                                 CompileTimeout, compile_checked)
from servelm.constrained.grammar import GrammarBackend, GrammarError, GrammarMatcher

logger = logging.getLogger(__name__)

MAX_ABANDONED_WORKERS = 2
"""Timed-out compiles left running on their own threads at once (each may hold a core until it
ends); more timeouts than this leave the pool short until one ends."""


class CompileJob:
    """One (kind, spec) compile, shared by every request that asks for the same spec."""

    __slots__ = ("kind", "spec", "started_s", "compiled", "error", "done", "is_running",
                 "is_abandoned")

    def __init__(self, kind: str, spec: str) -> None:
        self.kind = kind
        self.spec = spec
        self.started_s: float | None = None
        """When a worker began compiling (None while queued): the time budget runs from here."""
        self.compiled: Any = None
        self.error: str | None = None
        self.done = threading.Event()
        """Set once ``compiled`` or ``error`` is final."""
        self.is_running = False
        """A worker is compiling it (changed under the compiler's lock once it ends)."""
        self.is_abandoned = False
        """Timed out while compiling and its worker replaced: that thread exits when it ends."""

    def fail(self, error: str) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class GrammarCompiler:
    """Compiles specs on ``num_workers`` threads and hands out matchers; see the module doc."""

    def __init__(self, make_backend: Callable[[], GrammarBackend | None], timeout_s: float,
                 max_spec_bytes: int, num_workers: int = 1, max_entries: int = 256,
                 recipe: BackendRecipe | None = None) -> None:
        self.recipe = recipe
        """Builds the backend in each worker's compile process; None: compile on threads only."""
        self.timeout_s = timeout_s
        """0 means no limit (--grammar-compile-timeout)."""
        self.max_spec_bytes = max_spec_bytes
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._jobs: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: queue.Queue[CompileJob | None] = queue.Queue()
        """Jobs for the workers; None tells one worker to stop (``close``)."""
        self._backend: GrammarBackend | None = None
        self._backend_error: str | None = None
        self._backend_ready = threading.Event()
        self._make_backend = make_backend
        self._lock = threading.Lock()
        self._num_abandoned = 0
        self._num_threads = 0
        self._threads: list[threading.Thread] = []
        self._processes: list[CompileProcess] = []
        for index in range(num_workers):
            self._start_worker(creates_backend=index == 0)

    def _start_worker(self, creates_backend: bool = False) -> None:
        self._num_threads += 1
        thread = threading.Thread(target=self._work, name=f"grammar-compile-{self._num_threads}",
                                  daemon=True, args=(creates_backend,))
        thread.start()
        self._threads.append(thread)

    @property
    def backend(self) -> GrammarBackend | None:
        """The backend once a worker has created it (the executor masks logits with it)."""
        return self._backend

    def submit(self, kind: str, spec: str) -> CompileJob:
        """The job compiling (kind, spec): cached, in flight or new."""
        key = (kind, spec)
        job = self._jobs.get(key)
        if job is not None:
            self.num_hits += 1
            self._jobs.move_to_end(key)
            return job
        self.num_misses += 1
        job = CompileJob(kind, spec)
        self._jobs[key] = job
        if len(self._jobs) > self.max_entries:
            self._jobs.popitem(last=False)
        self._queue.put(job)
        return job

    def poll(self, job: CompileJob) -> Any | None:
        """The compiled grammar when done, None while compiling; GrammarError when the compile
        failed or ran past the budget."""
        if not job.done.is_set() and self.recipe is None and self.timeout_s > 0 \
                and job.started_s is not None and time.monotonic() - job.started_s > self.timeout_s:
            logger.warning("grammar compile exceeded %.1f s (%s spec of %d bytes): refused",
                           self.timeout_s, job.kind, len(job.spec))
            job.fail(self._timeout_message())
            with self._lock:
                if job.is_running and self._num_abandoned < MAX_ABANDONED_WORKERS:
                    self._num_abandoned += 1
                    job.is_abandoned = True
                    self._start_worker()
        if not job.done.is_set():
            return None
        if job.error is not None:
            raise GrammarError(job.error)
        return job.compiled

    @property
    def num_process_compiles(self) -> int:
        """Specs compiled in the workers' compile processes so far (the budget proofs)."""
        return sum(process.num_checks for process in self._processes)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers and their compile processes (waiting up to ``wait_s`` for a worker
        to finish its current job)."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(wait_s)

    def make_matcher(self, compiled: Any) -> GrammarMatcher:
        assert self._backend is not None, "a job is only done once the backend exists"
        return self._backend.make_matcher(compiled)

    def wait(self, jobs: list[CompileJob], timeout_s: float) -> None:
        """Block up to ``timeout_s`` or until the first of ``jobs`` is done (an idle engine
        waits here instead of spinning while only compiling requests are queued)."""
        if jobs:
            jobs[0].done.wait(timeout_s)

    def _work(self, creates_backend: bool) -> None:
        if creates_backend:
            try:
                self._backend = self._make_backend()
                if self._backend is None:
                    self._backend_error = "structured output is disabled (--grammar-backend none)"
            except Exception as error:  # a config the user can fix: every grammar request says so
                logger.exception("grammar backend could not be created")
                self._backend_error = f"the grammar backend could not be created: {error}"
            self._backend_ready.set()
        self._backend_ready.wait()
        process = CompileProcess(self.recipe, self.max_spec_bytes) if self.recipe else None
        if process is not None:
            with self._lock:
                self._processes.append(process)
        while True:
            try:
                job = self._queue.get(timeout=IDLE_S if process and process.is_running else None)
            except queue.Empty:
                assert process is not None
                process.stop()  # idle: give its memory back until the next compile
                continue
            if job is None:
                if process is not None:
                    process.stop()
                return
            if job.done.is_set():
                continue
            job.is_running = True
            if process is None:
                self._compile(job)
            elif self._check_in_process(job, process):
                self._compile(job, is_checked=True)
            with self._lock:
                job.is_running = False
                if job.is_abandoned:  # replaced while it compiled: leave the pool its size
                    self._num_abandoned -= 1
                    return

    def _timeout_message(self) -> str:
        return (f"the grammar took longer than {self.timeout_s:g} s to compile "
                "(--grammar-compile-timeout); simplify it or raise the limit")

    def _check_in_process(self, job: CompileJob, process: CompileProcess) -> bool:
        """Compile ``job`` in the worker's child within the budget; False (the job failed) when
        it did not compile or ran out of time (the child is then killed)."""
        if self._backend_error is not None:
            job.fail(self._backend_error)
            return False
        try:
            if not process.is_running:
                process.start()  # not counted in the budget
            job.started_s = time.monotonic()
            error = process.check(job.kind, job.spec, self.timeout_s)
        except CompileTimeout:
            logger.warning("grammar compile exceeded %.1f s (%s spec of %d bytes): stopped",
                           self.timeout_s, job.kind, len(job.spec))
            job.fail(self._timeout_message())
            return False
        except Exception as error:  # the worker must live on: every later job would hang
            logger.exception("grammar compile process failed")
            job.fail(f"the grammar could not be compiled: {error}")
            return False
        if error is not None:
            job.fail(error)
            return False
        return not job.done.is_set()

    def _compile(self, job: CompileJob, is_checked: bool = False) -> None:
        """Compile in this process (after the child proved it, when ``is_checked``: the time
        budget was spent there, and this compile takes about as long)."""
        if self._backend_error is not None:
            job.fail(self._backend_error)
            return
        assert self._backend is not None
        if not is_checked:
            job.started_s = time.monotonic()
        try:
            compiled = compile_checked(self._backend, job.kind, job.spec, self.max_spec_bytes,
                                       is_proven=is_checked)
        except GrammarError as error:
            job.fail(str(error))
            return
        if not job.done.is_set():  # not already failed by the time budget
            job.compiled = compiled
            job.done.set()
