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


def test_partitions_allocate_and_free_within_their_own_ids():
    """DP attention's pool: 2 partitions of 3 blocks (rank 0's ids 0-2, rank 1's 3-5)."""
    pool = BlockPool(6, num_partitions=2)
    assert pool.allocate(2, partition=1) == [3, 4]
    assert pool.roomiest_partition() == 0 and pool.num_free_in(1) == 1
    assert pool.allocate(2, partition=1) is None   # 3 free blocks in all, one in partition 1
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.roomiest_partition() == 1
    pool.release([4, 1])
    assert pool.num_free_in(0) == 1 and pool.num_free_in(1) == 2 and pool.num_free_blocks == 3
    assert pool.allocate(2, partition=1) == [5, 4] and pool.partition_of(4) == 1
