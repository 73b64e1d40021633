"""Rank workers and the executors that drive them (above model/, below engine/).

A worker owns one rank's shard of the weights and its KV cache and executes the plans it is sent;
an executor presents a group of them to the engine as one ``Runner``.
"""

from __future__ import annotations

from typing import Any

from servelm.config import EngineConfig


def start_executor(config: EngineConfig, source: Any) -> Any:
    """The executor for ``--tp-size > 1``: rank processes (mp, on this node and the other
    ``--nnodes``), or Ray actors (``--distributed-executor-backend ray``)."""
    if config.parallel.distributed_executor_backend == "ray":
        from servelm.workers.ray_executor import RayExecutor

        return RayExecutor(config, source)
    from servelm.workers.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source)
