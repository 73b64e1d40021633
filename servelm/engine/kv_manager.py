"""Which KV blocks each request holds: the block bookkeeping beside the scheduler.

The scheduler decides who runs and how many tokens; this class decides which blocks back them.
Every block a request holds comes from here and goes back through here: a prefix-cache hit, a
grow for the step's tokens, the rollback of rejected drafts, a beam's fork, a prefill server's
parked blocks and a decode server's reservation.

Invariants:
- ``request.block_ids`` covers at least ``num_computed_tokens`` positions; blocks past
  ``cdiv(num_computed_tokens, block_size)`` exist only while a step's tokens or drafts are in
  flight and are dropped by ``roll_back_drafts`` when the model did not accept them.
- The prefix cache only ever sees accepted tokens: a block enters it once every one of its slots
  is computed (``cache_computed_blocks``); ``num_inserted_blocks`` counts the leading blocks
  already given, so a block is inserted once.
- Leading blocks shared with the cache (or a sibling beam) are never written: a request computes
  from ``num_computed_tokens`` on, and a fork copies the parent's partial last block before
  either writes into it (``pending_block_copies``, made by the next forward).
- When the pool is short, cached blocks nobody holds are evicted before any allocation fails.
- A partitioned pool (DP attention: each rank's pool holds one partition; cache/block_pool.py):
  all of a request's blocks lie in one partition, the one of its first block. A request holding
  none takes the partition with the most free blocks, a fork's copy comes from the parent's. Every
  cached path lies in one partition (a request extends only a path of its own partition), so a
  prefix hit shares blocks of one partition and a partition's eviction frees whole subtrees.
"""

from __future__ import annotations

from servelm.cache.block_pool import BlockPool
from servelm.cache.hicache import HiCacheController
from servelm.cache.radix_tree import RadixTree
from servelm.config import SchedulerConfig
from servelm.engine.policy import cache_key
from servelm.engine.request import Request, RequestStatus
from servelm.spec.tree import accepted_path_copies


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """Allocates, shares, rolls back and frees the KV blocks of requests."""

    def __init__(self, block_pool: BlockPool, block_size: int,
                 prefix_cache: RadixTree | None = None,
                 hicache: HiCacheController | None = None) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.hicache = hicache
        """The tiers below the pool (--enable-hierarchical-cache): a prefix match first pulls
        demoted blocks back up; a request whose blocks are being read from disk may wait."""
        self.pending_block_copies: list[tuple[int, int]] = []
        """(source, destination) K/V block copies (beam forks) the next forward makes first."""
        self.prompt_sources: dict[str, Request] = {}
        """Request id -> a request with the same prompt that has computed it
        (engine/prompt_sharing.py): at admission, while that source runs and the request has no
        output yet, the request forks its K/V instead of matching the prefix cache. The entry
        goes when the request ends."""
        self.pending_slot_copies: list[tuple[int, int]] = []
        """(source, destination) K/V slot copies (a draft tree's accepted path); the speculation
        stage makes them right after the update, else the next plan carries them."""

    # -- figures ----------------------------------------------------------------------------
    @property
    def pool_capacity_tokens(self) -> int:
        """Tokens one request can ever hold: the pool, or under DP attention one rank's partition."""
        return self.block_pool.partition_size * self.block_size

    def num_evictable_blocks(self) -> int:
        return self.prefix_cache.num_evictable_blocks() if self.prefix_cache is not None else 0

    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks nobody holds (evicted on demand)."""
        return self.block_pool.num_free_blocks + self.num_evictable_blocks()

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.block_pool.partition_size

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, request: Request) -> None:
        """Start a request at its longest cached prefix, sharing those blocks (all tokens but the
        last are matched, so the last always yields logits); or, when it has a prompt source,
        fork the source's computed prompt (all tokens but the last too)."""
        source = self.prompt_sources.get(request.request_id)
        if source is not None and not request.block_ids and self._fork_prompt(source, request):
            return
        if (self.prefix_cache is None or request.block_ids or request.wants_prompt_logprobs
                or request.pooling is not None):
            return  # prompt logprobs (and pooling) need every prompt position computed
        if self.hicache is not None:
            self.hicache.pull_up(cache_key(request), request.adapter_id)
        match = self.prefix_cache.match_prefix(cache_key(request), request.adapter_id)
        if not match.block_ids:
            return
        self.block_pool.retain(match.block_ids)
        request.block_ids = list(match.block_ids)
        request.num_inserted_blocks = len(match.block_ids)
        request.num_computed_tokens = match.num_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(match.num_tokens, request.num_prompt_tokens)

    def _fork_prompt(self, source: Request, request: Request) -> bool:
        """Take ``source``'s K/V of the request's prompt but its last token (the same prompt:
        engine/prompt_sharing.py); False when the source no longer holds it."""
        num_tokens = request.num_tokens - 1
        if (source.status is not RequestStatus.RUNNING or source.num_computed_tokens < num_tokens
                or request.wants_prompt_logprobs or request.output_token_ids
                or source.adapter_id != request.adapter_id
                or source.token_slice(0, num_tokens) != request.token_slice(0, num_tokens)):
            return False
        self.fork(source, request, num_tokens)
        return True

    def unmatch(self, request: Request) -> None:
        """Undo ``match_prefix`` for a request that stays waiting (it must not pin blocks)."""
        self.free(request)
        request.num_computed_tokens = 0

    def is_prefetched(self, request: Request) -> bool:
        """False while the request's cached prefix is still being read from disk."""
        if (self.hicache is None or request.block_ids or request.wants_prompt_logprobs
                or request.pooling is not None):
            return True
        return self.hicache.is_ready(cache_key(request), request.adapter_id, request.request_id)

    def shares_prefix_in_flight(self, request: Request, admitted: list[Request]) -> bool:
        """True when a request admitted this step will compute a full block of this request's
        uncached prefix: waiting one step turns that duplicate work into a cache hit."""
        if self.prefix_cache is None or not admitted or request.pooling is not None:
            return False
        key = cache_key(request)
        size = self.block_size
        if len(key) < size:
            return False
        cached = self.prefix_cache.match_length(key, request.adapter_id)
        for other in admitted:
            if other.adapter_id != request.adapter_id or other.num_computed_tokens > cached:
                continue
            limit = min(len(key), other.num_tokens - 1)
            if limit >= cached + size and other.cache_slice(cached, cached + size) == key[cached:cached + size]:
                return True
        return False

    def cache_computed_blocks(self, request: Request) -> None:
        """Give the request's newly computed full blocks to the prefix cache (an encoder's K/V
        depend on the whole prompt, so embedding requests never share theirs)."""
        if self.prefix_cache is None or request.pooling is not None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full > request.num_inserted_blocks:
            token_ids = request.cache_slice(0, num_full * self.block_size)
            if self._may_extend_cached_path(token_ids, request):
                self.prefix_cache.insert(token_ids, request.block_ids[:num_full], request.adapter_id)
            request.num_inserted_blocks = num_full

    def _may_extend_cached_path(self, token_ids: list[int], request: Request) -> bool:
        """Whether the request's blocks may continue the cached path of ``token_ids``: always, but
        in a partitioned pool only one of the same partition (a request that computed another
        partition's cached prefix afresh keeps its blocks out of the cache)."""
        pool = self.block_pool
        if pool.num_partitions == 1:
            return True
        assert self.prefix_cache is not None
        first = self.prefix_cache.first_cached_block(token_ids, request.adapter_id)
        return first is None or pool.partition_of(first) == self._partition(request)

    def flush(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    # -- grow and free ----------------------------------------------------------------------
    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens`` positions; False (nothing taken) if the
        pool is short even after evicting cached blocks nobody holds."""
        missing = cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        new_blocks = self._allocate(missing, self._partition(request))
        if new_blocks is None:
            return False
        request.block_ids.extend(new_blocks)
        return True

    def _partition(self, request: Request) -> int:
        """The pool partition of the request's blocks (the roomiest for one holding none)."""
        if request.block_ids:
            return self.block_pool.partition_of(request.block_ids[0])
        return self.block_pool.roomiest_partition()

    def same_pool(self, request: Request, other: Request) -> bool:
        """Whether freeing ``request``'s blocks can make room for ``other``'s (one partition, or
        the same one; a request holding no blocks can take any)."""
        if self.block_pool.num_partitions == 1 or not request.block_ids or not other.block_ids:
            return True
        return self._partition(request) == self._partition(other)

    def _allocate(self, num_blocks: int, partition: int) -> list[int] | None:
        pool = self.block_pool
        new_blocks = pool.allocate(num_blocks, partition)
        if new_blocks is None and self.prefix_cache is not None:
            self.prefix_cache.evict(num_blocks - pool.num_free_in(partition),
                                    partition if pool.num_partitions > 1 else None)
            new_blocks = pool.allocate(num_blocks, partition)
        return new_blocks

    def free(self, request: Request) -> None:
        """Drop the request's blocks; its computed full blocks stay in the prefix cache."""
        if request.block_ids:
            self.cache_computed_blocks(request)
            self.block_pool.release(request.block_ids)
            request.block_ids = []
        request.num_inserted_blocks = 0

    def release(self, request: Request, was_waiting: bool, is_normal_end: bool) -> None:
        """A request ended: its blocks go back, or, a prefill server's request ending normally,
        are parked for the decode server's pull; a waiting one's disk prefetch is forgotten."""
        if was_waiting and self.hicache is not None:
            self.hicache.forget(request.request_id)
        if is_normal_end and request.transfer is not None and request.transfer.key is not None:
            self.park(request)
        else:
            self.free(request)

    def park(self, request: Request) -> None:
        """A prefill server's finished request: its blocks (computed ones cached) are held under
        ``transfer.parked_block_ids`` for the decode server's pull instead of freed."""
        assert request.transfer is not None
        self.cache_computed_blocks(request)
        request.transfer.parked_block_ids, request.block_ids = request.block_ids, []
        request.num_inserted_blocks = 0

    def has_headroom(self, request: Request, num_tokens: int, running: list[Request],
                     config: SchedulerConfig) -> bool:
        """--schedule-conservativeness: admitting ``request`` for ``num_tokens`` keeps a share of
        the running requests' future blocks free (always, past --router-token-ratio usage)."""
        conservativeness = config.schedule_conservativeness
        evictable = None
        if config.router_token_ratio > 0:
            evictable = self.num_evictable_blocks()
            used = self.block_pool.num_used_blocks - evictable
            if used / self.block_pool.num_blocks >= config.router_token_ratio:
                conservativeness = max(conservativeness, 1.0)
        if conservativeness == 0:
            return True
        target_blocks = self.blocks_for(request.num_computed_tokens + num_tokens)
        reserve = sum(max(0, self._final_blocks(r, config) - len(r.block_ids)) for r in running)
        reserve += max(0, self._final_blocks(request, config) - target_blocks)
        needed = target_blocks - len(request.block_ids)
        if evictable is None:
            evictable = self.num_evictable_blocks()
        available = self.block_pool.num_free_blocks + evictable
        return needed + conservativeness * reserve <= available

    def _final_blocks(self, request: Request, config: SchedulerConfig) -> int:
        """Blocks the request holds when it reaches max_tokens (or the context)."""
        max_tokens = request.params.max_tokens
        assumed = config.router_max_new_token_len  # LightLLM's estimate of the output
        if assumed is not None:
            max_tokens = assumed if max_tokens is None else min(max_tokens, assumed)
        final_tokens = request.max_context_tokens if max_tokens is None else min(
            request.max_context_tokens, request.num_prompt_tokens + max_tokens)
        return self.blocks_for(final_tokens)

    # -- speculation ------------------------------------------------------------------------
    def roll_back_drafts(self, request: Request) -> None:
        """After a verify step: drop the blocks that only rejected drafts reached (their K/V is
        garbage beyond ``num_computed_tokens``; slots in a kept block are overwritten before they
        are read, and a block enters the prefix cache only once every slot is computed), then
        cache the blocks the accepted drafts completed."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.block_pool.release(request.block_ids[keep:])
            del request.block_ids[keep:]
        self.cache_computed_blocks(request)

    def move_accepted_path(self, request: Request, root_position: int,
                           accepted_draft_indices: list[int]) -> None:
        """A verified draft tree's accepted path: queue the copies of its K/V next to its root."""
        self.pending_slot_copies += accepted_path_copies(
            request.block_ids, self.block_size, root_position, accepted_draft_indices)

    def take_slot_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_slot_copies = self.pending_slot_copies, []
        return copies

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_block_copies = self.pending_block_copies, []
        return copies

    # -- beams ------------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request, num_computed_tokens: int) -> bool:
        """Give ``child`` (holding no blocks) the parent's K/V for its first
        ``num_computed_tokens`` positions: the full blocks shared, the partial last block copied
        on write by the next forward. With no block free for the copy the child starts at the
        last full block instead (it recomputes the tail). Returns whether a block is copied."""
        assert not child.block_ids, "a forked request starts with no blocks"
        num_full = num_computed_tokens // self.block_size
        child.block_ids = list(parent.block_ids[:num_full])
        self.block_pool.retain(child.block_ids)
        child.num_inserted_blocks = min(parent.num_inserted_blocks, num_full)
        child.num_computed_tokens = num_full * self.block_size
        if num_computed_tokens == child.num_computed_tokens:
            return False
        copy = self._allocate(1, self._partition(parent))
        if copy is None:
            return False  # no block free: recompute the tail instead
        child.block_ids.append(copy[0])
        self.pending_block_copies.append((parent.block_ids[num_full], copy[0]))
        child.num_computed_tokens = num_computed_tokens
        return True

    # -- disaggregation (decode server) -----------------------------------------------------
    def reserve(self, request: Request, num_tokens: int, headroom_blocks: int) -> bool:
        """Give a waiting request blocks for ``num_tokens`` positions: its cached prefix (shared)
        plus new blocks. Refused (False, nothing held) when the pool would keep fewer than
        ``headroom_blocks`` available beyond it."""
        self.match_prefix(request)
        needed = cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if needed + headroom_blocks > self.num_available_blocks() or not self.grow(request, num_tokens):
            self.unmatch(request)
            return False
        return True
