"""The pool of KV blocks: a free list and reference counts, in block ids only (no tensors).

Invariants:
- Every block id in [0, num_blocks) is either free (ref count 0, in the free list exactly once)
  or held (ref count >= 1, not in the free list).
- ``allocate`` either returns all the blocks asked for or none: a step never half-allocates.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids and takes them back."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, "the KV pool needs at least one block"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks (ref count 1), or None when too few are free."""
        if num_blocks > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def retain(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already held (sharing)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"retain of free block {block_id}"
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
