"""RayExecutor: tensor-parallel ranks as Ray actors (``--distributed-executor-backend ray``).

As in vLLM, Ray only places and starts the workers; the ranks still meet in torch.distributed
collectives (gloo on CPU, NCCL on CUDA) and receive their steps over ZMQ, exactly as the ranks of
another node do with ``--nnodes`` (``MultiprocExecutor``'s remote path: the same ``NodeLayout``
sockets, the same worker loop, ``worker.run_rank``). Rank 0 stays in the engine process, the Ray
driver; ranks 1..N-1 are actors in one placement group (a bundle of ``--num-threads`` CPUs, plus
a GPU on CUDA, per rank; PACK: on as few Ray nodes as fit), which may span the cluster's nodes.

The engine joins an existing cluster (``ray start --head``, then ``ray start --address`` on other
machines; ``ray.init(address="auto")``, which also honours Ray's own RAY_ADDRESS) and never starts
one. Faults: an actor that dies is seen both by its ZMQ connection dropping and by its ``run``
call ending; either fails the engine as a dead local rank does. The actors are owned by the engine
process, so Ray ends them when it exits, however it exits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import zmq

import servelm
from servelm.config import EngineConfig
from servelm.distributed.errors import RankFailedError
from servelm.model.loader import resolve_device
from servelm.model.threads import default_num_threads, openmp_environment
from servelm.workers.messages import WorkerInit
from servelm.workers.multiproc import MultiprocExecutor

logger = logging.getLogger(__name__)

RAY_MISSING = ("--distributed-executor-backend ray needs the ray package, which is not installed: "
               "pip install 'servelm[ray]' (or use the default mp backend)")


def import_ray() -> Any:
    """The ray module, or ValueError saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(RAY_MISSING) from error
    return ray


class RankActor:
    """One tensor-parallel rank inside a Ray worker process (wrapped with ``ray.remote``)."""

    def run(self, init: WorkerInit) -> int:
        """Serve steps until Shutdown (0) or failure (1); see ``servelm.workers.worker``."""
        from servelm.workers.worker import run_rank

        return run_rank(init)


class RayExecutor(MultiprocExecutor):
    """Ranks 1..N-1 as Ray actors; rank 0 in the engine process (the Ray driver)."""

    executor_name = "ray"

    def __init__(self, config: EngineConfig, source: Any) -> None:
        self._ray = import_ray()
        self._runs: dict[int, Any] = {}
        """Rank -> the ObjectRef of its actor's ``run`` call (ready: the rank has ended)."""
        self._actors: list[Any] = []
        self._placement_group: Any = None
        if not self._ray.is_initialized():
            try:
                self._ray.init(address="auto", log_to_driver=True, logging_level=logging.WARNING)
            except ConnectionError as error:
                raise ValueError(f"--distributed-executor-backend ray: no running Ray cluster to "
                                 f"join (start one with `ray start --head`): {error}") from error
        super().__init__(config, source)

    def _ranks_on_this_node(self, config: EngineConfig) -> int:
        return 1  # only rank 0: Ray places the others

    def _rendezvous_address(self, config: EngineConfig) -> tuple[str, int]:
        return self._ray.util.get_node_ip_address(), 0

    def _node_of(self, rank: int) -> int:
        """Hosts numbered in order of appearance: the engine's first, then the ranks'."""
        hello = self._hellos.get(rank)
        if hello is None:
            return -1
        hosts = [os.uname().nodename] + [other.host for _, other in sorted(self._hellos.items())]
        return list(dict.fromkeys(hosts)).index(hello.host)

    def _describe_remote(self, rank: int) -> str:
        hello = self._hellos.get(rank)
        where = f", pid {hello.pid} on {hello.host}" if hello is not None else ""
        return f"tensor-parallel rank {rank} (Ray actor{where})"

    def _missing_ranks_message(self, missing: list[int], action: str) -> str:
        return (f"tensor-parallel ranks {missing} (Ray actors) did not {action} within "
                f"--dist-timeout {self.timeout_s:g} s")

    def _start_remote_ranks(self, config: EngineConfig, store_host: str, store_port: int) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self._remote is not None
        ray = self._ray
        num_actors = self.world_size - 1
        num_threads = config.runtime.num_threads or max(1, default_num_threads() // self.world_size)
        is_cuda = resolve_device(config.model.device).type == "cuda"
        bundle = {"CPU": float(num_threads), **({"GPU": 1.0} if is_cuda else {})}
        self._placement_group = placement_group([bundle] * num_actors, strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=self.timeout_s)
        if not ready:
            raise RankFailedError(
                f"the Ray cluster has no room for {num_actors} tensor-parallel ranks of {bundle} "
                f"each (a placement group) within --dist-timeout {self.timeout_s:g} s; "
                f"its resources: {ray.available_resources()}")
        package_root = str(Path(servelm.__file__).resolve().parents[1])
        actor_class = ray.remote(RankActor)
        addresses = self._remote.addresses()
        reply_address = self._replies.getsockopt_string(zmq.LAST_ENDPOINT)
        for rank in range(1, self.world_size):
            actor = actor_class.options(
                num_cpus=num_threads, num_gpus=1 if is_cuda else 0,
                name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank - 1),
                runtime_env={"env_vars": {"PYTHONPATH": package_root,
                                          **openmp_environment(config.runtime.omp_wait_policy)}}).remote()
            self._actors.append(actor)
            self._runs[rank] = actor.run.remote(WorkerInit(
                config=config, rank=rank, world_size=self.world_size, store_host=store_host,
                store_port=store_port, command_address=addresses[str(rank)],
                reply_address=reply_address, cpus=None, num_threads=num_threads,
                device="cuda:0" if is_cuda else "cpu", parent_pid=0, shm_path=None))
        logger.info("Ray: %d tensor-parallel ranks placed as actors (%s each)", num_actors, bundle)

    def _remote_failures(self, exclude: set[int] | None = None) -> list[str]:
        """Actors whose ``run`` ended (Ray says why), then those whose connection dropped."""
        if self._remote is None or not self._runs or self._is_closing:
            return []
        exclude = exclude or set()
        done, _ = self._ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=0)
        ended = [rank for rank, run in self._runs.items() if run in done and rank not in exclude]
        return ([f"{self._describe_remote(rank)} ended: {self._outcome(self._runs[rank])}"
                 for rank in ended] +
                [f"{self._describe_remote(rank)} disconnected" for rank in self._remote.gone()
                 if rank not in exclude and rank not in ended])

    def _outcome(self, run: Any) -> str:
        try:
            return f"exit status {self._ray.get(run, timeout=1)}"
        except Exception as error:  # the actor died: Ray says how
            return str(error).strip().splitlines()[0]

    def layout(self) -> dict[str, Any]:
        return {**super().layout(), "ray_actors": len(self._actors)}

    def shutdown(self) -> None:
        if self._is_closing:
            return
        super().shutdown()
        ray = self._ray
        if self._runs:
            ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=5)
        for actor in self._actors:
            ray.kill(actor)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
