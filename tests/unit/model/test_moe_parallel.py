"""Expert parallelism on two ranks (threads, real gloo all-to-all): the dispatch and combine equal
one process's FusedMoE, with redundant replicas and after a rebalance; and the rebalancing plan
lowers the busiest rank's share of a skewed load; the same for expert groups smaller than TP, with
the expert load's counts per logical expert and per group."""

from __future__ import annotations

import dataclasses

import torch

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.moe_block import RoutedExpertsBlock
from servelm.model.expert_load import EplbSettings, ExpertLoad
from servelm.model.layers.moe import FusedMoE, route
from servelm.model.layers.moe_parallel import ExpertGroupMoE, ExpertParallelMoE, ExpertPlacement, rebalance
from tests.unit.distributed.test_parallel import run_ranks
from tests.unit.model.test_moe_layer import E, H, I, K, full_weights

NUM_TOKENS = 11


def skewed_routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and router logits that send most rows to experts 2 and 3 (both on rank 0 in
    the initial placement, which replicates experts 0 and 1 on rank 1)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=generator)
    logits[:, 2:4] += 3.0
    return torch.randn(num_tokens, H, generator=generator), logits


def single_process(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    gate_up, down = full_weights()
    layer = FusedMoE(E, H, I, "silu")
    layer.weight_loader(layer.gate_up_proj, gate_up)
    layer.weight_loader(layer.down_proj, down)
    return layer(x, route(logits, K, True))


def expert_parallel_layer(parallel: ParallelContext, num_redundant: int, per_expert: bool) -> ExpertParallelMoE:
    parallel = dataclasses.replace(parallel, ep_size=parallel.tp_size, num_redundant_experts=num_redundant)
    layer = ExpertParallelMoE(E, H, I, "silu", parallel=parallel)
    gate_up, down = full_weights()
    if per_expert:
        for e in range(E):
            gate, up = gate_up[e].chunk(2)
            layer.weight_loader(layer.gate_up_proj, gate, (e, "gate"))
            layer.weight_loader(layer.gate_up_proj, up, (e, "up"))
            layer.weight_loader(layer.down_proj, down[e], (e, "down"))
    else:
        layer.weight_loader(layer.gate_up_proj, gate_up)
        layer.weight_loader(layer.down_proj, down)
    assert layer.missing_parts() == []
    return layer


def test_replicated_tokens_equal_one_process_before_and_after_a_rebalance() -> None:
    """EP=2 with 2 redundant slots (4 slots a rank): every rank returns one process's output, from
    either checkpoint form, and again after moving to a placement planned from a skewed load."""
    x, logits = skewed_routing(NUM_TOKENS, 1)
    expected = single_process(x, logits)
    routing = route(logits, K, True)

    def work(parallel: ParallelContext) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        layer = expert_parallel_layer(parallel, 2, per_expert=parallel.tp_rank == 0)
        assert layer.gate_up_proj.shape == (4, 2 * I, H)
        before = layer(x, routing)
        load = torch.bincount(routing.expert_ids.reshape(-1), minlength=E).tolist()
        layer.apply_placement(rebalance([float(n) for n in load], 2, 2))
        return before, layer(x, routing), layer.placement.rank_experts(parallel.tp_rank)

    ranks = run_ranks(2, work)
    for before, after, _ in ranks:
        torch.testing.assert_close(before, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
    held = [experts for _, _, experts in ranks]
    assert held != [(0, 1, 2, 3), (4, 5, 0, 1)]   # the placement moved
    assert {2, 3} <= set(held[0]) and {2, 3} <= set(held[1])   # the two busy experts on both ranks


def test_rank_local_tokens_dispatch_and_combine() -> None:
    """Each rank with its own tokens (as under DP attention): the all-to-all sends rows to the other
    rank's experts and back; each rank gets one process's output for its tokens."""
    inputs = [skewed_routing(5, 2), skewed_routing(3, 4)]

    def work(parallel: ParallelContext) -> torch.Tensor:
        layer = expert_parallel_layer(parallel, 0, per_expert=True)
        x, logits = inputs[parallel.tp_rank]
        return layer.dispatch_and_combine(x, route(logits, K, True), 0)

    for got, (x, logits) in zip(run_ranks(2, work), inputs):
        torch.testing.assert_close(got, single_process(x, logits), atol=1e-5, rtol=1e-5)


def test_rebalance_lowers_the_busiest_ranks_share() -> None:
    """Experts 2 and 3 take most rows: in the initial placement both sit on rank 0; the plan
    replicates them on both ranks, and the rows each rank computes (the real dispatch) even out."""
    _, logits = skewed_routing(400, 5)
    ids = route(logits, K, True).expert_ids
    load = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    initial = ExpertPlacement.initial(E, 2, 2)
    planned = rebalance([float(n) for n in load], 2, 2)
    before, after = initial.rows_per_rank(ids), planned.rows_per_rank(ids)
    assert sum(before) == sum(after) == 400 * K
    assert max(before) / sum(before) > 0.7 and max(after) / sum(after) < 0.55, (before, after)


def test_placement_rules() -> None:
    placement = ExpertPlacement.initial(6, 2, 2)
    assert placement.rank_experts(0) == (0, 1, 2, 3) and placement.rank_experts(1) == (4, 5, 0, 1)
    # expert 0 has slots 0 and 6: token + choice picks the replica, so its first-choice rows alternate
    assert placement.to_physical(torch.tensor([[0, 1], [0, 5], [0, 2]])).tolist() == [[0, 7], [6, 5], [0, 2]]
    for bad in ((6, 1, 2), (6, 0, 4)):
        try:
            ExpertPlacement.initial(*bad)
        except ValueError as error:
            assert "--ep-num-redundant-experts" in str(error)
        else:
            raise AssertionError(bad)


def test_expert_groups_smaller_than_tp_equal_one_process() -> None:
    """--tp 4 --ep 2: two groups of two ranks; a group holds half the experts, each of its ranks half
    their intermediate columns; after the all-reduce every rank has one process's output (ranks 0
    and 3 load per-expert tensors, 1 and 2 the fused stacks)."""
    x, logits = skewed_routing(NUM_TOKENS, 3)
    expected = single_process(x, logits)
    routing = route(logits, K, True)

    def work(parallel: ParallelContext) -> tuple[torch.Tensor, tuple[int, ...]]:
        layer = ExpertGroupMoE(E, H, I, "silu", parallel=dataclasses.replace(parallel, ep_size=2))
        gate_up, down = full_weights()
        if parallel.tp_rank in (0, 3):
            for e in range(E):
                gate, up = gate_up[e].chunk(2)
                for part, tensor in (("gate", gate), ("up", up)):
                    layer.weight_loader(layer.gate_up_proj, tensor, (e, part))
                layer.weight_loader(layer.down_proj, down[e], (e, "down"))
        else:
            layer.weight_loader(layer.gate_up_proj, gate_up)
            layer.weight_loader(layer.down_proj, down)
        assert layer.missing_parts() == []
        return layer(x, routing), (layer.placement.rank_experts(layer.group)[0], *layer.gate_up_proj.shape)

    ranks = run_ranks(4, work)
    for out, _ in ranks:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert [shape for _, shape in ranks] == [(0, E // 2, I, H)] * 2 + [(E // 2, E // 2, I, H)] * 2


def test_expert_groups_count_rows_and_rebalance_without_changing_outputs() -> None:
    """--tp 4 --ep 2 with 2 redundant slots (4 slots a group: experts 0-3 and 4, 5, 0, 1, each split
    over the group's two ranks by columns) and EPLB every 2 passes on a load skewed to experts 2
    and 3 (both in group 0 only): every pass counts each token's K rows once per logical expert
    (one process's bincount) and once per group, where the group computes them; the rebalance
    puts the busy experts in both groups, every rank's output stays one process's, and group 0's
    share of the rows drops."""
    x, logits = skewed_routing(40, 6)
    expected = single_process(x, logits)
    routing = route(logits, K, True)
    per_expert = torch.bincount(routing.expert_ids.reshape(-1), minlength=E)

    def work(parallel: ParallelContext) -> tuple[list[torch.Tensor], list[dict], tuple[int, ...]]:
        parallel = dataclasses.replace(parallel, ep_size=2, num_redundant_experts=2)
        block = RoutedExpertsBlock(E, H, I, "silu", parallel)
        gate_up, down = full_weights()
        block.experts.weight_loader(block.experts.gate_up_proj, gate_up)
        block.experts.weight_loader(block.experts.down_proj, down)
        load = ExpertLoad([(3, block)], parallel, None, EplbSettings(2, 1.0, 2))
        outs, totals = [], []
        for _ in range(3):
            outs.append(block.run_experts(x, routing))
            load.after_pass()
            totals.append(load.totals())
        return outs, totals, block.experts.placement.physical_to_logical

    ranks = run_ranks(4, work)
    for outs, _, _ in ranks:
        for out in outs:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    _, totals, placement = ranks[0]
    assert all(rank_totals == totals for _, rank_totals, _ in ranks)
    assert [t["expert_rows"] for t in totals] == [[(per_expert * n).tolist()] for n in (1, 2, 3)]
    first, second, third = (t["ep_rank_rows"][0] for t in totals)
    third = [c - b for c, b in zip(third, second)]   # the rows of the pass after the rebalance
    assert sum(first) == sum(third) == 40 * K and second == [2 * n for n in first]
    assert totals[1]["eplb_rebalances"] == 1 and placement != (0, 1, 2, 3, 4, 5, 0, 1)
    assert {2, 3} <= set(placement[:4]) and {2, 3} <= set(placement[4:])
    assert first[0] / sum(first) > 0.7 and max(third) / sum(third) < 0.6, (first, third)
