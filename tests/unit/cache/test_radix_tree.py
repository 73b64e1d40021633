"""The radix tree: match, insert, split, sharing (pool ref counts as locks), eviction order."""

from __future__ import annotations

from servelm.cache.block_pool import BlockPool
from servelm.cache.radix_tree import RadixTree

BS = 2  # block size


def make(num_blocks: int = 16, policy: str = "lru") -> tuple[BlockPool, RadixTree]:
    pool = BlockPool(num_blocks)
    return pool, RadixTree(pool, BS, policy)


def cache(pool: BlockPool, tree: RadixTree, tokens: list[int], adapter: str | None = None) -> list[int]:
    """What a finishing request does: allocate, insert, drop its own reference."""
    blocks = pool.allocate(len(tokens) // BS)
    assert blocks is not None
    tree.insert(tokens, blocks, adapter)
    pool.release(blocks)
    return blocks


def test_match_insert_exact_block_ids_and_whole_blocks_only() -> None:
    pool, tree = make()
    assert tree.match_prefix([1, 2, 3]).num_tokens == 0
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    # 7 tokens: only 3 whole blocks are cached; the tree takes its own reference.
    assert tree.insert([1, 2, 3, 4, 5, 6, 7], blocks) == 6
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2]
    pool.release(blocks)
    assert tree.num_blocks == 3 and pool.num_free_blocks == 13
    match = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert (match.block_ids, match.num_tokens) == ([0, 1], 4)
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (match.block_ids, match.num_tokens) == ([0, 1, 2], 6)
    # A partial block never matches.
    assert tree.match_prefix([1, 2, 3]).block_ids == [0]
    assert tree.match_prefix([2, 1]).num_tokens == 0


def test_insert_of_a_cached_prefix_keeps_the_trees_blocks() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4])              # blocks 0, 1
    duplicate = pool.allocate(3)                 # blocks 2, 3, 4 computed the same prefix again
    assert duplicate is not None
    assert tree.insert([1, 2, 3, 4, 5, 6], duplicate) == 2
    pool.release(duplicate)
    # Only the new third block was adopted; the duplicates of blocks 0 and 1 are free again.
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == [0, 1, 4]
    assert pool.ref_count(2) == 0 and pool.ref_count(3) == 0
    assert tree.num_blocks == 3


def test_split_on_partial_match_and_divergent_insert() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4, 5, 6])        # one node: blocks 0, 1, 2
    cache(pool, tree, [1, 2, 3, 4, 7, 8, 9, 9])  # diverges after two blocks: split
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == [0, 1, 2]
    assert tree.match_prefix([1, 2, 3, 4, 7, 8, 9, 9]).block_ids == [0, 1, 5, 6]
    assert tree.match_prefix([1, 2, 3, 4]).block_ids == [0, 1]
    assert tree.num_blocks == 5
    # Blocks 3 and 4 were the duplicates of the shared prefix and went back to the pool.
    assert pool.num_free_blocks == 16 - 5


def test_adapters_never_share() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4], adapter="a")
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4], "b").num_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4], "a").block_ids == [0, 1]


def test_blocks_in_use_are_never_evicted() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4])
    cache(pool, tree, [5, 6, 7, 8])
    held = tree.match_prefix([1, 2, 3, 4]).block_ids
    pool.retain(held)                            # a running request locks them
    assert tree.num_evictable_blocks() == 2
    assert tree.evict(10) == 2                   # only [5..8]
    assert tree.match_prefix([1, 2, 3, 4]).block_ids == held
    assert tree.match_prefix([5, 6, 7, 8]).num_tokens == 0
    pool.release(held)                           # unlock
    assert tree.evict(10) == 2
    assert tree.num_blocks == 0 and pool.num_free_blocks == 16


def test_lru_eviction_order_and_tail_trimming() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 1, 1, 1])              # blocks 0, 1: oldest
    cache(pool, tree, [2, 2, 2, 2])              # blocks 2, 3
    cache(pool, tree, [3, 3, 3, 3])              # blocks 4, 5
    tree.match_prefix([1, 1, 1, 1])              # touch the first one: now [2, 2..] is oldest
    assert tree.evict(1) == 1
    # The tail block of the least recently used leaf goes first; its head stays cached.
    assert tree.match_length([2, 2, 2, 2]) == 2
    assert pool.ref_count(3) == 0
    assert tree.evict(2) == 2                    # rest of [2..] (block 2), then the LRU head of [3..]
    assert tree.match_length([2, 2]) == 0
    assert tree.match_length([3, 3, 3, 3]) == 2
    assert tree.match_length([1, 1, 1, 1]) == 4


def test_parent_becomes_evictable_after_its_children() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4])
    cache(pool, tree, [1, 2, 5, 6])              # split: [1, 2] with two children
    assert tree.evict(3) == 3
    assert tree.num_blocks == 0 and pool.num_free_blocks == 16


def test_lfu_evicts_the_least_hit_first() -> None:
    pool, tree = make(policy="lfu")
    cache(pool, tree, [1, 1])
    cache(pool, tree, [2, 2])
    for _ in range(3):
        tree.match_prefix([1, 1])
    tree.match_prefix([2, 2])                    # more recent, but fewer hits
    assert tree.evict(1) == 1
    assert tree.match_length([2, 2]) == 0 and tree.match_length([1, 1]) == 2


def test_match_length_changes_nothing_and_reset() -> None:
    pool, tree = make()
    cache(pool, tree, [1, 2, 3, 4, 5, 6])
    assert tree.match_length([1, 2, 3, 4, 0, 0]) == 4
    # No split happened: one node still holds all three blocks and evicts as one run.
    assert tree.evict(3) == 3
    cache(pool, tree, [1, 2])
    assert tree.reset() == 1 and pool.num_free_blocks == 16
