"""The messages between the engine (rank 0, the driver) and its rank workers: one dataclass each.

Transport: the engine writes ``WorkerInit`` to a worker's stdin once (on another node, that node's
``servelm.workers.node`` does); after that, commands go down a ZMQ PUSH socket per worker and
replies come back on one shared PULL socket (ipc on this node, TCP from other nodes), each message
pickled whole. Activations never travel here (only through torch.distributed collectives); the one
exception is ``SetLoRA``, which carries an adapter's small A/B matrices once per load.

Invariants:
- A worker's first reply is ``WorkerHello``; the engine refuses a worker whose
  ``protocol_version`` differs from its own (a mismatched install is a clear error, not a hang).
- Commands are handled in order. Per step a worker receives one ``ExecuteStep`` and replies nothing
  (rank 0's results are the step's results); a worker that fails sends ``WorkerFailed`` and exits.
- Bump ``PROTOCOL_VERSION`` whenever a message changes shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.config import EngineConfig
from servelm.model.forward_batch import BatchPlan

PROTOCOL_VERSION = 5


@dataclass(frozen=True)
class WorkerInit:
    """Everything a rank process needs to start (written to its stdin)."""

    config: EngineConfig
    rank: int
    world_size: int
    store_host: str
    store_port: int
    """The TCPStore rank 0 serves for the torch.distributed rendezvous."""
    command_address: str
    """ZMQ address this worker pulls its commands from."""
    reply_address: str
    """ZMQ address every worker pushes its replies to."""
    cpus: list[int] | None
    """CPUs this rank is pinned to (None: not pinned, the node has fewer CPUs than ranks)."""
    num_threads: int
    """torch intra-op threads of this rank."""
    device: str
    """torch device of this rank (cpu, or cuda:<rank>)."""
    parent_pid: int
    """The engine process; the worker dies with it."""
    shm_path: str | None
    """The shared-memory all-reduce segment to map (None: all-reduce on the process group)."""


@dataclass(frozen=True)
class WorkerHello:
    """First reply: the worker started and speaks this protocol."""

    rank: int
    pid: int
    protocol_version: int
    host: str = ""
    """The worker's host name (for the layout in /get_server_info)."""


@dataclass(frozen=True)
class WorkerLoaded:
    """The worker joined the process group and loaded its shard."""

    rank: int
    kv_capacity_blocks: int
    """Blocks this rank's KV pool could hold; the engine takes the minimum over the ranks."""
    num_kv_heads: int
    num_threads: int
    cpus: list[int] | None


@dataclass(frozen=True)
class InitKVCache:
    """Allocate the KV pool with the size the engine chose."""

    num_blocks: int


@dataclass(frozen=True)
class KVCacheReady:
    rank: int
    pool_blocks: int = 0
    """Blocks the rank's pool holds: the engine's count, or under DP attention its partition."""


@dataclass(frozen=True)
class ExecuteStep:
    """Run one forward pass over ``plan`` (``pool``: the embedding forward instead)."""

    plan: BatchPlan
    is_pool: bool = False


@dataclass(frozen=True)
class SetLoRA:
    """Install adapter ``slot``: (layer, linear attribute, shard id, A, B, scale) per target, the
    whole matrices (each rank keeps its partition, as ``ModelRunner.set_lora`` does)."""

    slot: int
    entries: list[tuple[int, str, int | str | None, Any, Any, float]]


@dataclass(frozen=True)
class RemoveLoRA:
    """Drop adapter ``slot``'s deltas."""

    slot: int


@dataclass(frozen=True)
class DescribeKVHeads:
    """Reply with the KV heads this rank's pool holds (``KVHeads``): for a disaggregated server,
    whose transfers carry every KV head."""


@dataclass(frozen=True)
class KVHeads:
    rank: int
    start: int
    """This rank's first KV head (an index into the model's KV heads)."""
    size: int
    """KV heads it holds (replicated heads: the same range on several ranks)."""


@dataclass(frozen=True)
class ReadKVBlocks:
    """Reply with this rank's K and V of ``block_ids`` (``KVBlocksRead``), for a prefill
    server's transfer (between steps: commands are handled in order)."""

    block_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class _KVBlockArrays:
    """K and V of some blocks, each a ``[num_layers, len(block_ids), bytes_per_block]`` uint8
    numpy array; keyword-only, so they follow each message's own fields."""

    k: Any
    v: Any


@dataclass(frozen=True)
class KVBlocksRead(_KVBlockArrays):
    """The reply to ``ReadKVBlocks``: ``k`` and ``v`` hold this rank's heads."""

    rank: int


@dataclass(frozen=True)
class WriteKVBlocks(_KVBlockArrays):
    """Store this rank's heads of transferred K/V at ``block_ids`` (a decode server; before the
    next step, since commands are handled in order). No reply. ``k`` and ``v`` hold every KV head."""

    block_ids: list[int]
    num_kv_heads: int
    """KV heads in ``k`` and ``v``: every head of the model; the rank keeps its own."""


@dataclass(frozen=True)
class ExpertLoadCall:
    """Under --pp-size > 1: apply a recorder ``action`` (start, stop) to this rank's expert load, or
    report it (snapshot; dump: with the recorded passes). Every rank replies ``ExpertLoadReply``
    (between steps: commands are handled in order, so every stage starts and stops on the same pass)."""

    action: str


@dataclass(frozen=True)
class ExpertLoadReply:
    rank: int
    pp_rank: int
    snapshot: Any
    """A stage leader's (tp rank 0's) ``ExpertLoadSnapshot`` for snapshot and dump; None otherwise."""


@dataclass(frozen=True)
class Shutdown:
    """Exit the command loop."""


@dataclass(frozen=True)
class WorkerFailed:
    """The worker raised; it exits after sending this."""

    rank: int
    error: str


Command = (InitKVCache | ExecuteStep | SetLoRA | RemoveLoRA | DescribeKVHeads | ReadKVBlocks
           | WriteKVBlocks | ExpertLoadCall | Shutdown)
Reply = WorkerHello | WorkerLoaded | KVCacheReady | KVHeads | KVBlocksRead | ExpertLoadReply | WorkerFailed
