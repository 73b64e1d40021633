"""Child processes die with their parent.

Every process servelm starts (the engine process, worker and rank processes) calls
``die_with_parent`` first thing, so killing the front end (even with SIGKILL, which runs no
cleanup) never leaves an engine holding its KV pool, or a rank waiting in a collective.

Invariant: after ``die_with_parent(expected_parent_pid)`` returns, the calling process is killed
within ``poll_s`` of its parent going away, by the kernel's parent-death signal where Linux offers
it (immediate) and by a daemon thread watching the parent pid everywhere (covers other systems and
the race where the parent died before the signal was armed).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def _arm_parent_death_signal() -> bool:
    """Linux: ask the kernel to SIGKILL us when the parent exits. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while True:
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(poll_s)


def die_with_parent(parent_pid: int | None = None, poll_s: float = 1.0) -> None:
    """Arrange for this process to be killed when its parent exits.

    ``parent_pid``: the pid of the process that started us, read by the parent before it started
    the child (passing it closes the race where the parent is already gone and we were re-parented
    before this call); default ``os.getppid()``.
    """
    expected = os.getppid() if parent_pid is None else parent_pid
    _arm_parent_death_signal()
    if os.getppid() != expected:  # the parent went before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(expected, poll_s), name="parent-watch",
                     daemon=True).start()


def limit_address_space(extra_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra_bytes`` (a sandboxed
    child: a grammar or template that allocates without bound gets a MemoryError, not the
    machine's memory). Linux only; elsewhere the caller's time budget still holds."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (current + extra_bytes, resource.RLIM_INFINITY))
    except (ImportError, OSError, ValueError):
        pass
