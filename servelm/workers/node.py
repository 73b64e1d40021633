"""A node other than node 0 of a multi-node server (``--nnodes N --node-rank R``, R > 0).

``servelm serve`` there serves no HTTP and holds no engine. It waits (at most ``--dist-timeout``)
for node 0's rendezvous at ``--dist-init-addr``, reads the ``NodeLayout`` node 0 published in it,
checks that it matches its own command line (protocol version, model, sizes), starts its
``--tp-size / --nnodes`` rank processes (global ranks R*k .. R*k + k - 1, each pinned to its own
slice of this node's CPUs, as on node 0) and supervises them. The ranks run the same
``servelm.workers.worker`` loop as node 0's own, over TCP instead of ipc.

Lifetime: it exits 0 once its ranks have exited after node 0's ``Shutdown``, and 1 when a rank
fails, when node 0's rendezvous closes (node 0 stopped or died: its ranks would otherwise wait for
steps forever) or when node 0 cannot be reached in time. Its ranks die with it (``die_with_parent``).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import time
from typing import Any

import torch
import torch.distributed as dist

from servelm.config import EngineConfig, split_host_port
from servelm.workers.messages import PROTOCOL_VERSION, WorkerInit
from servelm.workers.multiproc import describe_exit
from servelm.workers.processes import spawn_worker
from servelm.workers.remote import LAYOUT_KEY, NodeLayout

logger = logging.getLogger(__name__)

_WATCH_S = 0.5
_STORE_CHECK_TIMEOUT_S = 5.0
_SHUTDOWN_GRACE_S = 3.0
"""After node 0's rendezvous closes, how long the ranks have to finish on node 0's Shutdown."""


class NodeError(RuntimeError):
    """This node cannot serve its ranks (node 0 unreachable or mismatched); the message says why."""


def run_node(config: EngineConfig) -> int:
    """Join node 0, run this node's ranks until node 0 goes; returns the exit status."""
    parallel = config.parallel
    address = parallel.dist_init_addr or ""
    host, port = split_host_port(address)
    node = parallel.node_rank
    logger.info("node %d of %d: waiting up to %g s for node 0 at %s", node, parallel.nnodes,
                parallel.dist_timeout, address)
    # (its rank processes start once node 0 has published the layout: started while it waits, they
    # cost ~6 s of CPU each on a node that never joins, measured on 2 cores, for ~3 s less start-up)
    store, layout = _join_node_0(config)
    check_layout(layout, config)
    workers = start_ranks(config, layout, host, port)
    logger.info("node %d: ranks %s started (pids %s)", node, sorted(workers),
                [process.pid for process in workers.values()])
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return supervise(workers, store, address, node)
    except KeyboardInterrupt:
        logger.info("node %d: stopping its ranks", node)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process in workers.values():
            if process.poll() is None:
                process.kill()
            process.wait()


def _join_node_0(config: EngineConfig) -> tuple[Any, NodeLayout]:
    """Node 0's rendezvous store and the layout it published there; NodeError after --dist-timeout."""
    parallel = config.parallel
    address = parallel.dist_init_addr or ""
    host, port = split_host_port(address)
    try:
        deadline = time.monotonic() + parallel.dist_timeout
        _wait_for_listener(host, port, deadline)
        store = dist.TCPStore(host, port, None, False,  # type: ignore[attr-defined]
                              timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
        return store, NodeLayout.from_json(store.get(LAYOUT_KEY))
    except RuntimeError as error:
        raise NodeError(f"node {parallel.node_rank}: node 0's rendezvous at {address} did not answer "
                        f"within --dist-timeout {parallel.dist_timeout:g} s ({_first_line(error)})") from error


PROBE_INTERVAL_S = 0.2


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Until node 0's store accepts connections (RuntimeError at ``deadline``). torch's TCPStore
    client retries with a growing, jittered back-off, so a node started well before node 0 could
    sleep through a node 0 that lives only seconds (a short --dist-timeout, a layout it must
    refuse); a plain TCP probe every PROBE_INTERVAL_S does not."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"nothing listens at {host}:{port} ({error})") from error
            time.sleep(PROBE_INTERVAL_S)


def check_layout(layout: NodeLayout, config: EngineConfig) -> None:
    """NodeError when node 0 runs something this node would not (each node must run one command)."""
    node = config.parallel.node_rank
    if layout.protocol_version != PROTOCOL_VERSION:
        raise NodeError(f"node {node}: node 0 speaks worker protocol {layout.protocol_version}, this "
                        f"node {PROTOCOL_VERSION}: install the same servelm version on every node")
    ours = (config.model.model, config.parallel.tensor_parallel_size, config.parallel.nnodes)
    theirs = (layout.model, layout.tensor_parallel_size, layout.nnodes)
    if ours != theirs:
        raise NodeError(f"node {node}: node 0 serves (model, --tp-size, --nnodes) = {theirs}, this "
                        f"node was started with {ours}: run the same command on every node")


def start_ranks(config: EngineConfig, layout: NodeLayout, host: str,
                port: int) -> dict[int, subprocess.Popen[bytes]]:
    """This node's rank processes, one per slice of its CPUs."""
    from servelm.model.loader import resolve_device
    from servelm.model.threads import rank_cpu_slices, rank_num_threads

    parallel = config.parallel
    local_size = parallel.ranks_per_node
    device = resolve_device(config.model.device)
    slices = rank_cpu_slices(local_size) if device.type == "cpu" else None
    workers: dict[int, subprocess.Popen[bytes]] = {}
    for local_rank in range(local_size):
        rank = parallel.node_rank * local_size + local_rank
        cpus = slices[local_rank] if slices is not None else None
        rank_device = torch.device(f"cuda:{local_rank}") if device.type == "cuda" else device
        workers[rank] = spawn_worker(WorkerInit(
            config=config, rank=rank, world_size=parallel.tensor_parallel_size, store_host=host,
            store_port=port, command_address=layout.command_addresses[str(rank)],
            reply_address=layout.reply_address, cpus=cpus,
            num_threads=rank_num_threads(config.runtime.num_threads, cpus, local_size),
            device=str(rank_device), parent_pid=os.getpid(), shm_path=None))
    return workers


def supervise(workers: dict[int, subprocess.Popen[bytes]], store: Any, address: str, node: int) -> int:
    """Wait until the ranks finish (0) or fail, or node 0 goes (1)."""
    store.set_timeout(datetime.timedelta(seconds=_STORE_CHECK_TIMEOUT_S))
    while True:
        for rank, process in workers.items():
            if process.poll() is None:
                continue
            if process.returncode == 0:  # node 0 said Shutdown: the others follow
                return 0 if _all_exit(workers, _SHUTDOWN_GRACE_S) else 1
            logger.error("node %d: tensor-parallel rank %d (pid %d) %s; stopping this node", node,
                         rank, process.pid, describe_exit(process.returncode))
            return 1
        try:
            store.check([LAYOUT_KEY])
        except RuntimeError:
            if _all_exit(workers, _SHUTDOWN_GRACE_S):
                logger.info("node %d: node 0 shut down; its ranks exited", node)
                return 0
            logger.error("node %d: node 0 (%s) is gone; stopping this node's ranks", node, address)
            return 1
        time.sleep(_WATCH_S)


def _all_exit(workers: dict[int, subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """Whether every rank exits with status 0 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for process in workers.values():
        try:
            if process.wait(max(0.0, deadline - time.monotonic())) != 0:
                return False
        except subprocess.TimeoutExpired:
            return False
    return True


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
