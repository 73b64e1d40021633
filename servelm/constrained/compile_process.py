"""A killable process that proves a grammar compiles within its time budget.

A thread cannot be stopped: a compile that runs past ``--grammar-compile-timeout`` would keep a
core busy (and its memory growing) until it ended on its own. So each compile worker of
``compiler.GrammarCompiler`` first has the whole expensive part (the backend's compile and the
can-start probe) done in a child process it owns; at the deadline that process is killed, which
stops the work at once. Only a spec the child compiled in time is then compiled again in the
engine process, where its result is needed (neither backend's compiled grammar crosses a process
boundary cheaply: xgrammar's JSON form of a 300-property schema on Qwen's 152k vocabulary is
20 MB and 1.3 s to write against a 0.04 s compile, 1 GB and 73 s at 2000 properties;
llguidance's matcher has none; the compile's cost is the grammar's structure, not the
vocabulary, so no cheaper proof exists either), so that second compile is bounded by the first.
The engine runs only the backend's build and compile (``compile_checked(is_proven=True)``,
``compile(is_checked=True)``): the spec checks, the finiteness walk (which took longer than
xgrammar's compile for a few hundred properties) and the can-start probe happened here.
``benchmarks/grammar_compile.py`` measures each part.

Invariants:
- The child is a fresh interpreter (``python -m servelm.constrained.compile_process``, never a
  fork of the threaded engine; a plain subprocess, because the engine is a daemonic
  multiprocessing child, which may not start multiprocessing children). It calls
  ``die_with_parent`` first, talks over a socketpair ``Connection``, and runs under an address-space limit (``MEMORY_BYTES`` beyond its imports), so a grammar that
  allocates without bound fails there with a 400, not in the engine.
- Start-up (imports, the backend's tokenizer tables) is not counted in a spec's budget.
- The child exits when its worker has had nothing to compile for ``IDLE_S`` (it holds a few
  hundred MB: torch, the backend, its tables) and starts again on the next compile.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from servelm.constrained.grammar import GrammarBackend, GrammarError, make_backend
from servelm.constrained.spec_check import check_spec

logger = logging.getLogger(__name__)

MEMORY_BYTES = 2 << 30
"""Address space a compile process may add beyond its imports (a real 3k-property schema needs
tens of MB)."""
IDLE_S = 120.0
"""A compile process with nothing to do for this long exits (started again when needed)."""
START_TIMEOUT_S = 300.0
"""Longest start of a compile process (imports and tokenizer tables on a loaded machine)."""


@dataclass(frozen=True)
class BackendRecipe:
    """What a compile process needs to build the engine's grammar backend (picklable)."""

    name: str
    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]
    whitespace_pattern: str | None

    def create(self) -> GrammarBackend | None:
        return make_backend(self.name, self.tokenizer, self.vocab_size, self.stop_token_ids,
                            self.whitespace_pattern)


def check_can_start(backend: GrammarBackend, compiled: Any) -> None:
    """Refuse a grammar no token of this vocabulary can start (an empty language such as the
    regex ``[^\\x00-\\U0010FFFF]``): without this, sampling under an all-zero mask picks a token
    the grammar then rejects, a server error in the middle of the request."""
    probe = backend.make_matcher(compiled)
    if probe.is_terminated():
        return
    bitmask = backend.allocate_bitmask(1)
    probe.fill_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError("the grammar matches no text: no token of this model's vocabulary "
                           "can start it")


def compile_checked(backend: GrammarBackend, kind: str, spec: str, max_spec_bytes: int,
                    is_proven: bool = False) -> Any:
    """The spec budget, the backend's compile and the can-start probe; GrammarError names what
    failed (a backend's own exception included). ``is_proven``: a compile process already ran
    all three on this spec, so only the compile itself runs here."""
    try:
        if not is_proven:
            check_spec(kind, spec, max_spec_bytes)
        compiled = backend.compile(kind, spec, is_checked=is_proven)
        if not is_proven:
            check_can_start(backend, compiled)
    except GrammarError:
        raise
    except (MemoryError, RecursionError, RuntimeError, ValueError) as error:
        raise GrammarError(f"the grammar failed to compile: {type(error).__name__}: {error}") from None
    return compiled


def _process_main(parent_pid: int, fd: int) -> None:
    from servelm.distributed.lifetime import die_with_parent, limit_address_space

    die_with_parent(parent_pid)
    connection = Connection(fd)
    recipe, max_spec_bytes = connection.recv()
    try:
        backend = recipe.create()
        assert backend is not None, "no compile process without a backend"
    except Exception as error:
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    limit_address_space(MEMORY_BYTES)
    connection.send(("ready", None))
    while True:
        try:
            kind, spec = connection.recv()
        except EOFError:
            return
        try:
            compile_checked(backend, kind, spec, max_spec_bytes)
            connection.send(("ok", None))
        except GrammarError as error:
            connection.send(("error", str(error)))


class CompileTimeout(Exception):
    """The child ran past the budget and was killed."""


class CompileProcess:
    """One child proving specs compile, one at a time; owned by one compile worker thread (the
    parent-death signal follows the thread that started the child, which lives as long as the
    compiler)."""

    def __init__(self, recipe: BackendRecipe, max_spec_bytes: int) -> None:
        self.recipe = recipe
        self.max_spec_bytes = max_spec_bytes
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self.num_checks = 0
        """Specs sent to a child (each one compile there)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the child and wait until it can compile; RuntimeError when it cannot start."""
        import servelm

        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        package_root = str(Path(servelm.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "servelm.constrained.compile_process", str(os.getpid()),
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._connection = connection = Connection(ours.detach())
        try:
            connection.send((self.recipe, self.max_spec_bytes))
            status, detail = (connection.recv() if connection.poll(START_TIMEOUT_S)
                              else ("failed", "timed out"))
        except (EOFError, OSError):
            status, detail = "failed", "it exited"
        if status != "ready":
            self.stop()
            raise RuntimeError(f"the grammar compile process did not start: {detail}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None

    def check(self, kind: str, spec: str, timeout_s: float) -> str | None:
        """Compile (kind, spec) in the child: None when it compiles, else the 400's message.
        Past ``timeout_s`` (0: no limit) the child is killed and CompileTimeout raised."""
        if not self.is_running:
            self.stop()
            self.start()
        connection = self._connection
        assert connection is not None
        connection.send((kind, spec))
        self.num_checks += 1
        if not connection.poll(timeout_s if timeout_s > 0 else None):
            self.stop()
            raise CompileTimeout
        try:
            status, message = connection.recv()
        except (EOFError, OSError):  # killed: the memory limit (std::bad_alloc aborts) or a signal
            self.stop()
            return "the grammar failed to compile: its compile used more memory than allowed"
        return None if status == "ok" else str(message)


if __name__ == "__main__":
    _process_main(int(sys.argv[1]), int(sys.argv[2]))
