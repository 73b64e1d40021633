"""The pool of KV blocks: free lists and reference counts, in block ids only (no tensors).

Invariants:
- Every block id in [0, num_blocks) is either free (ref count 0, in its partition's free list
  exactly once) or held (ref count >= 1, not in a free list).
- ``allocate`` either returns all the blocks asked for or none: a step never half-allocates.
- The ids are cut into ``num_partitions`` equal contiguous partitions (one unless the ranks hold
  separate pools: DP attention, model/dp_attention.py); a block is allocated from, and freed to,
  its own partition.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids and takes them back."""

    def __init__(self, num_blocks: int, num_partitions: int = 1) -> None:
        assert num_blocks > 0, "the KV pool needs at least one block"
        assert num_blocks % num_partitions == 0, f"{num_blocks} blocks in {num_partitions} equal partitions"
        self.num_blocks = num_blocks
        self.num_partitions = num_partitions
        self.partition_size = num_blocks // num_partitions
        """Blocks of one partition (all of them with one partition)."""
        self._free: list[deque[int]] = [deque(range(start, start + self.partition_size))
                                        for start in range(0, num_blocks, self.partition_size)]
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(len(free) for free in self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def partition_of(self, block_id: int) -> int:
        return block_id // self.partition_size

    def num_free_in(self, partition: int) -> int:
        return len(self._free[partition])

    def roomiest_partition(self) -> int:
        """The partition with the most free blocks (the lowest of equals)."""
        return max(range(self.num_partitions), key=lambda p: (len(self._free[p]), -p))

    def allocate(self, num_blocks: int, partition: int = 0) -> list[int] | None:
        """Take ``num_blocks`` free blocks (ref count 1) of ``partition``, or None when too few are free."""
        free = self._free[partition]
        if num_blocks > len(free):
            return None
        block_ids = [free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def retain(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already held (sharing)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"retain of free block {block_id}"
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to their free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id // self.partition_size].append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
