"""The KV manager with exact block ids: allocate, match a prefix, grow, roll back drafts, fork and
free, eviction under pressure, a prefill server's parked blocks and a decode server's reservation.

Block size 4; the pool hands out the lowest free ids first and takes freed ones to the back."""

from __future__ import annotations

from servelm.cache.block_pool import BlockPool
from servelm.cache.radix_tree import RadixTree
from servelm.engine.kv_manager import KVManager
from servelm.engine.request import Request, TransferState
from servelm.sampling.params import SamplingParams


def make_kv(num_blocks: int = 8, cached: bool = True) -> KVManager:
    pool = BlockPool(num_blocks)
    return KVManager(pool, 4, RadixTree(pool, 4, "lru") if cached else None)


def request(request_id: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=16), [0], 1000,
                   output_token_ids=list(output or []))


def compute(kv: KVManager, req: Request, num_tokens: int) -> None:
    """What a step does: grow for the tokens, count them computed, cache the full blocks."""
    assert kv.grow(req, req.num_computed_tokens + num_tokens)
    req.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(req)


def test_grow_allocates_exactly_the_missing_blocks() -> None:
    kv = make_kv()
    a = request("a", list(range(1, 10)))  # 9 tokens: 3 blocks
    assert kv.grow(a, 9) and a.block_ids == [0, 1, 2]
    assert kv.grow(a, 12) and a.block_ids == [0, 1, 2]  # still inside block 2
    assert kv.grow(a, 13) and a.block_ids == [0, 1, 2, 3]
    assert not kv.grow(a, 40) and a.block_ids == [0, 1, 2, 3]  # 10 blocks > 8: nothing taken
    assert kv.block_pool.num_free_blocks == 4


def test_a_prefix_hit_shares_the_cached_blocks_and_free_keeps_them_cached() -> None:
    kv = make_kv()
    a = request("a", list(range(1, 11)))  # 10 tokens: blocks 0, 1 full, 2 partial
    compute(kv, a, 10)
    assert a.block_ids == [0, 1, 2] and a.num_inserted_blocks == 2
    b = request("b", list(range(1, 9)) + [99, 98, 97])
    kv.match_prefix(b)
    assert b.block_ids == [0, 1] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert kv.block_pool.ref_count(0) == 3  # a, b and the tree
    compute(kv, b, 3)
    assert b.block_ids == [0, 1, 3]
    kv.free(a)
    assert a.block_ids == [] and kv.block_pool.ref_count(2) == 0 and kv.block_pool.ref_count(0) == 2
    kv.unmatch(b)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert kv.block_pool.ref_count(0) == 1 and kv.num_evictable_blocks() == 2  # only the tree


def test_the_last_token_is_never_matched() -> None:
    kv = make_kv()
    a = request("a", list(range(1, 9)))  # exactly two blocks
    compute(kv, a, 8)
    again = request("again", list(range(1, 9)))
    kv.match_prefix(again)
    assert again.block_ids == [0] and again.num_computed_tokens == 4  # the last block recomputes


def test_eviction_under_pressure_takes_cached_blocks_nobody_holds() -> None:
    kv = make_kv(num_blocks=4)
    a = request("a", list(range(1, 13)))
    compute(kv, a, 12)
    kv.free(a)  # blocks 0-2 cached, none held
    assert kv.block_pool.num_free_blocks == 1 and kv.num_available_blocks() == 4
    b = request("b", [50 + i for i in range(16)])
    assert kv.grow(b, 16)
    assert b.block_ids == [3, 0, 1, 2]  # the free block, then the evicted ones
    assert kv.num_evictable_blocks() == 0


def test_rolling_back_drafts_drops_the_blocks_only_rejected_drafts_reached() -> None:
    kv = make_kv()
    a = request("a", [1, 2, 3], [4])  # 4 tokens, 3 computed; the step verifies 5 drafts
    compute(kv, a, 3)
    assert kv.grow(a, 4 + 5) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 4 + 2  # the last token and two accepted drafts
    a.output_token_ids += [7, 8, 9]  # accepted drafts plus the model's own token
    kv.roll_back_drafts(a)
    assert a.block_ids == [0, 1] and kv.block_pool.ref_count(2) == 0
    assert a.num_inserted_blocks == 1  # block 0 full and cached; block 1 holds 2 of 4


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = make_kv()
    parent = request("p", list(range(1, 11)))
    compute(kv, parent, 10)  # blocks 0, 1 full, 2 holds 2 tokens
    child = request("c", list(range(1, 11)))
    assert kv.fork(parent, child, 10)
    assert child.block_ids == [0, 1, 3] and child.num_computed_tokens == 10
    assert kv.pending_block_copies == [(2, 3)]
    assert kv.block_pool.ref_count(0) == 3 and kv.block_pool.ref_count(2) == 1
    assert kv.take_block_copies() == [(2, 3)] and kv.pending_block_copies == []
    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.ref_count(0) == 1 and kv.block_pool.ref_count(3) == 0  # the tree's


def test_fork_without_a_free_block_recomputes_the_tail() -> None:
    kv = make_kv(num_blocks=3, cached=False)
    parent = request("p", list(range(1, 11)))
    compute(kv, parent, 10)
    child = request("c", list(range(1, 11)))
    assert not kv.fork(parent, child, 10)
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 8
    assert kv.pending_block_copies == []


def test_park_hands_the_blocks_over_and_reserve_refuses_without_headroom() -> None:
    kv = make_kv()
    a = request("a", list(range(1, 11)))
    compute(kv, a, 10)
    a.transfer = TransferState(key="k")
    kv.park(a)
    assert a.block_ids == [] and a.transfer.parked_block_ids == [0, 1, 2] and a.num_inserted_blocks == 0
    assert kv.block_pool.ref_count(2) == 1  # held for the pull
    remote = request("r", list(range(1, 9)) + [60, 61, 62, 63, 64])  # 13 tokens, 8 cached
    assert not kv.reserve(remote, 13, headroom_blocks=5)  # needs 2 more + 5 > 5 available
    assert remote.block_ids == [] and kv.block_pool.ref_count(0) == 2  # the tree, the parked
    assert kv.reserve(remote, 13, headroom_blocks=3)
    assert remote.block_ids == [0, 1, 3, 4] and remote.num_computed_tokens == 8


def test_an_accepted_tree_path_queues_its_slot_copies() -> None:
    kv = make_kv()
    a = request("a", [1, 2, 3], [4])
    compute(kv, a, 4)
    assert kv.grow(a, 4 + 4)
    kv.move_accepted_path(a, 3, [1, 3])  # root at position 3; drafts 1 and 3 accepted
    assert kv.take_slot_copies() == [(5, 4), (7, 5)]
    assert kv.pending_slot_copies == []



def test_a_partitioned_pool_keeps_each_request_and_cached_path_in_one_partition() -> None:
    """DP attention (2 ranks of 6 blocks: ids 0-5 and 6-11): a new request takes the roomiest
    partition and grows there; a request that computed another partition's cached prefix afresh
    does not extend that path (else a later hit would share blocks of both ranks' pools); a full
    partition evicts its own cached blocks only (the other's are older here); preempting the other
    partition's requests frees nothing for a request (``same_pool``)."""
    pool = BlockPool(12, num_partitions=2)
    kv = KVManager(pool, 4, RadixTree(pool, 4, "lru"))
    b = request("b", [50] * 5)
    compute(kv, b, 5)
    a = request("a", list(range(1, 9)) + [30] * 4)
    compute(kv, a, 12)
    c = request("c", list(range(1, 9)) + [70] * 4)
    compute(kv, c, 12)                                   # its prompt's first 8 tokens are cached in a's partition
    assert (b.block_ids, a.block_ids, c.block_ids) == ([0, 1], [6, 7, 8], [2, 3, 4])
    assert not kv.same_pool(a, b) and kv.same_pool(b, c) and kv.same_pool(a, request("new", [1]))
    d = request("d", list(range(1, 9)) + [70] * 4 + [1])
    kv.match_prefix(d)
    assert d.block_ids == [6, 7] and d.num_computed_tokens == 8   # not c's block 4 after them
    kv.unmatch(d)
    f = request("f", [50] * 5)
    kv.match_prefix(f)                                   # b's cached block is now the newest used
    kv.unmatch(f)
    for done in (b, a, c):
        kv.free(done)
    e = request("e", [90] * 24)
    assert kv.grow(e, 24) and e.block_ids == [5, 1, 2, 3, 4, 0]   # partition 0's free, then its cached block
    assert pool.ref_count(8) == 1 and pool.num_free_in(1) == 3     # partition 1's older cache kept
