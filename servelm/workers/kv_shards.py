"""A rank worker's part of a prefill/decode transfer: its share of the KV heads.

A transfer carries every KV head of the model (``ShardedKV`` below gathers and splits them in the
engine process); each rank's pool holds the heads of its ``HeadShard``. A worker reports
which heads it holds, sends its share of a prefill request's blocks, and stores its share of a
decode request's blocks, all as commands between steps (handled in order, so a write lands before
the step that reads it).
"""

from __future__ import annotations

from typing import Any

import torch

from servelm.model.kv_cache import block_heads, select_heads
from servelm.model.layers.linear import QKVParallelLinear
from servelm.workers.messages import (DescribeKVHeads, KVBlocksRead, KVHeads, ReadKVBlocks,
                                      WriteKVBlocks)


def kv_head_range(runner: Any) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank's pool. ValueError for a model without the fused
    q/k/v projection (its head split is unknown here)."""
    for module in runner.model.modules():
        if isinstance(module, QKVParallelLinear):
            return module.head_shard.kv.start, module.head_shard.kv.size
    raise ValueError("--disaggregation-mode with --tp-size > 1 needs an attention with fused q/k/v "
                     "projections; this model has none: use --tp-size 1")


def serve_command(rank: int, runner: Any, command: Any) -> KVHeads | KVBlocksRead | None:
    """Run one K/V command on this rank's pool; the reply to send, if any."""
    if isinstance(command, DescribeKVHeads):
        start, size = kv_head_range(runner)
        return KVHeads(rank, start, size)
    cache = runner.kv_cache
    if isinstance(command, ReadKVBlocks):
        k, v = cache.read_blocks(command.block_ids)
        return KVBlocksRead(rank, k=k.numpy(), v=v.numpy())
    assert isinstance(command, WriteKVBlocks)
    start, size = kv_head_range(runner)
    k, v = (select_heads(torch.from_numpy(t), cache.block_size, command.num_kv_heads, start, size)
            for t in (command.k, command.v))
    cache.write_blocks(command.block_ids, k, v)
    return None


class ShardedKV:
    """The pool of a tensor-parallel server seen whole, in the engine process: what a transfer
    reads and writes (``KVCache``'s ``read_blocks``/``write_blocks`` and layout attributes, with
    ``num_kv_heads`` the model's). Rank 0's pool is in this process; the others are reached by
    the executor's commands.

    Invariants: ``read_blocks`` returns the bytes a tp-1 pool of the same model would hold (a
    replicated head is equal on every rank holding it, so any copy will do), so a
    prefill server at tp N and a decode server at tp M exchange blocks whatever N and M are.
    """

    def __init__(self, executor: Any, worker_heads: list[tuple[int, int]]) -> None:
        self.executor = executor
        self.cache = executor.runner.kv_cache
        self.head_ranges = [kv_head_range(executor.runner), *worker_heads]
        """(first KV head, KV heads) of every rank's pool, rank order."""
        self.tp_size = len(self.head_ranges)
        self.num_layers = self.cache.num_layers
        self.block_size = self.cache.block_size
        self.head_dim = self.cache.head_dim
        self.dtype = self.cache.dtype
        self.num_kv_heads = max(start + size for start, size in self.head_ranges)
        covered = {head for start, size in self.head_ranges for head in range(start, start + size)}
        assert covered == set(range(self.num_kv_heads)), f"ranks hold KV heads {self.head_ranges}"

    @property
    def v_caches(self) -> list[torch.Tensor]:
        """Rank 0's V tensors: empty for a latent pool (MLA), which stores no V of its own, so
        a transfer counts its bytes as ``KVCache``'s layout says."""
        return self.cache.v_caches

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        shares = [self.cache.read_blocks(block_ids), *self.executor.read_kv_blocks(block_ids)]
        num_layers, num_blocks = shares[0][0].shape[:2]
        whole = []
        for part in range(2):  # K, then V
            heads = torch.empty(num_layers, num_blocks, self.block_size, self.num_kv_heads,
                                self.head_dim * self.dtype.itemsize, dtype=torch.uint8)
            for (start, size), share in zip(self.head_ranges, shares):
                heads[:, :, :, start:start + size] = block_heads(share[part], self.block_size, size)
            whole.append(heads.view(num_layers, num_blocks, -1))
        return whole[0], whole[1]

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.executor.write_kv_blocks(block_ids, self.num_kv_heads, k.contiguous(), v.contiguous())
        start, size = self.head_ranges[0]
        self.cache.write_blocks(block_ids, *(select_heads(t, self.block_size, self.num_kv_heads,
                                                          start, size) for t in (k, v)))
