"""ParallelContext: this process's place in the model's parallel layout, and its collectives.

One object per rank, built once and passed down to every layer constructor (never a module
constant). ``ParallelContext.single()`` is the one-process layout: every collective is a no-op and
every shard is the whole tensor, so a tp=1 model runs exactly the code it ran before TP existed.

Invariants:
- ``split(size)`` partitions ``range(size)`` into ``tp_size`` contiguous ranges that differ in length
  by at most one (the first ``size % tp_size`` ranks hold one more); rank r holds range r.
- ``head_shard(num_heads, num_kv_heads)``: a rank holds whole GQA groups. With at least as many KV
  heads as ranks the KV heads are split (unevenly when they do not divide: SmolLM2's 3 KV heads on
  2 ranks are 2 + 1, its 9 query heads 6 + 3); with fewer KV heads than ranks each KV head is
  replicated on ``tp_size / num_kv_heads`` ranks, which split its query group (Gemma 3 270M: one KV
  head, on every rank). A rank's query heads always attend to its own KV heads only.
- Collectives run on ``group`` (a torch.distributed ProcessGroup object: gloo on CPU, NCCL on CUDA),
  except all-reduces that fit the shared-memory all-reduce of a CPU host (``shm_all_reduce``);
  every rank calls the same collectives in the same order.
- Pipeline parallel: ``layer_range(num_layers)`` gives stage ``pp_rank`` a contiguous range of the
  decoder layers (the same split rule as ``split``: the first stages hold one more). Stage 0 embeds,
  the last stage norms and computes logits. Activations move stage s -> s + 1 between ranks of
  the same ``tp_rank`` over ``pp_group`` (point-to-point; group rank = pp_rank). World rank
  ``r`` is ``rank_layout(r)``: ranks ``0 .. tp-1`` are the LAST stage, so world rank 0 (the
  engine process, which samples) holds the logits and the first stage is the furthest from it.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Shard:
    """A contiguous range ``start .. start + size`` of some dimension."""

    start: int
    size: int


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes."""

    q: Shard
    """Query heads (indices into the model's query heads)."""
    kv: Shard
    """KV heads (indices into the model's KV heads); replicated ranks share the same range."""


def even_split(size: int, parts: int, index: int) -> Shard:
    """Part ``index`` of ``range(size)`` cut into ``parts`` contiguous parts whose lengths differ by
    at most one (the first ``size % parts`` hold one more)."""
    base, extra = divmod(size, parts)
    return Shard(index * base + min(index, extra), base + (1 if index < extra else 0))


@dataclass(frozen=True)
class ParallelContext:
    """Ranks, sizes and the process groups of one rank (data parallel replicas are whole engines)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    """The tensor-parallel ProcessGroup (None when tp_size is 1)."""
    shm_all_reduce: Any = field(default=None, compare=False, repr=False)
    """A ShmAllReduce over the ranks of this host (None: all-reduce on ``group``)."""
    pp_group: Any = field(default=None, compare=False, repr=False)
    """The pipeline ProcessGroup of this tp rank's stages, group rank = pp_rank (None at pp 1)."""
    ep_size: int = 1
    """Expert-parallel degree: 1 (every rank holds a slice of every expert), tp_size (each rank
    holds whole experts; MoE layers exchange tokens over ``group``) or a divisor of tp_size between
    (groups of tp / ep ranks each hold a group of experts, split by their intermediate columns)."""
    num_redundant_experts: int = 0
    """Extra expert slots per MoE layer (replicas of the busiest experts, --ep-num-redundant-experts)."""
    expert_ranks: Any = field(default=None, compare=False, repr=False)
    """DP attention (--enable-dp-attention): the context of a model whose layers are whole on this
    rank (tp 1) but whose routed experts are expert-parallel over ``expert_ranks`` (a
    ParallelContext of every rank, ep = tp), each rank bringing its own tokens. None: no DP attention."""

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, f"tp rank {self.tp_rank} outside [0, {self.tp_size})"
        assert 0 <= self.pp_rank < self.pp_size, f"pp rank {self.pp_rank} outside [0, {self.pp_size})"
        assert self.tp_size == 1 or self.group is not None, "tp_size > 1 needs a process group"
        assert self.pp_size == 1 or self.pp_group is not None, "pp_size > 1 needs a process group"
        assert self.tp_size % self.ep_size == 0, f"ep size {self.ep_size} does not divide tp size {self.tp_size}"

    @classmethod
    def single(cls) -> ParallelContext:
        """One process runs the whole model."""
        return cls()

    @property
    def is_driver(self) -> bool:
        """This rank returns the step's results to the engine (tp rank 0 of the last stage)."""
        return self.tp_rank == 0 and self.is_last_stage

    @property
    def is_first_stage(self) -> bool:
        """This stage embeds the input ids."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This stage applies the final norm and the LM head."""
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this pipeline stage holds (contiguous; the first stages hold one
        more when ``pp_size`` does not divide ``num_layers``). ValueError if a stage would be empty."""
        if num_layers < self.pp_size:
            raise ValueError(f"--pipeline-parallel-size {self.pp_size} exceeds the model's "
                             f"{num_layers} layers: every stage needs at least one")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    # -- partitions -------------------------------------------------------------------------
    def split(self, size: int, rank: int | None = None) -> Shard:
        """This rank's (or tp rank ``rank``'s) part of ``size`` (contiguous; sizes differ by at most
        one across ranks)."""
        return even_split(size, self.tp_size, self.tp_rank if rank is None else rank)

    def padded_split(self, size: int) -> Shard:
        """This rank's part of ``size`` rounded up to a multiple of tp_size (equal parts, so they
        can be all-gathered); the last ranks' parts may reach past ``size`` (padding)."""
        part = -(-size // self.tp_size)
        return Shard(self.tp_rank * part, part)

    def head_shard(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's query and KV heads (see the module invariants). ValueError when the heads
        cannot be split across ``tp_size`` ranks."""
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.tp_size:
            kv = self.split(num_kv_heads)
            return HeadShard(Shard(kv.start * group, kv.size * group), kv)
        replicas = self.tp_size // num_kv_heads
        if self.tp_size % num_kv_heads or group % replicas:
            raise ValueError(
                f"--tp-size {self.tp_size} cannot split {num_heads} query heads over {num_kv_heads} KV "
                f"heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                f"({num_kv_heads}) and each KV head's {group} query heads must divide among its "
                f"{replicas} ranks")
        kv_index = self.tp_rank // replicas
        per_rank = group // replicas
        q_start = kv_index * group + (self.tp_rank % replicas) * per_rank
        return HeadShard(Shard(q_start, per_rank), Shard(kv_index, 1))

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the tensor-parallel ranks, in place; returns it."""
        if self.tp_size == 1:
            return tensor
        if self.shm_all_reduce is not None and self.shm_all_reduce.fits(tensor):
            return self.shm_all_reduce.all_reduce(tensor)
        self.group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (equal shapes) along the last dimension."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        self.group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Every rank's ``split(num_rows)`` rows of ``tensor`` (``[rows, ...]``) concatenated in rank
        order: the ``num_rows`` rows whole. The parts travel padded to equal length."""
        return self.all_gather_counted(tensor, [self.split(num_rows, rank).size for rank in range(self.tp_size)])

    def all_gather_counted(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``tensor`` (rank r's has ``counts[r]`` rows, known to every rank)
        concatenated in rank order; the parts travel padded to the longest (nothing travels when
        every count is 0)."""
        if self.tp_size == 1 or not any(counts):
            return tensor
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)]
        self.group.allgather([parts], [padded]).wait()
        return torch.cat([whole[:count] for count, whole in zip(counts, parts)])

    def all_to_all_rows(self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send rows ``sum(send_counts[:r]) ..`` of ``tensor`` to rank r; returns the rows every rank
        sent here, in rank order (``recv_counts[r]`` from rank r)."""
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        self.group.alltoall_base(out, tensor.contiguous(), recv_counts, send_counts).wait()
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """``send_counts[r]``: what this rank sends rank r; returns what each rank sends this one."""
        recv = torch.empty_like(send_counts)
        self.group.alltoall_base(recv, send_counts.contiguous(), [1] * self.tp_size, [1] * self.tp_size).wait()
        return [int(count) for count in recv.tolist()]

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with tp rank ``root``'s, in place; returns it."""
        if self.tp_size > 1:
            self.group.broadcast(tensor, root).wait()
        return tensor

    def all_reduce_stages(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the pipeline stages (this tp rank's ``pp_group``), in place; returns
        it. Every stage's rank of this tp rank calls it, between steps (no micro-batch in flight)."""
        if self.pp_size > 1:
            self.pp_group.allreduce([tensor]).wait()
        return tensor

    def send_to_next_stage(self, tensor: torch.Tensor, tag: int) -> Any:
        """Start sending ``tensor`` to the same tp rank of stage pp_rank + 1; returns the Work
        (the caller keeps ``tensor`` alive until ``wait()``)."""
        assert not self.is_last_stage, "the last stage sends nothing on"
        return self.pp_group.send([tensor.contiguous()], self.pp_rank + 1, tag)

    def recv_from_previous_stage(self, tensor: torch.Tensor, tag: int) -> torch.Tensor:
        """Fill ``tensor`` (shape and dtype known to both sides from the plan) with what stage
        pp_rank - 1 sent under ``tag``; blocks until it arrived."""
        assert not self.is_first_stage, "the first stage receives nothing"
        self.pp_group.recv([tensor], self.pp_rank - 1, tag).wait()
        return tensor

    def describe(self) -> dict[str, int]:
        """The layout for logs and /get_server_info."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "pp_rank": self.pp_rank,
                "pp_size": self.pp_size, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "ep_size": self.ep_size}


def make_tp_group(store: Any, rank: int, size: int, device: torch.device, timeout_s: float,
                  store_host: str | None = None) -> Any:
    """A ProcessGroup over ``store`` (tensor-parallel, or a pipeline's stages): gloo on CPU, NCCL on CUDA.

    A ProcessGroup object rather than torch.distributed's default group: several engines (tests)
    can live in one process, and nothing global is set. Blocks until every rank joined, at most
    ``timeout_s``, which also bounds every collective on it. ``store_host``: where the store is
    served; gloo then listens on this host's address towards it (its default, the address the host
    name resolves to, is often 127.0.0.1, which other nodes cannot reach).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if store_host is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(store_host))]
    return dist.ProcessGroupGloo(store, rank, size, gloo_options)


def local_address_towards(host: str) -> str:
    """This host's IP address on the route to ``host`` (no packet is sent: a UDP connect only
    picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host) if family == socket.AF_INET else host, 9))
        return str(probe.getsockname()[0])


def rank_layout(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """World rank -> (tp_rank, pp_rank). Ranks 0 .. tp-1 are the last stage (world rank 0, the
    engine process, samples from the logits it computed), ranks tp .. 2tp-1 the stage before it."""
    assert 0 <= rank < tp_size * pp_size, f"rank {rank} outside a world of {tp_size * pp_size}"
    return rank % tp_size, pp_size - 1 - rank // tp_size


def world_rank(tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> int:
    """The inverse of ``rank_layout``."""
    return (pp_size - 1 - pp_rank) * tp_size + tp_rank


def join_groups(store: Any, rank: int, tp_size: int, pp_size: int, device: torch.device,
                timeout_s: float, shm_all_reduce: Any = None,
                store_host: str | None = None) -> ParallelContext:
    """World rank ``rank``'s ParallelContext: its stage's tensor-parallel group and its pipeline
    group (the same tp rank on every stage), each a ProcessGroup over its own prefix of ``store``.
    Every rank joins its tp group first, then its pipeline group, so the rendezvous cannot cross.
    ``store_host``: see ``make_tp_group``."""
    tp_rank, pp_rank = rank_layout(rank, tp_size, pp_size)
    prefix_store = dist.PrefixStore  # type: ignore[attr-defined]
    group = (make_tp_group(prefix_store(f"tp-stage{pp_rank}", store), tp_rank, tp_size, device,
                           timeout_s, store_host) if tp_size > 1 else None)
    pp_group = (make_tp_group(prefix_store(f"pp-tp{tp_rank}", store), pp_rank, pp_size, device,
                              timeout_s, store_host) if pp_size > 1 else None)
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                           group=group, shm_all_reduce=shm_all_reduce, pp_group=pp_group)


def ranks_sharing_memory(world_size: int, device: torch.device) -> int:
    """Ranks whose KV pools come out of the same memory: all ranks of a CPU node, one per GPU."""
    return world_size if device.type == "cpu" else 1
