"""ParallelContext partitions, and a TP=2 model (two ranks on threads, real gloo) against TP=1."""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from servelm.distributed.parallel import HeadShard, ParallelContext, Shard
from servelm.model.forward_batch import BatchPlan, SequencePlan
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import make_runner, make_source


class FakeGroup:
    """Only for the partition tests: they never run a collective."""


def context(rank: int, size: int) -> ParallelContext:
    return ParallelContext(tp_rank=rank, tp_size=size, group=FakeGroup() if size > 1 else None)


def test_split_is_contiguous_and_covers_uneven_sizes() -> None:
    assert [context(r, 3).split(10) for r in range(3)] == [Shard(0, 4), Shard(4, 3), Shard(7, 3)]
    assert context(0, 1).split(7) == Shard(0, 7)
    assert [context(r, 4).padded_split(10) for r in range(4)] == [
        Shard(0, 3), Shard(3, 3), Shard(6, 3), Shard(9, 3)]


def test_head_shards() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads on 2 ranks -> whole GQA groups, 2 + 1.
    assert [context(r, 2).head_shard(9, 3) for r in range(2)] == [
        HeadShard(Shard(0, 6), Shard(0, 2)), HeadShard(Shard(6, 3), Shard(2, 1))]
    # Gemma 3 270M: 4 query heads, one KV head replicated on both ranks.
    assert [context(r, 2).head_shard(4, 1) for r in range(2)] == [
        HeadShard(Shard(0, 2), Shard(0, 1)), HeadShard(Shard(2, 2), Shard(0, 1))]
    # Qwen2.5-0.5B: 14 / 2 on 2 ranks.
    assert context(1, 2).head_shard(14, 2) == HeadShard(Shard(7, 7), Shard(1, 1))
    # 4 ranks over 2 KV heads with 2 query heads each: each KV head on 2 ranks, one query head each.
    assert context(3, 4).head_shard(4, 2) == HeadShard(Shard(3, 1), Shard(1, 1))
    with pytest.raises(ValueError, match="cannot split 4 query heads over 1 KV heads"):
        context(0, 3).head_shard(4, 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(size: int, work: Any) -> list[Any]:
    """Run ``work(parallel)`` on ``size`` ranks (threads of this process, gloo over loopback)."""
    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", port, size, True, timeout=timeout, wait_for_workers=False)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            store = master if rank == 0 else dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
            results[rank] = work(ParallelContext(tp_rank=rank, tp_size=size, group=group))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("arch, tp_size", [("llama", 2), ("qwen2", 2), ("llama_uneven", 2),
                                           ("gemma3_mqa", 2), ("llama_uneven", 3)])
def test_tp_logits_match_tp1(arch: str, tp_size: int) -> None:
    """Every rank of a TP model returns the TP=1 logits (prefill chunks, then a decode step). At
    tp 3 every split is uneven: MLP columns 43/43/42, vocabulary 320 padded to 3 x 107."""
    hf_model = make_tiny_hf_model(arch)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (5, 19)]
    plans = [BatchPlan([SequencePlan(prompts[0], 0, [0, 1], num_logits=5),
                        SequencePlan(prompts[1][:12], 0, [5, 2, 7], num_logits=2)]),
             BatchPlan([SequencePlan([7], 5, [0, 1], num_logits=1),
                        SequencePlan(prompts[1][12:], 12, [5, 2, 7, 9, 11], num_logits=7)])]

    def work(parallel: ParallelContext | None) -> list[torch.Tensor]:
        runner = make_runner(make_source(hf_model), parallel=parallel)
        return [runner.execute(plan) for plan in plans]

    expected = work(None)
    ranks = run_ranks(tp_size, work)
    for rank_logits in ranks:
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
