"""The float32 few-rows kernel (layers/f32_rows.cpp) and its measured routes (layers/f32_rows.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm.model.layers import f32_rows
from servelm.model.layers.f32_rows import ROW_CLASSES, DenseRoutes, DenseShape
from servelm.model.layers.linear import LinearBase, dense_linear
from servelm.model.layers.moe import FusedMoE, route

kernel = f32_rows.load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"f32_rows kernel not built: {f32_rows.kernel_status()}")


def _forced() -> DenseRoutes:
    assert kernel is not None
    return DenseRoutes(kernel, frozenset(ROW_CLASSES))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("n, k", [(37, 19), (133, 1031), (4, 8)])
def test_the_kernel_route_agrees_with_torch(rows: int, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=generator)
    stacked = torch.randn(2, n, k + 3, generator=generator)   # a weight whose rows are strided
    weight, bias = stacked[1, :, :k], torch.randn(n, generator=generator)
    expected = x.double() @ weight.double().T + bias.double()
    out = dense_linear(x, weight.contiguous(), bias, _forced())
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel.linear(x, weight, None), (expected - bias.double()).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(out, kernel.linear(x, weight.contiguous(), bias))   # the route taken is the kernel


@needs_kernel
def test_rows_past_the_kernel_classes_take_onednn() -> None:
    routes = DenseRoutes(kernel, frozenset({1, 2}))   # type: ignore[arg-type]
    assert routes.takes_kernel(1) and routes.takes_kernel(2)
    assert not routes.takes_kernel(3) and not routes.takes_kernel(33)


@needs_kernel
def test_forced_kernel_routes_in_a_linear_and_the_moe_experts_agree_with_onednn() -> None:
    torch.manual_seed(0)
    linear = LinearBase(24, 40, bias=True)
    nn.init.normal_(linear.weight)
    nn.init.normal_(linear.bias)
    moe = FusedMoE(4, 24, 20, "silu")
    nn.init.normal_(moe.gate_up_proj, std=0.2)
    nn.init.normal_(moe.down_proj, std=0.2)
    x = torch.randn(5, 24)
    routing = route(torch.randn(5, 4), 2, True)
    plain = (linear(x), moe(x, routing))
    moe.dense_routes = (_forced(), _forced())
    linear.dense_routes = _forced()
    forced = (linear(x), moe(x, routing))
    for a, b in zip(plain, forced):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(forced[0], kernel.linear(x, linear.weight, linear.bias))   # the kernel ran


def _fake_time(winner_rows: set[int], calls: list[int]):
    def time_candidates(candidates, **_):
        rows = candidates["kernel"].__self__.x.shape[0]
        calls.append(rows)
        return {"kernel": 1.0, "onednn": 2.0} if rows in winner_rows else {"kernel": 2.0, "onednn": 1.0}
    return time_candidates


@needs_kernel
def test_the_measured_winner_is_taken_and_the_table_is_reused(tmp_path, monkeypatch) -> None:
    import servelm.model.timing as timing
    calls: list[int] = []
    monkeypatch.setattr(timing, "time_candidates", _fake_time({1, 2, 4}, calls))
    shape = DenseShape(40, 24)
    routes, _ = f32_rows.build_routes([shape], None, tmp_path, working_bytes=1)
    assert routes[shape].kernel_classes == {1, 2, 4} and sorted(calls) == list(ROW_CLASSES)
    calls.clear()
    routes, source = f32_rows.build_routes([shape], None, tmp_path, working_bytes=1)
    assert calls == [] and routes[shape].kernel_classes == {1, 2, 4} and "6 cells cached" in source


@needs_kernel
def test_apply_gives_each_float32_weight_its_routes(tmp_path, monkeypatch) -> None:
    import servelm.model.timing as timing
    monkeypatch.setattr(timing, "time_candidates", _fake_time(set(ROW_CLASSES), []))
    import servelm.model.routes as routes_module
    monkeypatch.setattr(routes_module, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(f32_rows, "MIN_WEIGHT_BYTES", 0)   # tiny weights keep oneDNN unmeasured
    model = nn.ModuleDict({"linear": LinearBase(24, 40, bias=False), "moe": FusedMoE(4, 24, 20, "silu"),
                           "bf16": LinearBase(24, 40, bias=False, dtype=torch.bfloat16)})
    summary = f32_rows.apply_dense_routes(model)
    assert summary is not None and set(summary["routes"]) == {"f32 24x40", "f32 20x24"}
    assert model["linear"].dense_routes is not None and model["bf16"].dense_routes is None
    assert all(r is not None and r.kernel_classes == set(ROW_CLASSES) for r in model["moe"].dense_routes)
    monkeypatch.setattr(f32_rows, "MIN_WEIGHT_BYTES", 1 << 20)
    assert f32_rows.apply_dense_routes(nn.ModuleDict({"linear": LinearBase(24, 40, bias=False)})) is None
