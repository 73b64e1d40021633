"""MultiprocExecutor: tensor parallelism on one node or several, behind the engine's Runner protocol.

Layout (``--distributed-executor-backend mp``): rank 0 is a ``ModelRunner`` inside the engine
process (the driver, as vLLM's driver worker and SGLang's TP rank 0 are); ranks 1..N-1 are
``servelm.workers.worker`` processes on this node. Rank 0 in-process saves an IPC hop and a
copy of the logits every step (the sampler reads them where they were computed), and leaves the
tp 1 path untouched: there the engine holds its ModelRunner with no executor at all. The engine
process is a daemonic multiprocessing child, which multiprocessing forbids to have children, so the
ranks are plain subprocesses of the same interpreter; each calls ``die_with_parent`` first.

Each step: the plan (plain lists) is pickled once and pushed to every worker over ZMQ, then rank 0
runs its forward; the ranks meet in the collectives (gloo on CPU, NCCL on CUDA, a ProcessGroup
object over a TCPStore served by rank 0) and rank 0's logits are the step's result.

Several nodes (``--nnodes``): this node runs ranks 0 .. k-1 (k = tp / nnodes) as above; the other
nodes' launchers (``workers/node.py``) start the rest, which take their steps over ZMQ TCP sockets
published in the TCPStore at ``--dist-init-addr`` (``workers/remote.py``). Their all-reduces run on
gloo. A remote rank whose connection drops is as dead as a local rank that exited.
Pipeline parallel (``--pp-size P``, with or without TP): tp x pp ranks; world rank r is
``rank_layout(r)``, so ranks 0..tp-1 are the LAST stage and rank 0 (this process) computes the
logits the engine samples from, with no copy back. Every rank gets every plan; the stages pass
micro-batches' hidden states on point-to-point (servelm.model.pipeline). Each stage's TP ranks
share their own shared-memory all-reduce segment.

Faults: a rank that does not join within ``--dist-timeout``, exits, or fails a collective raises
``RankFailedError`` naming it; the engine then ends every request and exits. A rank that dies while
the engine is idle is noticed by a watcher thread, which ends the engine process (when it is one)
after a short grace period, so the server exits instead of waiting for the next request.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq

from servelm.config import EngineConfig, split_host_port
from servelm.distributed.errors import RankFailedError
from servelm.workers.messages import (
    PROTOCOL_VERSION, DescribeKVHeads, ExecuteStep, ExpertLoadCall, ExpertLoadReply, InitKVCache,
    KVBlocksRead, KVCacheReady, KVHeads, ReadKVBlocks, RemoveLoRA, Reply, SetLoRA, Shutdown, WorkerFailed,
    WorkerHello, WorkerInit, WorkerLoaded, WriteKVBlocks)
from servelm.distributed import shm_allreduce
from servelm.workers.processes import end_waiting_workers, spawn_worker
from servelm.workers.remote import LAYOUT_KEY, NodeLayout, RemoteRanks, bind_host
from servelm.distributed.parallel import ParallelContext, join_groups, rank_layout, ranks_sharing_memory
from servelm.model.expert_load import ExpertLoad, ExpertLoadSnapshot, StagedExpertLoad
from servelm.model.forward_batch import BatchPlan
from servelm.model.loader import resolve_device
from servelm.model.pooling import PoolerConfig
from servelm.model.runner import ModelRunner
from servelm.model.threads import place_rank_threads, rank_cpu_slices, rank_num_threads

logger = logging.getLogger(__name__)

_POLL_MS = 200
_IDLE_DEATH_GRACE_S = 3.0
"""After a rank dies, how long the watcher leaves the step loop to report it before ending the
engine process itself (an idle engine has no step to notice it)."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class MultiprocExecutor:
    """tp x pp ranks on this node; implements servelm.engine.executor.Runner."""

    def __init__(self, config: EngineConfig, source: Any) -> None:
        assert not config.runtime.enable_torch_compile, "EngineConfig refuses torch.compile at tp/pp > 1"
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.timeout_s = config.parallel.dist_timeout
        self.nnodes = config.parallel.nnodes
        self.local_size = self._ranks_on_this_node(config)
        """Ranks on each node: this node runs ranks 0 .. local_size - 1, node n the next ones."""
        self.hf_config = source.hf_config
        """The base model's HF config (the LoRA registry checks adapters against it)."""
        self._workers: dict[int, subprocess.Popen[bytes]] = {}
        self._loaded: dict[int, WorkerLoaded] = {}
        self._pool_blocks: dict[int, int] = {}
        """Each worker's KV pool blocks (the engine's, or its DP-attention partition), once sized."""
        self._hellos: dict[int, WorkerHello] = {}
        self._remote: RemoteRanks | None = None
        """The ranks on other nodes (None: all ranks are on this node)."""
        self._is_closing = False
        self._socket_dir = tempfile.mkdtemp(prefix="servelm-tp-")
        self._zmq = zmq.Context()
        self._replies = self._zmq.socket(zmq.PULL)
        reply_address = f"ipc://{self._socket_dir}/replies"
        self._replies.bind(reply_address)
        self._commands: dict[int, zmq.Socket[Any]] = {}
        device = resolve_device(config.model.device)
        devices = [torch.device(f"cuda:{rank % self.local_size}") if device.type == "cuda" else device
                   for rank in range(self.world_size)]
        slices = rank_cpu_slices(self.local_size) if device.type == "cpu" else None
        cpus = [slices[rank] if slices is not None else None for rank in range(self.local_size)]
        threads = [rank_num_threads(config.runtime.num_threads, cpus[rank], self.local_size)
                   for rank in range(self.local_size)]
        self._threads, self._cpus, self._devices = threads, cpus, devices
        self._own_placement = (os.sched_getaffinity(0), torch.get_num_threads())
        """This process's CPUs and threads before rank 0 was pinned, restored by ``shutdown``."""
        self._shm_path: str | None = None
        """The shared-memory all-reduce segment of rank 0's stage (every stage has its own)."""
        self._stage_shm_paths: dict[int, str] = {}
        """pp rank -> that stage's segment for its tp_size ranks (none at tp 1)."""
        if (self.tp_size > 1 and not config.parallel.disable_custom_all_reduce
                and shm_allreduce.is_supported(device)
                and self.local_size == self.world_size):  # across nodes every all-reduce is gloo's
            self._stage_shm_paths = {stage: shm_allreduce.create_segment(self.tp_size)
                                     for stage in range(self.pp_size)}
            self._shm_path = self._stage_shm_paths[rank_layout(0, self.tp_size, self.pp_size)[1]]
        store_host, store_port = self._rendezvous_address(config)
        store = _serve_store(store_host, store_port, self.world_size, self.timeout_s)
        try:
            if self.local_size < self.world_size:
                self._publish_layout(config, store, store_host, reply_address)
                self._start_remote_ranks(config, store_host, store.port)
            for rank in range(1, self.local_size):
                command_address = f"ipc://{self._socket_dir}/commands-{rank}"
                socket = self._zmq.socket(zmq.PUSH)
                socket.setsockopt(zmq.SNDHWM, 0)
                socket.bind(command_address)
                self._commands[rank] = socket
                self._start_worker(WorkerInit(
                    config=config, rank=rank, world_size=self.world_size, store_host="127.0.0.1",
                    store_port=store.port, command_address=command_address,
                    reply_address=reply_address, cpus=cpus[rank], num_threads=threads[rank],
                    device=str(devices[rank]), parent_pid=os.getpid(),
                    shm_path=self._stage_shm_paths.get(rank_layout(rank, self.tp_size, self.pp_size)[1])))
            end_waiting_workers()  # started for a layout this one did not need
            self._hellos = {reply.rank: reply for reply in self._wait(WorkerHello, "start")}
            place_rank_threads(0, cpus[0], threads[0])
            if devices[0].type == "cuda":
                torch.cuda.set_device(devices[0])
            shm = (shm_allreduce.ShmAllReduce(self._shm_path, 0, self.tp_size, self.timeout_s,
                                              check_peers=self._raise_if_worker_dead)
                   if self._shm_path is not None else None)
            self.parallel: ParallelContext = join_groups(store, 0, self.tp_size, self.pp_size, devices[0],
                                                         self.timeout_s, shm, store_host)
            self.runner = ModelRunner(config, source, parallel=self.parallel, device=devices[0],
                                      defer_kv_cache=True)
            self._loaded = {reply.rank: reply for reply in self._wait(WorkerLoaded, "load its shard")}
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._unlink_segment()  # every rank has mapped it (or failed): no crash can leak it
        self._store = store
        atexit.register(self.shutdown)
        threading.Thread(target=self._watch_workers, name="tp-rank-watch", daemon=True).start()
        logger.info("tensor parallel %d x pipeline parallel %d: %d ranks on this node (rank 0, the "
                    "last stage's, in the engine process, pids %s), %s threads per rank",
                    self.tp_size, self.pp_size, self.local_size,
                    [os.getpid()] + [w.pid for w in self._workers.values()], threads)
        if self.nnodes > 1:
            logger.info("tensor parallel over %d nodes: ranks %s joined from the other nodes",
                        self.nnodes, {rank: f"{hello.host} pid {hello.pid}" for rank, hello in
                                      self._hellos.items() if rank >= self.local_size})

    # -- start-up ---------------------------------------------------------------------------
    def _start_worker(self, init: WorkerInit) -> None:
        self._workers[init.rank] = spawn_worker(init)

    def _wait(self, kind: type, action: str) -> list[Any]:
        """One ``kind`` reply from every worker; RankFailedError when one fails, exits or is late."""
        deadline = time.monotonic() + self.timeout_s
        replies: dict[int, Any] = {}
        while len(replies) < self.world_size - 1:
            if self._replies.poll(_POLL_MS):
                reply: Reply = self._replies.recv_pyobj()
                if isinstance(reply, WorkerFailed):
                    raise RankFailedError(f"{self._rank_name(reply.rank)} failed to {action}: "
                                          f"{reply.error}")
                if isinstance(reply, WorkerHello) and reply.protocol_version != PROTOCOL_VERSION:
                    raise RankFailedError(
                        f"{self._rank_name(reply.rank)} speaks worker protocol "
                        f"{reply.protocol_version}, the engine {PROTOCOL_VERSION}: run the same "
                        "servelm version on every rank")
                assert isinstance(reply, kind), f"expected {kind.__name__}, got {reply!r}"
                replies[reply.rank] = reply
                continue
            for rank, process in self._workers.items():
                if process.poll() is not None and rank not in replies:
                    raise RankFailedError(f"{self._rank_name(rank)} (pid {process.pid}) "
                                          f"{describe_exit(process.returncode)} before it could {action}")
            failed = self._remote_failures(exclude=set(replies))
            if failed:
                raise RankFailedError(f"{failed[0]} before it could {action}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(replies))
                raise RankFailedError(self._missing_ranks_message(missing, action))
        return [replies[rank] for rank in sorted(replies)]

    # -- other nodes ------------------------------------------------------------------------
    executor_name = "mp"

    def _ranks_on_this_node(self, config: EngineConfig) -> int:
        return config.parallel.ranks_per_node

    def _rendezvous_address(self, config: EngineConfig) -> tuple[str, int]:
        """Where rank 0 serves the TCPStore: any loopback port on one node, else --dist-init-addr."""
        if self.nnodes == 1:
            return "127.0.0.1", 0
        return split_host_port(config.parallel.dist_init_addr or "")

    def _start_remote_ranks(self, config: EngineConfig, store_host: str, store_port: int) -> None:
        """Start the ranks off this node: with mp the other nodes' own launchers do (node.py)."""

    def _node_of(self, rank: int) -> int:
        return rank // self.local_size

    def _remote_failures(self, exclude: set[int] | None = None) -> list[str]:
        """What went wrong with the ranks off this node (those in ``exclude`` aside)."""
        if self._remote is None:
            return []
        return [f"{self._describe_remote(rank)} disconnected" for rank in self._remote.gone()
                if rank not in (exclude or set())]

    def _publish_layout(self, config: EngineConfig, store: Any, host: str, reply_address: str) -> None:
        """Bind the remote ranks' command sockets and a TCP reply endpoint on ``host``, and publish
        them in the store, where the other nodes' ``servelm.workers.node`` reads them."""
        host_ip = bind_host(host)
        self._replies.bind(f"tcp://{host_ip}:*")
        self._remote = RemoteRanks(self._zmq, host_ip, list(range(self.local_size, self.world_size)))
        self._commands.update(self._remote.sockets)
        store.set(LAYOUT_KEY, NodeLayout(
            protocol_version=PROTOCOL_VERSION, model=config.model.model,
            tensor_parallel_size=self.world_size, nnodes=self.nnodes,
            reply_address=self._replies.getsockopt_string(zmq.LAST_ENDPOINT),
            command_addresses=self._remote.addresses()).to_json())

    def _describe_remote(self, rank: int) -> str:
        hello = self._hellos.get(rank)
        where = f", pid {hello.pid} on {hello.host}" if hello is not None else ""
        return f"node {self._node_of(rank)} (tensor-parallel rank {rank}{where})"

    def _missing_ranks_message(self, missing: list[int], action: str) -> str:
        local = [rank for rank in missing if rank < self.local_size]
        if local:
            return (f"tensor-parallel ranks {local} did not {action} within --dist-timeout "
                    f"{self.timeout_s:g} s")
        nodes = sorted({self._node_of(rank) for rank in missing})
        return (f"node(s) {nodes} (tensor-parallel ranks {missing}) did not {action} within "
                f"--dist-timeout {self.timeout_s:g} s: run the same command with --node-rank "
                f"{nodes[0]} there, able to reach --dist-init-addr")

    # -- the Runner protocol ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def task(self) -> str:
        return self.runner.task

    @property
    def pooler(self) -> PoolerConfig | None:
        return self.runner.pooler

    @property
    def expert_load(self) -> ExpertLoad | StagedExpertLoad | None:
        """The MoE routing counts: rank 0's (its routing is the whole batch's under TP), with the
        other pipeline stages' asked from their ranks under --pp-size > 1."""
        own = self.runner.expert_load
        if own is None or self.pp_size == 1:
            return own
        return StagedExpertLoad(own, self._ask_expert_load)

    def _ask_expert_load(self, action: str) -> list[ExpertLoadSnapshot]:
        """Send ``action`` to every rank; the other stages' leaders' snapshots, first stage first."""
        self._broadcast(ExpertLoadCall(action))
        replies = self._wait(ExpertLoadReply, f"answer the expert load call {action!r}")
        leaders = sorted((reply for reply in replies if reply.snapshot is not None), key=lambda reply: reply.pp_rank)
        return [reply.snapshot for reply in leaders]

    @property
    def hidden_size(self) -> int:
        return self.runner.hidden_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def kv_pool_layout(self) -> dict[str, Any]:
        """Rank 0's pool layout (every rank's is the same): /get_server_info's ``kv_pool``."""
        return self.runner.kv_pool_layout()

    def rank_kv_capacity_blocks(self) -> list[int]:
        own = self.runner.kv_capacity_blocks(ranks_sharing_memory(self.local_size, self.runner.device))
        return [own] + [self._loaded[rank].kv_capacity_blocks for rank in sorted(self._loaded)]

    def init_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks))
        self.runner.init_kv_cache(num_blocks)
        ready = self._wait(KVCacheReady, "allocate its KV pool")
        self._pool_blocks = {reply.rank: reply.pool_blocks for reply in ready}

    def execute(self, plan: BatchPlan) -> torch.Tensor:
        self._broadcast(ExecuteStep(plan))
        try:
            return self.runner.execute(plan)
        except Exception as error:
            raise self._step_failure(error) from error

    def pool(self, plan: BatchPlan) -> torch.Tensor:
        self._broadcast(ExecuteStep(plan, is_pool=True))
        try:
            return self.runner.pool(plan)
        except Exception as error:
            raise self._step_failure(error) from error

    def set_lora(self, slot: int, entries: Any) -> None:
        """Install an adapter on every rank (each keeps its partition); before the next step,
        since commands are handled in order."""
        entries = list(entries)
        self.runner.set_lora(slot, entries)  # rank 0 first: a bad adapter fails here, not on a worker
        self._broadcast(SetLoRA(slot, [(layer, attr, shard, a.cpu(), b.cpu(), scale)
                                       for layer, attr, shard, a, b, scale in entries]))

    def remove_lora(self, slot: int) -> None:
        self._broadcast(RemoveLoRA(slot))
        self.runner.remove_lora(slot)

    def transfer_pool(self) -> Any:
        """Every KV head of this server's pool, for prefill/decode disaggregation: a
        ``kv_shards.ShardedKV`` over the ranks (the transfer's view of the pool)."""
        from servelm.workers.kv_shards import ShardedKV, kv_head_range

        if self.pp_size > 1:
            raise ValueError("--disaggregation-mode cannot be combined with --pp-size > 1")
        kv_head_range(self.runner)  # a model the transfer cannot split fails here, not on a worker
        self._broadcast(DescribeKVHeads())
        replies = self._wait(KVHeads, "report its KV heads")
        return ShardedKV(self, [(reply.start, reply.size) for reply in replies])

    def read_kv_blocks(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Ranks 1..N-1's K and V of ``block_ids`` (each its own heads), rank order."""
        self._broadcast(ReadKVBlocks(block_ids))
        replies = self._wait(KVBlocksRead, "read K/V blocks")
        return [(torch.from_numpy(reply.k), torch.from_numpy(reply.v)) for reply in replies]

    def write_kv_blocks(self, block_ids: list[int], num_kv_heads: int, k: torch.Tensor,
                        v: torch.Tensor) -> None:
        """Ranks 1..N-1 store their heads of ``k`` and ``v`` (every KV head) at ``block_ids``
        before the next step."""
        self._broadcast(WriteKVBlocks(block_ids, num_kv_heads, k=k.numpy(), v=v.numpy()))

    def layout(self) -> dict[str, Any]:
        ranks = [{"rank": 0, "node": 0, "host": os.uname().nodename, "pid": os.getpid(),
                  "tp_rank": self.parallel.tp_rank, "pp_rank": self.parallel.pp_rank,
                  "device": str(self.runner.device), "num_kv_heads": self.runner.num_kv_heads,
                  "num_threads": self._threads[0], "cpus": self._cpus[0],
                  "kv_pool_blocks": self.runner.kv_cache.num_blocks if self.runner.kv_cache is not None else 0}]
        for rank, loaded in sorted(self._loaded.items()):
            hello = self._hellos[rank]
            ranks.append({"rank": rank, "node": self._node_of(rank), "host": hello.host,
                          "pid": hello.pid,
                          "tp_rank": rank_layout(rank, self.tp_size, self.pp_size)[0],
                          "pp_rank": rank_layout(rank, self.tp_size, self.pp_size)[1],
                          "device": str(self._devices[rank]),
                          "num_kv_heads": loaded.num_kv_heads, "num_threads": loaded.num_threads,
                          "cpus": loaded.cpus, "kv_pool_blocks": self._pool_blocks.get(rank, 0)})
        all_reduce = ("shared memory (up to 4 MiB), else gloo" if self._shm_path
                      else self.parallel.group.name() if self.parallel.group is not None else "none")
        return {**self.runner.parallel.describe(), "executor": self.executor_name, "nnodes": self.nnodes,
                "ranks_per_node": self.local_size, "all_reduce": all_reduce, "ranks": ranks}

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and release the sockets; idempotent."""
        if self._is_closing:
            return
        self._is_closing = True
        for socket in self._commands.values():
            try:
                socket.send_pyobj(Shutdown(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5
        for process in self._workers.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._remote is not None:  # no process to wait for: give Shutdown a moment to leave
            self._remote.close(linger_ms=1000)
        for command_socket in [*self._commands.values(), self._replies]:
            command_socket.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._unlink_segment()
        os.sched_setaffinity(0, self._own_placement[0])
        torch.set_num_threads(self._own_placement[1])

    def _unlink_segment(self) -> None:
        for path in self._stage_shm_paths.values():
            shm_allreduce.unlink_segment(path, self.tp_size)

    # -- faults -----------------------------------------------------------------------------
    def _broadcast(self, command: Any) -> None:
        self._raise_if_worker_dead()
        data = pickle.dumps(command)
        for socket in self._commands.values():
            socket.send(data)

    def _dead_workers(self) -> list[str]:
        dead = [f"{self._rank_name(rank)} (pid {process.pid}) {describe_exit(process.returncode)}"
                for rank, process in self._workers.items() if process.poll() is not None]
        return dead + self._remote_failures()

    def _raise_if_worker_dead(self) -> None:
        dead = self._dead_workers()
        if dead:
            raise RankFailedError("; ".join(dead))

    def _step_failure(self, error: Exception) -> RankFailedError:
        """Why rank 0's step failed: a worker's own report, a dead worker, or rank 0 itself. Any of
        them leaves the ranks' collectives out of step, so every one is fatal."""
        deadline = time.monotonic() + 2  # a killed peer resets the connection before it is reaped
        while time.monotonic() < deadline:
            if self._replies.poll(50):
                reply = self._replies.recv_pyobj()
                if isinstance(reply, WorkerFailed):
                    return RankFailedError(f"{self._rank_name(reply.rank)} failed: {reply.error}")
            dead = self._dead_workers()
            if dead:
                return RankFailedError("; ".join(dead))
        return RankFailedError(f"tensor-parallel rank 0 failed during a step: "
                               f"{type(error).__name__}: {error}")

    def _rank_name(self, rank: int) -> str:
        """How errors name a rank: "tensor-parallel rank 1", or with pipeline stages
        "pipeline stage 0 (rank 1, tp rank 0)"."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {rank}"
        tp_rank, pp_rank = rank_layout(rank, self.tp_size, self.pp_size)
        return f"pipeline stage {pp_rank} (rank {rank}, tp rank {tp_rank})"

    def _watch_workers(self) -> None:
        while not self._is_closing:
            dead = self._dead_workers()
            if dead:
                logger.error("%s; the engine cannot run without it", "; ".join(dead))
                if multiprocessing.parent_process() is None:
                    return  # an in-process engine (tests): its next step raises
                time.sleep(_IDLE_DEATH_GRACE_S)
                if not self._is_closing:
                    logger.error("engine process exiting: a rank (%s) is gone", "; ".join(dead))
                    os._exit(1)
                return
            time.sleep(0.5)


def _serve_store(host: str, port: int, world_size: int, timeout_s: float) -> Any:
    """The rendezvous TCPStore rank 0 serves (port 0: any free port, on one node)."""
    try:
        return dist.TCPStore(host, port, world_size, True, wait_for_workers=False,  # type: ignore[attr-defined]
                             timeout=_timedelta(timeout_s))
    except RuntimeError as error:  # the port is taken, or the host is not ours
        raise RankFailedError(f"cannot serve the rendezvous at {host}:{port} (--dist-init-addr): "
                              f"{error}".splitlines()[0]) from error


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)
