"""The hierarchical cache: the device pool (the radix tree's blocks), a host tier and a file
storage tier, with blocks moving down on eviction and up on a prefix match.

Where a block lives, by its key (servelm.cache.hicache.keys): on the device when the radix tree
holds it; in the host tier when ``HostIndex`` has a slot for it; on disk when ``FileStorage``
has its file. A block may be in several tiers at once; the device copy is the one used.

Invariants:
- Down: a block the radix tree evicts is copied to the host tier first (the tree calls
  ``evicting`` while the block's K/V is intact), so eviction demotes instead of dropping.
  The write policy says when blocks are copied down *before* eviction: write_through copies
  every block as soon as it is cached, write_through_selective once it has been matched twice
  (a hot prefix), write_back only on eviction. Storage gets the exact device bytes at the same
  moments (the host tier may be quantized; disk never is).
- Up: ``pull_up`` runs before a request's prefix match: the blocks right after the device
  match that the host tier or a finished prefetch has are copied into fresh device blocks
  and inserted into the radix tree, so the ordinary match then finds them. Blocks only on
  disk are prefetched by a background thread; ``is_ready`` tells the scheduler whether to
  admit the request now (best_effort: always; wait_complete: when its reads are done;
  timeout: when done or after ``prefetch_timeout_s``). The step itself never waits on disk.
- The blocks of the device match are pinned (a pool reference) while blocks are allocated for
  the pulled ones, so making room never evicts the prefix being extended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from servelm.cache.block_pool import BlockPool
from servelm.cache.hicache.host_index import HostIndex
from servelm.cache.hicache.keys import block_hashes
from servelm.cache.hicache.storage import FileStorage
from servelm.cache.radix_tree import RadixTree

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2
"""write_through_selective copies a block down once it has been matched this many times."""


class BlockMover(Protocol):
    """Moves one block's K/V between the device pool and the tiers (servelm.model.kv_tiers)."""

    @property
    def exact_nbytes(self) -> int:
        """Bytes of one block's exact K/V (a storage payload)."""

    @property
    def host_nbytes(self) -> int:
        """Bytes one block takes in the host tier (less when quantized)."""

    def to_host(self, block_id: int, slot: int) -> None: ...

    def from_host(self, slot: int, block_id: int) -> None: ...

    def read_exact(self, block_id: int) -> bytes: ...

    def write_exact(self, block_id: int, payload: bytes) -> None: ...


@dataclass(frozen=True)
class HiCacheSettings:
    write_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 2.0


class HiCacheController:
    """Listens to the radix tree (down) and pulls blocks up before a match."""

    def __init__(self, tree: RadixTree, pool: BlockPool, mover: BlockMover, num_host_slots: int,
                 settings: HiCacheSettings, storage: FileStorage | None = None) -> None:
        assert settings.write_policy in WRITE_POLICIES and settings.prefetch_policy in PREFETCH_POLICIES
        self.tree = tree
        self.pool = pool
        self.mover = mover
        self.block_size = tree.block_size
        self.host = HostIndex(num_host_slots)
        self.storage = storage
        self.settings = settings
        self._match_counts: dict[str, int] = {}
        """write_through_selective: matches of blocks not copied down yet."""
        self._waiting_since: dict[str, float] = {}
        """Requests held back for a prefetch (by request id), since when."""
        self.num_host_hit_blocks = 0
        self.num_storage_hit_blocks = 0
        self.num_demoted_blocks = 0
        self.num_host_write_bytes = 0
        self.num_host_read_bytes = 0
        self.num_prefetch_waits = 0
        """Requests held back (once each) because their blocks were still being read."""
        self.num_prefetch_timeouts = 0
        tree.listener = self

    # -- down ------------------------------------------------------------------------------
    def inserted(self, adapter_id: str | None, token_ids: Sequence[int], first_block: int,
                 block_ids: list[int]) -> None:
        if self.settings.write_policy != "write_through":
            return
        keys = block_hashes(token_ids, self.block_size, adapter_id)[first_block:]
        for key, block_id in zip(keys, block_ids, strict=True):
            self._copy_down(key, block_id, to_storage=True)

    def evicting(self, adapter_id: str | None, token_ids: Sequence[int], first_block: int,
                 block_ids: list[int]) -> None:
        keys = block_hashes(token_ids, self.block_size, adapter_id)[first_block:]
        selective = self.settings.write_policy == "write_through_selective"
        for key, block_id in zip(keys, block_ids, strict=True):
            hot = not selective or self._match_counts.pop(key, 0) >= SELECTIVE_HITS
            self._copy_down(key, block_id, to_storage=hot)
            self.num_demoted_blocks += 1

    def _copy_down(self, key: str, block_id: int, to_storage: bool) -> None:
        if key not in self.host:
            slot = self.host.assign(key)
            if slot is not None:
                self.mover.to_host(block_id, slot)
                self.num_host_write_bytes += self.mover.host_nbytes
        if to_storage and self.storage is not None and not self.storage.contains(key):
            self.storage.put(key, self.mover.read_exact(block_id))

    def _count_matches(self, keys: list[str], block_ids: list[int]) -> None:
        """write_through_selective: copy a block down on its SELECTIVE_HITS-th match."""
        for key, block_id in zip(keys, block_ids, strict=False):
            if key in self.host:
                continue
            count = self._match_counts.get(key, 0) + 1
            self._match_counts[key] = count
            if count >= SELECTIVE_HITS:
                self._copy_down(key, block_id, to_storage=True)

    # -- up --------------------------------------------------------------------------------
    def is_ready(self, token_ids: Sequence[int], adapter_id: str | None, request_key: str) -> bool:
        """Whether a request may be admitted now as far as its prefetch goes (starts the reads of
        its blocks that are only on disk)."""
        if self.storage is None:
            return True
        device_blocks = self.tree.match_length(token_ids, adapter_id) // self.block_size
        keys = block_hashes(token_ids, self.block_size, adapter_id)[device_blocks:]
        on_disk = []
        for key in keys:
            if key in self.host or self.storage.ready(key) is not None:
                continue
            if not self.storage.contains(key):
                break
            on_disk.append(key)
        self.storage.prefetch(on_disk)
        pending = any(self.storage.is_pending(key) for key in on_disk)
        policy = self.settings.prefetch_policy
        if not pending or policy == "best_effort":
            self._waiting_since.pop(request_key, None)
            return True
        if request_key not in self._waiting_since:
            self._waiting_since[request_key] = time.monotonic()
            self.num_prefetch_waits += 1
        since = self._waiting_since[request_key]
        if policy == "timeout" and time.monotonic() - since >= self.settings.prefetch_timeout_s:
            self.num_prefetch_timeouts += 1
            self._waiting_since.pop(request_key, None)
            return True
        return False

    @property
    def is_holding_requests(self) -> bool:
        """Some request waits for its blocks to be read from disk."""
        return bool(self._waiting_since)

    def wait_for_reads(self, timeout_s: float) -> None:
        """Sleep until a background read finishes (or ``timeout_s``): an engine with nothing
        to run but requests held for a prefetch does not spin."""
        if self.storage is not None:
            self.storage.wait_for_read(timeout_s)

    def forget(self, request_key: str) -> None:
        """A request left the queue (aborted) while held back for a prefetch."""
        self._waiting_since.pop(request_key, None)

    def pull_up(self, token_ids: Sequence[int], adapter_id: str | None) -> int:
        """Copy the blocks after the device match that the host tier or a finished prefetch
        holds into device blocks, and cache them in the radix tree. Returns blocks pulled up."""
        num_device = self.tree.match_length(token_ids, adapter_id) // self.block_size
        keys = block_hashes(token_ids, self.block_size, adapter_id)
        run: list[str] = []
        for key in keys[num_device:]:
            if key not in self.host and (self.storage is None or self.storage.ready(key) is None):
                break
            run.append(key)
        selective = self.settings.write_policy == "write_through_selective"
        if not run and not (selective and num_device):
            return 0  # leave the tree's use counts to the scheduler's own match
        match = self.tree.match_prefix(token_ids, adapter_id)
        if selective:
            self._count_matches(keys[:num_device], match.block_ids)
        if not run:
            return 0
        self.pool.retain(match.block_ids)  # pin the prefix while room is made
        self.host.pinned.update(run)
        try:
            new_blocks = self._allocate(len(run))
            for key, block_id in zip(run, new_blocks, strict=False):
                self._load(key, block_id)
            if new_blocks:
                self.tree.insert(token_ids[:(num_device + len(new_blocks)) * self.block_size],
                                 match.block_ids + new_blocks, adapter_id)
                self.pool.release(new_blocks)  # the tree holds them now
        finally:
            self.pool.release(match.block_ids)
            self.host.pinned.clear()
        return len(new_blocks)

    def _allocate(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` device blocks, evicting free cached ones (which demotes them)."""
        missing = num_blocks - self.pool.num_free_blocks
        if missing > 0:
            self.tree.evict(missing)
        return self.pool.allocate(min(num_blocks, self.pool.num_free_blocks)) or []

    def _load(self, key: str, block_id: int) -> None:
        slot = self.host.get(key)
        if slot is not None:
            self.mover.from_host(slot, block_id)
            self.num_host_hit_blocks += 1
            self.num_host_read_bytes += self.mover.host_nbytes
            return
        assert self.storage is not None
        payload = self.storage.ready(key)
        assert payload is not None, "a pulled-up block is in the host tier or prefetched"
        self.mover.write_exact(block_id, payload)
        self.storage.consume(key)
        self.num_storage_hit_blocks += 1

    def locate(self, token_ids: Sequence[int], adapter_id: str | None = None) -> list[str]:
        """Where each full block of ``token_ids`` lives, fastest tier first: "device", "host",
        "disk" (a stored file; "disk" also while its prefetched copy waits) or "none". Changes
        nothing."""
        num_device = self.tree.match_length(token_ids, adapter_id) // self.block_size
        places = []
        for index, key in enumerate(block_hashes(token_ids, self.block_size, adapter_id)):
            if index < num_device:
                places.append("device")
            elif key in self.host:
                places.append("host")
            elif self.storage is not None and self.storage.contains(key):
                places.append("disk")
            else:
                places.append("none")
        return places

    # -- upkeep ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop the host tier (with /flush_cache); files on disk stay (they outlive the server)."""
        self.host.clear()
        self._match_counts.clear()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def stats(self) -> dict[str, Any]:
        size = self.block_size
        stats: dict[str, Any] = {
            "hicache_host_hit_tokens": self.num_host_hit_blocks * size,
            "hicache_storage_hit_tokens": self.num_storage_hit_blocks * size,
            "hicache_demoted_blocks": self.num_demoted_blocks,
            "hicache_host_blocks": len(self.host),
            "hicache_host_capacity_blocks": self.host.num_slots,
            "hicache_host_write_bytes": self.num_host_write_bytes,
            "hicache_host_read_bytes": self.num_host_read_bytes,
            "hicache_prefetch_waits": self.num_prefetch_waits,
            "hicache_prefetch_timeouts": self.num_prefetch_timeouts,
        }
        if self.storage is not None:
            storage = self.storage
            stats.update({
                "hicache_storage_files": storage.num_files,
                "hicache_storage_bytes": storage.total_bytes,
                "hicache_storage_write_bytes": storage.num_written_bytes,
                "hicache_storage_read_bytes": storage.num_read_bytes,
                "hicache_storage_dropped_writes": storage.num_dropped_writes,
                "hicache_storage_invalid_files": storage.num_invalid_files,
                "hicache_storage_evicted_files": storage.num_evicted_files,
            })
        return stats
