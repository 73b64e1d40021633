"""Grammar compilation off the engine step: worker threads, a time budget and a result cache.

The engine submits a request's (kind, spec) and keeps stepping; the request waits in the queue
(the scheduler skips it) until its ``CompileJob`` is done, then gets a matcher. vLLM and SGLang
do the same with a thread pool: xgrammar and llguidance release the GIL while they compile, so a
compile costs the decode loop a core, never the loop itself.

Invariants:
- Every spec passes ``check_spec`` (size budget, satisfiability) before the backend sees it; that
  check, the compile and the backend's creation (2.5 s for xgrammar, up to 8 s for llguidance
  under load) all run on a worker: the engine thread never parses or compiles a spec.
- A job that runs longer than ``timeout_s`` fails (a GrammarError naming
  --grammar-compile-timeout), and so does every later request for the same spec: failures are
  cached like results. A thread cannot be stopped, so the compile itself runs on to its end in
  the background (the spec budget keeps that to seconds); its thread is written off and a new
  worker takes its place, so the queue behind it keeps moving. At most ``MAX_ABANDONED_WORKERS``
  are written off at a time: past that, compiles wait for a worker.
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

from servelm.constrained.grammar import GrammarBackend, GrammarError, GrammarMatcher
from servelm.constrained.spec_check import check_spec

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
                 max_spec_bytes: int, num_workers: int = 1, max_entries: int = 256) -> None:
        self.timeout_s = timeout_s
        """0 means no limit (--grammar-compile-timeout)."""
        self.max_spec_bytes = max_spec_bytes
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._jobs: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: queue.Queue[CompileJob] = queue.Queue()
        self._backend: GrammarBackend | None = None
        self._backend_error: str | None = None
        self._backend_ready = threading.Event()
        self._make_backend = make_backend
        self._lock = threading.Lock()
        self._num_abandoned = 0
        self._num_threads = 0
        for index in range(num_workers):
            self._start_worker(creates_backend=index == 0)

    def _start_worker(self, creates_backend: bool = False) -> None:
        self._num_threads += 1
        threading.Thread(target=self._work, name=f"grammar-compile-{self._num_threads}", daemon=True,
                         args=(creates_backend,)).start()

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
        if not job.done.is_set() and self.timeout_s > 0 and job.started_s is not None \
                and time.monotonic() - job.started_s > self.timeout_s:
            logger.warning("grammar compile exceeded %.1f s (%s spec of %d bytes): refused",
                           self.timeout_s, job.kind, len(job.spec))
            job.fail(f"the grammar took longer than {self.timeout_s:g} s to compile "
                     "(--grammar-compile-timeout); simplify it or raise the limit")
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
        while True:
            job = self._queue.get()
            if job.done.is_set():
                continue
            job.is_running = True
            self._compile(job)
            with self._lock:
                job.is_running = False
                if job.is_abandoned:  # replaced while it compiled: leave the pool its size
                    self._num_abandoned -= 1
                    return

    def _check_can_start(self, compiled: Any) -> None:
        """Refuse a grammar no token of this vocabulary can start (an empty language such as
        the regex ``[^\\x00-\\U0010FFFF]``): without this, sampling under an all-zero mask picks a
        token the grammar then rejects, a server error in the middle of the request."""
        assert self._backend is not None
        probe = self._backend.make_matcher(compiled)
        if probe.is_terminated():
            return
        bitmask = self._backend.allocate_bitmask(1)
        probe.fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise GrammarError("the grammar matches no text: no token of this model's vocabulary "
                               "can start it")

    def _compile(self, job: CompileJob) -> None:
        if self._backend_error is not None:
            job.fail(self._backend_error)
            return
        assert self._backend is not None
        job.started_s = time.monotonic()
        try:
            check_spec(job.kind, job.spec, self.max_spec_bytes)
            compiled = self._backend.compile(job.kind, job.spec)
            self._check_can_start(compiled)
        except GrammarError as error:
            job.fail(str(error))
            return
        except (MemoryError, RecursionError, RuntimeError, ValueError) as error:
            job.fail(f"the grammar failed to compile: {type(error).__name__}: {error}")
            return
        if not job.done.is_set():  # not already failed by the time budget
            job.compiled = compiled
            job.done.set()
