"""The shared-memory all-reduce: exact sums on every rank, buffer reuse across calls, no hang."""

from __future__ import annotations

import threading

import pytest
import torch

from servelm.distributed import shm_allreduce
from servelm.distributed.shm_allreduce import ShmAllReduce

pytestmark = pytest.mark.skipif(not shm_allreduce.is_supported(torch.device("cpu")),
                                reason="x86-64 Linux only")


def test_every_rank_gets_the_sum_over_many_calls() -> None:
    world_size, num_calls = 3, 40
    path = shm_allreduce.create_segment(world_size, slot_bytes=4096)
    try:
        inputs = [[torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * call + rank))
                   for call in range(num_calls)] for rank in range(world_size)]
        results: list[list[torch.Tensor]] = [[] for _ in range(world_size)]

        def rank_main(rank: int) -> None:
            reducer = ShmAllReduce(path, rank, world_size, timeout_s=30, slot_bytes=4096)
            for call in range(num_calls):
                results[rank].append(reducer.all_reduce(inputs[rank][call].clone()))
            reducer.close()

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for call in range(num_calls):
            expected = inputs[0][call] + inputs[1][call] + inputs[2][call]
            for rank in range(world_size):
                assert torch.equal(results[rank][call], expected), (rank, call)
    finally:
        shm_allreduce.unlink_segment(path, world_size)


def test_a_missing_peer_raises_instead_of_hanging() -> None:
    path = shm_allreduce.create_segment(2, slot_bytes=1024)
    try:
        def peer_is_dead() -> None:
            raise RuntimeError("rank 1 is gone")

        reducer = ShmAllReduce(path, 0, 2, timeout_s=30, slot_bytes=1024, check_peers=peer_is_dead)
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            reducer.all_reduce(torch.ones(3))
        reducer.close()
        alone = ShmAllReduce(path, 0, 2, timeout_s=0.2, slot_bytes=1024)
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not arrive within 0.2 s"):
            alone.all_reduce(torch.ones(3))
        alone.close()
        assert not ShmAllReduce(path, 0, 2, timeout_s=1, slot_bytes=1024).fits(torch.ones(300))
    finally:
        shm_allreduce.unlink_segment(path, 2)
