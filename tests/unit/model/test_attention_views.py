"""torch_native attention views: sliding layers read only their window, decode groups exactly."""

from __future__ import annotations

import torch

from servelm.model.attention import get_attention_backend
from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan


def build(plan: BatchPlan) -> ForwardBatch:
    return ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"),
                              attention=get_attention_backend("torch_native"))


def test_sliding_view_reads_only_the_window() -> None:
    blocks = list(range(10, 20))   # 40 slots, position p -> slot 40 + p
    batch = build(BatchPlan([SequencePlan([1], 30, blocks), SequencePlan([2], 5, blocks[:2])]))
    (decodes,) = batch.attn_metadata.groups
    full, window = decodes.view(None), decodes.view(8)
    assert full.num_columns == 31
    assert window.num_columns == 8
    slots = window.slots.view(2, 8)
    assert slots[0].tolist() == [40 + p for p in range(23, 31)]      # positions 23..30
    assert slots[1, :6].tolist() == [40 + p for p in range(6)]       # the whole short context
    assert window.mask[1, 0, 0].tolist() == [True] * 6 + [False] * 2


def test_prefill_window_starts_at_first_query_minus_window() -> None:
    blocks = list(range(10))
    batch = build(BatchPlan([SequencePlan([1, 2, 3], 20, blocks)]))
    (group,) = batch.attn_metadata.groups
    view = group.view(4)
    assert view.num_columns == 6                                      # positions 17..22
    positions = torch.arange(17, 23)
    expected = torch.stack([(positions <= q) & (positions > q - 4) for q in (20, 21, 22)])
    assert torch.equal(view.mask[0, 0], expected)


def test_decode_window_longer_than_every_context_shares_the_full_view() -> None:
    blocks = list(range(10, 20))
    batch = build(BatchPlan([SequencePlan([1], 30, blocks), SequencePlan([2], 5, blocks[:2])]))
    (decodes,) = batch.attn_metadata.groups
    full = decodes.view(None)
    assert decodes.view(31) is full                 # context 31: position 30 sees 0..30 either way
    assert decodes.view(30) is not full             # position 30 no longer sees position 0
    assert decodes.view(30).num_columns == 30
    built = full.slots.clone(), full.mask.clone()
    assert torch.equal(decodes._build_view(31).slots, built[0])
    assert torch.equal(decodes._build_view(31).mask, built[1])
    (prefill,) = build(BatchPlan([SequencePlan([1, 2, 3], 4, blocks)])).attn_metadata.groups
    assert prefill.view(64) is not prefill.view(None)   # multi-token groups keep their own (tiles)


def test_a_long_context_gets_a_group_of_its_own_so_short_ones_are_not_padded_to_it() -> None:
    from servelm.model.attention import paged_decode
    from servelm.model.attention.torch_native import context_buckets
    assert context_buckets([0, 1, 2], [5, 900, 7]) == [[0, 2], [1]]
    assert context_buckets([0, 1], [300, 500]) == [[0, 1]]          # within 2x: one group, given order
    assert context_buckets([1, 0], [40, 200]) == [[1, 0]]           # 5x but only 160 columns apart
    blocks = list(range(300))
    batch = build(BatchPlan([SequencePlan([1], 4, blocks[:2]), SequencePlan([2], 900, blocks[:226]),
                             SequencePlan([3], 6, blocks[:2]), SequencePlan([4, 5], 3, blocks[:2]),
                             SequencePlan([6, 7], 800, blocks[:201])]))
    groups = batch.attn_metadata.groups
    columns = sorted(group.view(None).num_columns for group in groups)
    if paged_decode.load_kernel() is None:     # SDPA pads a decode group's K/V to its longest context
        assert columns == [5, 7, 802, 901]
    else:                                      # the kernel reads each decode's own span
        assert columns == [5, 802, 901]


def test_long_causal_sdpa_calls_run_in_query_tiles_over_the_columns_they_see(monkeypatch) -> None:
    """A prompt continuing a cached prefix beside a fresh one, global and sliding layers, on the SDPA
    route: in tiles of SDPA_TILE_QUERIES queries (each over the columns some query of it sees, the
    causal triangle's far side and the window's near side left out) the output equals one whole call."""
    import torch.nn.functional as F

    from servelm.model.attention import Attention, torch_native
    from servelm.model.attention.prefill_routes import QUERY_CLASSES, PrefillRouting, PrefillShape, cell_name
    from servelm.model.kv_cache import KVCache

    torch.manual_seed(5)
    num_heads, num_kv_heads, head_dim, window = 6, 2, 16, 12
    cache = KVCache(1, 40, 4, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.k_caches[0].normal_()
    cache.v_caches[0].normal_()
    shape = PrefillShape(num_heads, num_kv_heads, head_dim, torch.float32, torch.float32)
    plan = BatchPlan([SequencePlan(list(range(40)), 13, list(range(14))),
                      SequencePlan(list(range(37)), 0, list(range(20, 30)))])
    q = torch.randn(77, num_heads, head_dim)
    k = torch.randn(77, num_kv_heads, head_dim)
    v = torch.randn(77, num_kv_heads, head_dim)

    def run(tile_rows: int, sliding: int | None) -> tuple[torch.Tensor, int, object]:
        monkeypatch.setattr(torch_native, "SDPA_TILE_QUERIES", tile_rows)
        backend = get_attention_backend("torch_native")
        backend.prefill_routing = PrefillRouting({cell_name(shape, c): ["sdpa"] for c in QUERY_CLASSES})
        batch = ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"), kv_cache=cache,
                                   attention=backend)
        calls = []
        sdpa = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[1].shape) or sdpa(*a, **kw))
        layer = Attention(0, num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window=sliding)
        out = layer(q, k, v, batch)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        (group,) = batch.attn_metadata.groups
        return out, len(calls), group.view(sliding)

    for sliding in (None, window):
        whole, whole_calls, _ = run(10 ** 6, sliding)
        tiled, tiled_calls, view = run(8, sliding)
        assert whole_calls == 1 and tiled_calls == 5                 # 40 query rows: 5 tiles of 8
        torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=1e-5)
        bounds = view.query_tiles(8)
        assert [(q0, q1) for q0, q1, _, _ in bounds] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
        assert bounds[0][3] < view.num_columns                       # the first tile skips the later columns
    # one sequence (no padding rows), queries at positions 13..52: a window of 12 reads positions 2..52 (column
    # c = position 2 + c), query i sees columns i .. i + 11
    (alone,) = build(BatchPlan([SequencePlan(list(range(40)), 13, list(range(14)))])).attn_metadata.groups
    assert alone.view(window).query_tiles(8) == [(0, 8, 0, 19), (8, 16, 8, 27), (16, 24, 16, 35),
                                                 (24, 32, 24, 43), (32, 40, 32, 51)]
    assert alone.view(None).query_tiles(16) == [(0, 16, 0, 29), (16, 32, 0, 45), (32, 40, 0, 53)]
