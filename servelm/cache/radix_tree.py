"""The prefix cache: a radix tree over token ids at block granularity, mapping prefixes to KV blocks.

Every node holds a run of whole blocks: ``len(node.token_ids) == len(node.block_ids) * block_size``.
A path from the root spells a token prefix; the blocks along it hold that prefix's K/V. Only full
blocks are cached, so a shared block is never written again by anyone.

Invariants:
- The tree owns one pool reference to each of its blocks (``BlockPool.retain`` on insert,
  ``release`` on eviction). A request that reuses cached blocks takes its own reference, so a
  block with ref count > 1 is in use and never evicted: the pool ref count *is* the lock.
- Children of a node differ in their first block of tokens (the key of the ``children`` dict).
- Each adapter (LoRA) id has its own root, so two adapters never share K/V.
- Eviction only removes leaves whose blocks nobody else holds, least recently used first (or
  least frequently used with ``policy="lfu"``); it may trim a leaf's trailing blocks.
- A ``listener`` (the hierarchical cache) hears of every block inserted (after its K/V is
  written) and every block about to be evicted (before its pool reference is dropped, so its
  K/V is still intact): that is where blocks are copied to the tiers below the pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servelm.cache.block_pool import BlockPool

EVICTION_POLICIES = ("lru", "lfu")


@dataclass(eq=False, slots=True)
class _Node:
    token_ids: tuple[int, ...]
    block_ids: list[int]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0
    """Logical clock of the last match or insert touching this node (LRU order)."""
    num_hits: int = 0
    """Matches that went through this node (LFU order)."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a token sequence."""

    block_ids: list[int]
    """Blocks holding the K/V of the first ``num_tokens`` tokens, in position order."""
    num_tokens: int
    """A multiple of the block size."""


class CacheListener(Protocol):
    """Hears which blocks enter and leave the tree. ``token_ids`` is the whole prefix through
    the last of ``block_ids``, which are blocks ``first_block ..`` of that prefix."""

    def inserted(self, adapter_id: str | None, token_ids: Sequence[int], first_block: int,
                 block_ids: list[int]) -> None: ...

    def evicting(self, adapter_id: str | None, token_ids: Sequence[int], first_block: int,
                 block_ids: list[int]) -> None: ...


class RadixTree:
    """Prefix -> KV blocks, with reference-counted sharing and LRU/LFU eviction."""

    def __init__(self, block_pool: BlockPool, block_size: int, eviction_policy: str = "lru") -> None:
        assert eviction_policy in EVICTION_POLICIES, eviction_policy
        self.listener: CacheListener | None = None
        """Set by the hierarchical cache (servelm.cache.hicache); None: evicted blocks are dropped."""
        self.block_pool = block_pool
        self.block_size = block_size
        self.eviction_policy = eviction_policy
        self._roots: dict[str | None, _Node] = {}
        self._clock = 0
        self.num_blocks = 0
        """Blocks the tree holds a reference to."""

    # -- lookup -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], adapter_id: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` (whole blocks). Marks the path as used and
        splits a node matched only in part, so the match always ends at a node boundary."""
        self._clock += 1
        block_ids: list[int] = []
        for node, num_blocks in list(self._walk(token_ids, adapter_id)):
            if num_blocks < len(node.block_ids):
                node = self._split(node, num_blocks)
            node.last_access = self._clock
            node.num_hits += 1
            block_ids.extend(node.block_ids)
        return PrefixMatch(block_ids, len(block_ids) * self.block_size)

    def match_length(self, token_ids: Sequence[int], adapter_id: str | None = None) -> int:
        """Tokens of ``token_ids`` that are cached; changes nothing (for scheduling policies)."""
        return sum(n for _, n in self._walk(token_ids, adapter_id)) * self.block_size

    def first_cached_block(self, token_ids: Sequence[int], adapter_id: str | None = None) -> int | None:
        """The first block of the cached path of ``token_ids`` (None: not even one block cached)."""
        first = next(self._walk(token_ids, adapter_id), None)
        return None if first is None else first[0].block_ids[0]

    def path(self, token_ids: Sequence[int], adapter_id: str | None = None) -> list[object]:
        """The nodes (opaque handles) on the cached path of ``token_ids``, starting with the
        adapter's root; a node matched in part counts. Changes nothing but may create the root."""
        root = self._roots.setdefault(adapter_id, _Node((), [], None))
        return [root, *(node for node, _ in self._walk(token_ids, adapter_id))]

    def _walk(self, token_ids: Sequence[int], adapter_id: str | None) -> Iterator[tuple[_Node, int]]:
        """Yield (node, number of its leading blocks matched) along the cached path."""
        node = self._roots.get(adapter_id)
        if node is None:
            return
        size = self.block_size
        position = 0
        while len(token_ids) - position >= size:
            child = node.children.get(tuple(token_ids[position:position + size]))
            if child is None:
                return
            num_blocks = 1  # the first block matched through the dict key
            while (num_blocks < len(child.block_ids)
                   and tuple(token_ids[position + num_blocks * size:position + (num_blocks + 1) * size])
                   == child.token_ids[num_blocks * size:(num_blocks + 1) * size]):
                num_blocks += 1
            yield child, num_blocks
            if num_blocks < len(child.block_ids):
                return
            position += num_blocks * size
            node = child

    # -- insert -----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int],
               adapter_id: str | None = None) -> int:
        """Cache ``block_ids`` as the K/V of ``token_ids`` (whole blocks; trailing partial tokens are
        ignored). Blocks of a prefix already cached are left to the caller (the tree keeps its
        own); new blocks gain a tree reference. Returns the number of tokens newly cached."""
        size = self.block_size
        num_blocks = min(len(token_ids) // size, len(block_ids))
        if num_blocks == 0:
            return 0
        self._clock += 1
        node = self._roots.setdefault(adapter_id, _Node((), [], None))
        node.last_access = self._clock
        matched = 0
        for child, count in list(self._walk(token_ids[:num_blocks * size], adapter_id)):
            if count < len(child.block_ids):
                child = self._split(child, count)
            child.last_access = self._clock
            matched += count
            node = child
        if matched == num_blocks:
            return 0
        new_blocks = list(block_ids[matched:num_blocks])
        leaf = _Node(tuple(token_ids[matched * size:num_blocks * size]), new_blocks, node,
                     last_access=self._clock)
        node.children[leaf.token_ids[:size]] = leaf
        self.block_pool.retain(new_blocks)
        self.num_blocks += len(new_blocks)
        if self.listener is not None:
            self.listener.inserted(adapter_id, token_ids[:num_blocks * size], matched, new_blocks)
        return len(new_blocks) * size

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node`` after ``num_blocks`` blocks; returns the new upper part (same last use)."""
        assert 0 < num_blocks < len(node.block_ids) and node.parent is not None
        cut = num_blocks * self.block_size
        upper = _Node(node.token_ids[:cut], node.block_ids[:num_blocks], node.parent,
                      last_access=node.last_access, num_hits=node.num_hits)
        node.parent.children[upper.token_ids[:self.block_size]] = upper
        node.token_ids = node.token_ids[cut:]
        node.block_ids = node.block_ids[num_blocks:]
        node.parent = upper
        upper.children[node.token_ids[:self.block_size]] = node
        return upper

    # -- eviction ---------------------------------------------------------------------------
    def _is_evictable(self, node: _Node, partition: int | None = None) -> bool:
        return (node.parent is not None and not node.children
                and all(self.block_pool.ref_count(b) == 1 for b in node.block_ids)
                and (partition is None or self.block_pool.partition_of(node.block_ids[0]) == partition))

    def _order(self, node: _Node) -> tuple[int, int]:
        if self.eviction_policy == "lfu":
            return (node.num_hits, node.last_access)
        return (node.last_access, node.num_hits)

    def evict(self, num_blocks: int, partition: int | None = None) -> int:
        """Free up to ``num_blocks`` cached blocks nobody else holds (of the pool's ``partition``
        only, when given: a node's blocks are one request's, so all in one partition); returns
        how many were freed."""
        heap = [(self._order(n), id(n), n) for n in self._nodes() if self._is_evictable(n, partition)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            take = min(num_blocks - freed, len(node.block_ids))
            victims = node.block_ids[len(node.block_ids) - take:]
            if self.listener is not None:
                adapter_id, prefix = self._prefix(node)
                self.listener.evicting(adapter_id, prefix, len(prefix) // self.block_size - take,
                                       victims)
            self.block_pool.release(victims)
            self.num_blocks -= take
            freed += take
            if take < len(node.block_ids):  # trim the tail; the node stays
                node.block_ids = node.block_ids[:len(node.block_ids) - take]
                node.token_ids = node.token_ids[:len(node.block_ids) * self.block_size]
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.token_ids[:self.block_size]]
            if self._is_evictable(parent, partition):
                heapq.heappush(heap, (self._order(parent), id(parent), parent))
        return freed

    def _prefix(self, node: _Node) -> tuple[str | None, tuple[int, ...]]:
        """The adapter id and the whole token prefix through ``node``."""
        parts: list[tuple[int, ...]] = []
        current = node
        while current.parent is not None:
            parts.append(current.token_ids)
            current = current.parent
        adapter_id = next(a for a, root in self._roots.items() if root is current)
        return adapter_id, tuple(token for part in reversed(parts) for token in part)

    def num_evictable_blocks(self) -> int:
        """Cached blocks that eviction could free now (held by no request)."""
        return sum(1 for n in self._nodes() for b in n.block_ids if self.block_pool.ref_count(b) == 1)

    def reset(self) -> int:
        """Drop every cached block; only valid when no request holds any. Returns blocks freed."""
        freed = 0
        for node in self._nodes():
            assert all(self.block_pool.ref_count(b) == 1 for b in node.block_ids), \
                "reset of a prefix cache whose blocks are in use"
            self.block_pool.release(node.block_ids)
            freed += len(node.block_ids)
        self._roots.clear()
        self.num_blocks = 0
        return freed

    def _nodes(self) -> Iterator[_Node]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
