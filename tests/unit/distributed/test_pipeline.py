"""Pipeline parallel: the stage layout, micro-batch cuts, and PP (and TP x PP) stages on threads
with real gloo point-to-point whose last stage returns the PP=1 logits."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from servelm.distributed.parallel import ParallelContext, join_groups, rank_layout, world_rank
from servelm.model.architectures.common import stage_rename
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.pipeline import split_micro_batches
from tests.tiny_models import make_tiny_hf_model
from tests.unit.distributed.test_parallel import FakeGroup, free_port
from tests.unit.model.conftest import make_runner, make_source


def stage(pp_rank: int, pp_size: int) -> ParallelContext:
    return ParallelContext(pp_rank=pp_rank, pp_size=pp_size, pp_group=FakeGroup() if pp_size > 1 else None)


def test_layer_ranges_are_contiguous_and_cover_every_layer() -> None:
    assert [stage(r, 3).layer_range(8) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    assert [stage(r, 2).layer_range(2) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert stage(0, 1).layer_range(5) == range(0, 5)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        stage(0, 3).layer_range(2)


def test_rank_layout_puts_the_last_stage_on_rank_0() -> None:
    # tp 2 x pp 3: ranks 0, 1 are the last stage (rank 0 = the engine process samples).
    layout = [rank_layout(rank, 2, 3) for rank in range(6)]
    assert layout == [(0, 2), (1, 2), (0, 1), (1, 1), (0, 0), (1, 0)]
    assert [world_rank(tp, pp, 2, 3) for tp, pp in layout] == list(range(6))
    assert stage(1, 2).is_driver and not stage(0, 2).is_driver


def test_micro_batches_are_contiguous_runs_of_sequences() -> None:
    plan = BatchPlan([SequencePlan([i], i, [i]) for i in range(5)])
    cuts = split_micro_batches(plan, 2, None)
    assert [[s.token_ids[0] for s in micro.sequences] for micro in cuts] == [[0, 1, 2], [3, 4]]
    assert [len(m.sequences) for m in split_micro_batches(plan, 2, 2)] == [2, 2, 1]
    assert [len(m.sequences) for m in split_micro_batches(plan, 4, 8)] == [5]
    assert [len(m.sequences) for m in split_micro_batches(BatchPlan([plan.sequences[0]]), 3, None)] == [1]


def test_each_stage_loads_only_its_own_tensors() -> None:
    first, last = stage(0, 2), stage(1, 2)
    assert stage_rename("model.layers.0.mlp.down_proj.weight", first, 2, False) is not None
    assert stage_rename("model.layers.1.mlp.down_proj.weight", first, 2, False) is None
    assert stage_rename("model.norm.weight", first, 2, False) is None
    assert stage_rename("model.norm.weight", last, 2, False) == "model.norm.weight"
    # A tied head on a last stage without the embedding loads the embedding's weight as its own.
    assert stage_rename("model.embed_tokens.weight", last, 2, True) == "lm_head.weight"
    assert stage_rename("model.embed_tokens.weight", last, 2, False) is None
    assert stage_rename("lm_head.weight", last, 2, True) is None
    assert stage_rename("lm_head.weight", first, 2, False) is None


def run_world(tp_size: int, pp_size: int, work: Any) -> list[Any]:
    """``work(parallel)`` on tp x pp ranks (threads of this process, gloo over loopback), by world rank."""
    size = tp_size * pp_size
    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", port, size, True, timeout=timeout, wait_for_workers=False)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            store = master if rank == 0 else dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
            results[rank] = work(join_groups(store, rank, tp_size, pp_size, torch.device("cpu"), 60))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("arch, tp_size, pp_size", [("llama", 1, 2), ("qwen2", 1, 2), ("gemma3_mqa", 1, 3),
                                                    ("llama", 2, 2)])
def test_last_stage_logits_match_pp1(arch: str, tp_size: int, pp_size: int) -> None:
    """Prefill chunks, then a step mixing a decode and a chunk, each cut into micro-batches; the
    last stage's logits (every TP rank's) are PP=1's. Gemma 3's 4 layers on 3 stages split 2/1/1."""
    hf_model = make_tiny_hf_model(arch)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (5, 19, 3)]
    plans = [BatchPlan([SequencePlan(prompts[0], 0, [0, 1], num_logits=5),
                        SequencePlan(prompts[1][:12], 0, [5, 2, 7], num_logits=2),
                        SequencePlan(prompts[2], 0, [3], num_logits=1)]),
             BatchPlan([SequencePlan([7], 5, [0, 1], num_logits=1),
                        SequencePlan(prompts[1][12:], 12, [5, 2, 7, 9, 11], num_logits=7),
                        SequencePlan([9], 3, [3, 4], num_logits=1)])]

    def work(parallel: ParallelContext | None) -> list[torch.Tensor]:
        runner = make_runner(make_source(hf_model), parallel=parallel)
        return [runner.execute(plan) for plan in plans]

    expected = work(None)
    ranks = run_world(tp_size, pp_size, work)
    for rank, rank_logits in enumerate(ranks):
        _, pp_rank = rank_layout(rank, tp_size, pp_size)
        for got, want in zip(rank_logits, expected, strict=True):
            if pp_rank == pp_size - 1:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:
                assert got.shape == (0, want.shape[1])
