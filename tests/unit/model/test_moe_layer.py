"""The fused MoE layer against a plain per-token reference: routing (softmax, top-k, renormalised or
not), grouping by expert, and the tensor-parallel split of each expert's intermediate dimension."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from servelm.distributed.parallel import ParallelContext
from servelm.model.layers.moe import ExpertGroups, FusedMoE, route

E, H, I, K = 6, 16, 12, 2


def reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """One token and one chosen expert at a time: sum_k w_k * down_e(silu(gate_e x) * up_e x)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def full_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=generator), torch.randn(E, H, I, generator=generator)


def test_route_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    plain, renormalised = route(logits, 2, False), route(logits, 2, True)
    assert plain.expert_ids.tolist() == [[1, 2]] == renormalised.expert_ids.tolist()
    torch.testing.assert_close(plain.weights, torch.softmax(logits, -1)[:, [1, 2]])
    torch.testing.assert_close(renormalised.weights, torch.softmax(logits[:, [1, 2]], -1))  # Mixtral's form


def test_groups_sort_rows_by_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 5], [3, 1]])
    groups = ExpertGroups.build(ids, E)
    assert groups.rows_per_expert() == [2, 1, 0, 2, 0, 1]
    assert groups.token_rows.tolist() == [0, 1, 2, 0, 2, 1]   # expert 0: tokens 0, 1; 1: 2; 3: 0, 2; 5: 1


def test_fused_equals_per_token_reference_with_idle_experts() -> None:
    gate_up, down = full_weights()
    layer = FusedMoE(E, H, I, "silu")
    layer.weight_loader(layer.gate_up_proj, gate_up)
    layer.weight_loader(layer.down_proj, down)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    logits[:, 4] = -1e9   # expert 4 gets no rows
    routing = route(logits, K, True)
    torch.testing.assert_close(layer(x, routing), reference(x, gate_up, down, routing.weights, routing.expert_ids))
    assert layer(x[:0], route(logits[:0], K, True)).shape == (0, H)


class _SumLater:
    """A fake process group: all_reduce leaves each rank's partial output as it is (summed by the test)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> SimpleNamespace:
        return SimpleNamespace(wait=lambda: None)


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    """Each of 2 ranks holds every expert's half of the intermediate dimension, loaded from the
    per-expert tensors; their partial outputs sum to one rank's output."""
    gate_up, down = full_weights(3)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(4))
    routing = route(torch.randn(7, E, generator=torch.Generator().manual_seed(5)), K, False)
    partials = []
    for rank in range(2):
        layer = FusedMoE(E, H, I, "silu", parallel=ParallelContext(tp_rank=rank, tp_size=2, group=_SumLater()))
        for e in range(E):
            gate, up = gate_up[e].chunk(2)
            layer.weight_loader(layer.gate_up_proj, gate, (e, "gate"))
            layer.weight_loader(layer.gate_up_proj, up, (e, "up"))
            layer.weight_loader(layer.down_proj, down[e], (e, "down"))
        assert layer.missing_parts() == [] and layer.gate_up_proj.shape == (E, I, H)
        partials.append(layer(x, routing))
    torch.testing.assert_close(partials[0] + partials[1],
                               reference(x, gate_up, down, routing.weights, routing.expert_ids))
