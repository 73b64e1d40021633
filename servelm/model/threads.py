"""Thread placement: how many threads the model uses, and keeping the HTTP front end light.

Invariants:
- The engine process sets torch's intra-op threads once, before the model is built, to
  ``--num-threads`` or to the physical cores it may run on (``default_num_threads``); inter-op
  threads are 1 (servelm runs one op at a time, so a second pool only competes for the cores).
- The front-end process (HTTP, tokenization, detokenization of streamed text) uses one torch thread
  and one tokenizer thread: its work is small per request, and every thread it spins up takes a
  core away from the forward pass. The tokenizer's pool is sized by the environment variables the
  ``tokenizers`` library reads (``RAYON_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``); a value the
  user already set is kept.

Why physical cores: OpenMP parallel regions end with a barrier, so one thread that lost its core
to another process stalls the whole op (measured on the 2-core dev box: with a busy loop on the
other core, small ops slowed down 30-60x). Hyper-threads share one core's FMA units and add no
GEMM throughput, so counting them only adds threads that wait.

Tensor-parallel ranks on one node never share a core: the node's CPUs are cut into one disjoint
slice per rank (``rank_cpu_slices``), each rank pins itself to its slice and runs ``--num-threads``
threads (per rank; default the physical cores of its slice). An all-reduce waits for the slowest
rank, so one rank losing its core to another would stall them all.
"""

from __future__ import annotations

import logging
import os
import time

import psutil

logger = logging.getLogger(__name__)

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""Units of /proc/stat's counters (ThreadGovernor)."""


def available_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_core() -> int:
    """Hardware threads per physical core (2 with SMT, else 1)."""
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    return max(1, logical // physical)


def default_num_threads() -> int:
    """Physical cores available to this process: affinity CPUs / hardware threads per core."""
    return max(1, available_cpus() // threads_per_core())


def set_torch_threads(num_threads: int) -> None:
    """``num_threads`` intra-op threads and one inter-op thread for this process."""
    import torch  # here, not at the top: the CLI uses this module before torch is loaded

    torch.set_num_threads(num_threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # fixed for good once the process ran inter-op work (in-process use)
            pass


def configure_engine_threads(num_threads: int | None) -> int:
    """Set torch's threads for the engine process and log the choice; returns the thread count."""
    chosen = num_threads if num_threads is not None else default_num_threads()
    set_torch_threads(chosen)
    import torch

    reason = "--num-threads" if num_threads is not None else (
        f"physical cores available to the process ({available_cpus()} CPUs in its affinity)")
    logger.info("torch uses %d threads (%s), %d inter-op", torch.get_num_threads(), reason,
                torch.get_num_interop_threads())
    return chosen


class ThreadGovernor:
    """Fewer torch threads while other processes keep cores of this process's CPUs busy, and back
    to ``max_threads`` when they stop (the default with more than one thread; off with
    ``--disable-adaptive-threads``).

    Every ``interval_s`` (between steps, so never inside an op) it reads the CPUs' busy time from
    ``/proc/stat`` (steal included: a hypervisor taking the core is another process too) and
    subtracts this process's own CPU time: what is left is the work of others on these CPUs, in
    cores. Each core others keep busy (``>= 0.4`` of it: a core shared half and half with a busy
    loop counts, the HTTP front end's small share does not) is one thread fewer, at least 1. A
    change needs two readings in a row that agree. Why: an OpenMP op ends in a barrier, so a thread
    that lost its core to another process stalls every op; measured on the 2-core dev box, a
    2-thread decode kept 22-32% of its quiet speed beside one busy core, while 1 thread runs at
    full speed there (benchmarks/busy_core.py). Linux only (``supported``)."""

    @staticmethod
    def supported() -> bool:
        """Whether this OS gives the per-CPU busy times and the affinity mask it reads."""
        return hasattr(os, "sched_getaffinity") and os.path.exists("/proc/stat")

    def __init__(self, max_threads: int, interval_s: float = 1.0, busy_core_fraction: float = 0.4,
                 cpus: list[int] | None = None) -> None:
        self.max_threads = max_threads
        self.current = max_threads
        self.interval_s = interval_s
        self.busy_core_fraction = busy_core_fraction
        self.cpus = cpus if cpus is not None else sorted(os.sched_getaffinity(0))
        self.physical_cores = max(1, len(self.cpus) // threads_per_core())
        self._process = psutil.Process()
        self._last = self.sample()
        self._pending: int | None = None

    def sample(self) -> tuple[float, float, float]:
        """(monotonic s, busy CPU-seconds of ``cpus`` since boot, this process's CPU-seconds)."""
        busy_ticks = 0
        wanted = {f"cpu{index}" for index in self.cpus}
        with open("/proc/stat") as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in wanted:
                    # user nice system idle iowait irq softirq steal ...
                    values = [int(value) for value in fields[1:9]]
                    busy_ticks += sum(values) - values[3] - values[4]
        own = self._process.cpu_times()
        return time.monotonic(), busy_ticks / _TICKS_PER_S, own.user + own.system

    def others_cores(self, previous: tuple[float, float, float], now: tuple[float, float, float],
                     slack_ticks: int = 0) -> float:
        """Cores other processes kept busy between two ``sample``s; ``slack_ticks`` of the counters'
        ticks forgiven (each counter rounds to a tick, 10 ms: over a window of a few ticks the reading
        is mostly that rounding; a route-table cell's window is 6-30 ms where a step's is 1 s)."""
        elapsed = now[0] - previous[0]
        if elapsed <= 0:
            return 0.0
        excess = (now[1] - previous[1]) - (now[2] - previous[2]) - slack_ticks / _TICKS_PER_S
        return max(0.0, excess) / elapsed

    def target(self, others: float) -> int:
        busy_cores = int(others + (1.0 - self.busy_core_fraction))
        return max(1, min(self.max_threads, self.physical_cores - busy_cores))

    def step(self) -> int:
        """Call between steps; returns the thread count in force."""
        now = time.monotonic()
        if now - self._last[0] < self.interval_s:
            return self.current
        sample = self.sample()
        others = self.others_cores(self._last, sample)
        self._last = sample
        wanted = self.target(others)
        if wanted == self.current:
            self._pending = None
        elif self._pending != wanted:
            self._pending = wanted          # one reading: wait for a second that agrees
        else:
            logger.info("torch threads %d -> %d: other processes use %.1f of this process's %d "
                        "cores (--disable-adaptive-threads keeps them fixed)", self.current, wanted,
                        others, self.physical_cores)
            import torch

            torch.set_num_threads(wanted)
            self.current, self._pending = wanted, None
        return self.current


OMP_WAIT_POLICY = "OMP_WAIT_POLICY"


def openmp_environment(policy: str) -> dict[str, str]:
    """The variables a process servelm starts needs for ``--omp-wait-policy``: OpenMP reads them
    once, when torch loads. A value the user exported wins; ``default`` sets nothing."""
    if policy == "default":
        return {}
    return {OMP_WAIT_POLICY: os.environ.get(OMP_WAIT_POLICY, policy.upper())}


def export_openmp_wait_policy(policy: str) -> str | None:
    """Put ``openmp_environment(policy)`` into this process's environment, so that the engine
    processes started after this call inherit it (a process that already imported torch keeps
    its own). Returns the value the children will see (None: the runtime's default)."""
    os.environ.update(openmp_environment(policy))
    return os.environ.get(OMP_WAIT_POLICY)


def log_openmp_wait_policy(policy: str) -> None:
    """Log the wait policy this (engine or rank) process runs with, and say so when it is not the
    configured one (an in-process engine, or a user's OMP_WAIT_POLICY)."""
    actual = os.environ.get(OMP_WAIT_POLICY)
    wanted = None if policy == "default" else policy.upper()
    if actual is not None and actual.upper() == wanted or actual is None and wanted is None:
        logger.info("OpenMP threads wait %s (--omp-wait-policy %s)",
                    "as the runtime decides" if actual is None else actual.lower(), policy)
    else:
        logger.warning("OpenMP threads wait %s, not %s as --omp-wait-policy says: %s",
                       actual.lower() if actual else "as the runtime decides", policy,
                       "OMP_WAIT_POLICY was exported by the user" if actual is not None else
                       "this process loaded its OpenMP runtime before the setting was made "
                       "(in-process engine); export OMP_WAIT_POLICY before starting python")


def export_front_end_environment() -> None:
    """The tokenizer library's one-thread settings, into this process's environment (the engine
    processes started after this call inherit them too); a value the user set is kept."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def configure_front_end_threads() -> None:
    """One torch thread and one tokenizer thread for the HTTP process (call before any tokenizing)."""
    import torch

    export_front_end_environment()
    torch.set_num_threads(1)


def rank_cpu_slices(num_ranks: int) -> list[list[int]] | None:
    """This node's CPUs (this process's affinity) cut into ``num_ranks`` disjoint equal slices, in
    order; None when there are fewer CPUs than ranks (then no rank is pinned)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no pinning
        return None
    if len(cpus) < num_ranks:
        return None
    per_rank = len(cpus) // num_ranks
    return [cpus[rank * per_rank:(rank + 1) * per_rank] for rank in range(num_ranks)]


def rank_num_threads(num_threads: int | None, cpus: list[int] | None, num_ranks: int) -> int:
    """A rank's threads: ``--num-threads`` (per rank), else the physical cores of its slice (or of
    the node divided among its ranks when it is not pinned)."""
    if num_threads is not None:
        return num_threads
    if cpus is not None:
        return max(1, len(cpus) // threads_per_core())
    return max(1, default_num_threads() // num_ranks)


def place_rank_threads(rank: int, cpus: list[int] | None, num_threads: int) -> None:
    """Pin this process to its CPU slice and set torch's threads (a tensor-parallel rank)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    set_torch_threads(num_threads)
    logger.info("rank %d: torch uses %d threads, pinned to CPUs %s", rank, num_threads,
                cpus if cpus is not None else "(not pinned: fewer CPUs than ranks)")
