"""A rank process (ranks 1..N-1 of tp x pp; rank 0 runs inside the engine process).

``python -m servelm.workers.worker`` with a pickled ``WorkerInit`` on stdin. It dies with the
engine process, imports what its job needs (``PRELOADED``: the job may come seconds later, see
``workers.processes``), pins its threads, says hello (protocol version), joins the process group,
loads its shard of the weights (a ``ModelRunner`` over its ``ParallelContext``), reports its KV capacity,
allocates the pool the engine chose, then executes every step the engine sends, in order, until
``Shutdown``. It never sees a Request, only BatchPlans. Any error is reported as ``WorkerFailed``
and ends the process: its peers' collectives then fail at once, and the engine reports it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from typing import Any

from servelm.distributed.lifetime import die_with_parent
from servelm.workers.processes import preload

logger = logging.getLogger("servelm.workers.worker")

PRELOADED = ("zmq", "torch.distributed", "servelm.workers.messages", "servelm.workers.kv_shards",
             "servelm.distributed.parallel", "servelm.distributed.shm_allreduce", "servelm.model.runner",
             "servelm.model.source", "servelm.model.threads", "transformers.activations")
"""What ``serve`` imports (and the model load after it: transformers builds the model's config),
imported by ``main`` before it reads the job: a rank process started before its job exists
(``processes.start_waiting_workers``) spends these seconds of CPU while it waits, not on the
start-up's path after the job arrives."""


def main() -> None:
    parent_pid = os.getppid()
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the engine decides when its ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    preload(PRELOADED)
    try:
        init = pickle.load(sys.stdin.buffer)
    except EOFError:  # started ahead of a job that never came (the start failed or needed fewer ranks)
        return
    import multiprocessing

    multiprocessing.current_process().name = f"servelm-tp-rank-{init.rank}"  # the log lines' name
    sys.exit(run_rank(init))


def run_rank(init: Any) -> int:
    """Connect to the engine's sockets and serve until Shutdown (0) or an error (1, reported as
    ``WorkerFailed``). A rank process runs it after its set-up; a Ray actor runs it as a method."""
    import zmq

    from servelm.workers.messages import WorkerFailed, WorkerInit

    assert isinstance(init, WorkerInit)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(init.command_address)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(init.reply_address)
    try:
        serve(init, commands, replies)
    except Exception:
        error = traceback.format_exc()
        logger.error("rank %d failed:\n%s", init.rank, error)
        replies.send_pyobj(WorkerFailed(init.rank, error.strip().splitlines()[-1]))
        replies.close(linger=2000)
        return 1
    commands.close(linger=0)
    replies.close(linger=1000)
    context.term()
    return 0


def serve(init: Any, commands: Any, replies: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from servelm.workers import kv_shards
    from servelm.workers.messages import (
        PROTOCOL_VERSION, DescribeKVHeads, ExecuteStep, ExpertLoadCall, ExpertLoadReply, InitKVCache,
        KVCacheReady, ReadKVBlocks, RemoveLoRA, SetLoRA, Shutdown, WorkerHello, WorkerLoaded, WriteKVBlocks)
    from servelm.distributed.parallel import join_groups, rank_layout, ranks_sharing_memory
    from servelm.distributed.shm_allreduce import ShmAllReduce
    from servelm.logging_utils import configure_logging
    from servelm.model.runner import ModelRunner
    from servelm.model.source import resolve_model_source
    from servelm.model.threads import log_openmp_wait_policy, place_rank_threads

    config = init.config
    configure_logging(config.server.log_level)
    place_rank_threads(init.rank, init.cpus, init.num_threads)
    log_openmp_wait_policy(config.runtime.omp_wait_policy)
    replies.send_pyobj(WorkerHello(init.rank, os.getpid(), PROTOCOL_VERSION, os.uname().nodename))
    timeout_s = config.parallel.dist_timeout
    store = dist.TCPStore(init.store_host, init.store_port, init.world_size, False,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device(init.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp_size, pp_size = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    tp_rank, _ = rank_layout(init.rank, tp_size, pp_size)
    shm = (ShmAllReduce(init.shm_path, tp_rank, tp_size, timeout_s)  # this stage's TP ranks'
           if init.shm_path is not None else None)
    parallel = join_groups(store, init.rank, tp_size, pp_size, device, timeout_s, shm, init.store_host)
    runner = ModelRunner(config, resolve_model_source(config.model), parallel=parallel, device=device,
                         defer_kv_cache=True)
    capacity = runner.kv_capacity_blocks(ranks_sharing_memory(config.parallel.ranks_per_node, device))
    replies.send_pyobj(WorkerLoaded(init.rank, capacity, runner.num_kv_heads, init.num_threads, init.cpus))
    while True:
        command = commands.recv_pyobj()
        if isinstance(command, ExecuteStep):
            if command.is_pool:
                runner.pool(command.plan)
            else:
                runner.execute(command.plan)
        elif isinstance(command, InitKVCache):
            runner.init_kv_cache(command.num_blocks)
            assert runner.kv_cache is not None
            replies.send_pyobj(KVCacheReady(init.rank, runner.kv_cache.num_blocks))
        elif isinstance(command, SetLoRA):
            runner.set_lora(command.slot, command.entries)
        elif isinstance(command, RemoveLoRA):
            runner.remove_lora(command.slot)
        elif isinstance(command, (DescribeKVHeads, ReadKVBlocks, WriteKVBlocks)):
            reply = kv_shards.serve_command(init.rank, runner, command)
            if reply is not None:
                replies.send_pyobj(reply)
        elif isinstance(command, ExpertLoadCall):
            load = runner.expert_load
            snapshot = load.control(command.action) if load is not None else None
            replies.send_pyobj(ExpertLoadReply(init.rank, parallel.pp_rank,
                                               snapshot if parallel.tp_rank == 0 else None))
        elif isinstance(command, Shutdown):
            return
        else:
            raise AssertionError(f"unknown command {type(command).__name__}")


if __name__ == "__main__":
    main()
