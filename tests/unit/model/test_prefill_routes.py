"""The prefill attention's routes chosen by measurement (servelm/model/attention/prefill_routes.py):
a fake timing that makes a route win makes the backend take it, every route computes the same
attention, the table is cached per key and reused, and over the budget the defaults serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import prefill_attention, prefill_gemm, prefill_routes
from servelm.model.attention.prefill_routes import (DEFAULT_ORDER, QUERY_CLASSES, PrefillRouting, PrefillShape,
                                                    build_routing, valid_routes)


def _fake_timer(winner: str, calls: list | None = None):
    """Times nothing: ``winner`` takes 1 us, the others 10, 20, ..."""
    def timer(candidates):
        if calls is not None:
            calls.append(sorted(candidates))
        others = iter(range(10, 100, 10))
        return {route: 1.0 if route == winner else float(next(others)) for route in candidates}
    return timer


def _shape(dtype: torch.dtype = torch.float32) -> PrefillShape:
    return PrefillShape(4, 2, 32, dtype, dtype)


def _backend_run(routing: PrefillRouting, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """A fresh 23-token prompt and a 9-token chunk after 13 cached tokens through torch_native with
    ``routing``; returns (output, the routes that ran)."""
    from servelm.model.attention import Attention, get_attention_backend
    from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan
    from servelm.model.kv_cache import KVCache

    torch.manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 32
    cache = KVCache(1, 24, block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    cache.k_caches[0].normal_()
    cache.v_caches[0].normal_()
    plan = BatchPlan([SequencePlan(list(range(9)), 13, list(range(6))),
                      SequencePlan(list(range(23)), 0, list(range(10, 16)))])
    backend = get_attention_backend("torch_native")
    backend.prefill_routing = routing
    batch = ForwardBatch.build(plan, block_size=block_size, device=torch.device("cpu"), kv_cache=cache,
                               attention=backend)
    layer = Attention(0, num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    q = torch.randn(32, num_heads, head_dim).to(dtype)
    k = torch.randn(32, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(32, num_kv_heads, head_dim).to(dtype)
    ran: list[str] = []
    for module, name, route in ((prefill_attention, "attend", "kernel"), (prefill_gemm, "attend", "gemm"),
                                (F, "scaled_dot_product_attention", "sdpa")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _r=route, **kw: ran.append(_r) or _o(*a, **kw))
    out = layer(q, k, v, batch)
    monkeypatch.undo()
    return out, ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_measured_winner_is_the_route_the_backend_takes(tmp_path, monkeypatch, dtype) -> None:
    """Each valid route in turn made fastest by a fake timing: the table ranks it first and the
    backend's prefill runs it; all of them give the same attention (to the dtype's rounding)."""
    valid = valid_routes(_shape(dtype))
    assert "sdpa" in valid and len(valid) >= 2, valid          # at least the GEMMs and SDPA on any CPU
    outputs = {}
    for winner in valid:
        routing = build_routing([_shape(dtype)], None, tmp_path, fresh=True, timer=_fake_timer(winner))
        assert all(routing.cells[f"{_shape(dtype).name} {c}"][0] == winner for c in QUERY_CLASSES)
        assert set(routing.summary([_shape(dtype)])["routes"][_shape(dtype).name].values()) == {winner}
        outputs[winner], ran = _backend_run(routing, dtype, monkeypatch)
        assert ran and set(ran) == {winner}, (winner, ran)
    reference = outputs["sdpa"].float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for winner, out in outputs.items():
        torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance, msg=winner)


@pytest.mark.parametrize("n", [37, 300])   # 300: SDPA in query tiles (torch_native.SDPA_TILE_QUERIES)
def test_the_synthetic_calls_timed_compute_the_same_attention(n: int) -> None:
    shape = _shape()
    synthetic = prefill_routes._Synthetic(shape, n)
    results = {route: getattr(synthetic, route)().clone() for route in valid_routes(shape)}
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    scores = torch.einsum("qhd,khd->hqk", synthetic.q, synthetic.k_cache.repeat_interleave(2, 1)) * synthetic.scale
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1),
                            synthetic.v_cache.repeat_interleave(2, 1))
    assert len(results) >= 2
    for route, out in results.items():
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=route)


def test_the_table_is_measured_once_per_key_and_reused(tmp_path, monkeypatch) -> None:
    calls: list = []
    first = build_routing([_shape()], None, tmp_path, timer=_fake_timer("sdpa", calls))
    assert len(calls) == len(QUERY_CLASSES) and "measured" in first.source

    def fail(candidates):
        raise AssertionError("a cached cell was measured again")
    again = build_routing([_shape()], None, tmp_path, timer=fail)
    assert again.cells == first.cells and f"{len(QUERY_CLASSES)} cells cached, 0 measured" in again.source
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)     # another key: measured afresh
    calls.clear()
    other = build_routing([_shape()], None, tmp_path, timer=_fake_timer("gemm", calls))
    assert len(calls) == len(QUERY_CLASSES) and other.cells[f"{_shape().name} 16"][0] == "gemm"


def test_over_the_budget_the_defaults_serve(tmp_path) -> None:
    routing = build_routing([_shape()], 0.0, tmp_path, timer=_fake_timer("sdpa"))
    assert routing.cells == {} and "budget" in routing.source
    assert routing.order(4, 2, 32, torch.float32, torch.float32, 100) == DEFAULT_ORDER


def test_a_call_takes_the_smallest_class_at_or_above_its_queries() -> None:
    shape = _shape()
    routing = PrefillRouting({f"{shape.name} 16": ["sdpa", "gemm"], f"{shape.name} 512": ["gemm", "sdpa"]})
    order = lambda queries: routing.order(4, 2, 32, torch.float32, torch.float32, queries)  # noqa: E731
    assert order(2)[0] == order(16)[0] == "sdpa"
    assert order(17) == DEFAULT_ORDER                           # class 64 not measured: the defaults
    assert order(512)[0] == order(4000)[0] == "gemm"
    assert set(order(4000)) == set(DEFAULT_ORDER)               # completed with the routes not measured
