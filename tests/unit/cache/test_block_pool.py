import pytest

from servelm.cache.block_pool import BlockPool


def test_allocate_all_or_nothing_and_release_order():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    pool.release([1])
    assert pool.allocate(2) == [3, 1]
    assert pool.num_free_blocks == 0


def test_ref_counts_share_and_free_at_zero():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.retain(blocks)
    assert pool.ref_count(blocks[0]) == 2
    pool.release(blocks)
    assert pool.num_free_blocks == 1
    pool.release(blocks)
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.release(blocks)
