"""prefill_gemm tiles against SDPA with an explicit causal (and sliding-window) mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import prefill_gemm
from servelm.model.layers import fused


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
              scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, Hkv, D] from position 0."""
    q_positions = torch.arange(start, start + q.shape[0])[:, None]
    k_positions = torch.arange(k.shape[0])[None, :]
    visible = k_positions <= q_positions
    if window is not None:
        visible &= k_positions > q_positions - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("is_fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_tiles_match_sdpa(monkeypatch: pytest.MonkeyPatch, window: int | None, dtype: torch.dtype,
                          is_fused: bool) -> None:
    """Both softmax paths: fused_ops.cpp's causal_softmax and the torch ops with the tile's bias."""
    if is_fused and fused.load_kernel() is None:
        pytest.skip(f"no fused kernel: {fused.kernel_status()}")
    monkeypatch.setattr(prefill_gemm, "TILE_QUERIES", 8)   # several tiles per sequence
    monkeypatch.setattr(prefill_gemm, "FUSED_SOFTMAX", is_fused)
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, scale = 6, 2, 16, 0.25
    sequences = [(0, 21), (13, 9), (30, 1)]                 # (start position, queries)
    qs, ks, vs = [], [], []
    for start, n in sequences:
        qs.append(torch.randn(n, num_heads, head_dim, dtype=dtype))
        ks.append(torch.randn(start + n, num_kv_heads, head_dim, dtype=dtype))
        vs.append(torch.randn(start + n, num_kv_heads, head_dim, dtype=dtype))
    # the group's gathered context: each sequence's columns from its first visible position
    firsts = [0 if window is None else max(0, start - window + 1) for start, _ in sequences]
    columns = max(start + n - first for (start, n), first in zip(sequences, firsts))
    k_context = torch.zeros(len(sequences) * columns, num_kv_heads, head_dim, dtype=dtype)
    v_context = torch.zeros_like(k_context)
    for i, ((start, n), first) in enumerate(zip(sequences, firsts)):
        k_context[i * columns:i * columns + start + n - first] = ks[i][first:]
        v_context[i * columns:i * columns + start + n - first] = vs[i][first:]
    row_starts = [0, 21, 30]
    tiles = prefill_gemm.build_tiles(row_starts, [n for _, n in sequences], [s for s, _ in sequences],
                                     firsts, columns, window, num_heads // num_kv_heads)
    assert len(tiles) == 3 + 2 + 1
    q = torch.cat(qs)
    out = torch.full((q.shape[0], num_heads, head_dim), float("nan"), dtype=dtype)
    prefill_gemm.attend(q, k_context, v_context, tiles, scale, out)
    expected = torch.cat([reference(qs[i], ks[i], vs[i], start, window, scale)
                          for i, (start, _) in enumerate(sequences)])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_tiles_skip_columns_no_query_sees() -> None:
    tiles = prefill_gemm.build_tiles([0], [512], [512], [1], 1018, 512, 4)
    assert [(t.column_start, t.num_columns) for t in tiles] == [(0, 639), (128, 639), (256, 639), (384, 639)]   # window + 127 each
    full = prefill_gemm.build_tiles([0], [512], [0], [0], 512, None, 4)
    assert [t.num_columns for t in full] == [128, 256, 384, 512]


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_bf16_probs_times_v_in_place_is_the_transposed_copy_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch, num_kv_heads: int) -> None:
    """bf16 takes ``torch.mm`` on V as it lies in the (head-strided) context; the result must be
    the float32-path arithmetic (a transposed copy through oneDNN's linear) to the last bit."""
    monkeypatch.setattr(prefill_gemm, "TILE_QUERIES", 16)
    torch.manual_seed(1)
    num_heads, head_dim, n = 4, 64, 40
    q = torch.randn(n, num_heads, head_dim).bfloat16()
    k = torch.randn(n, num_kv_heads, head_dim).bfloat16()
    v = torch.randn(n, num_kv_heads, head_dim).bfloat16()
    tiles = prefill_gemm.build_tiles([0], [n], [0], [0], n, None, num_heads // num_kv_heads)
    outs = []
    for in_place in (True, False):
        monkeypatch.setattr(prefill_gemm, "BF16_MM_V", in_place)
        out = torch.empty(n, num_heads, head_dim, dtype=torch.bfloat16)
        prefill_gemm.attend(q, k, v, tiles, 0.125, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 300])
def test_fused_causal_softmax_is_the_torch_ops(dtype: torch.dtype, window: int | None) -> None:
    """The fused call against float copy + bias + softmax + rounding on real tiles (a context
    starting past position 0, GQA rows, columns not a multiple of 16): float32 to float32 rounding,
    bf16 within one bf16 step, exact zeros where a query sees nothing."""
    if fused.load_kernel() is None:
        pytest.skip(f"no fused kernel: {fused.kernel_status()}")
    torch.manual_seed(2)
    group_size, start, first = 3, 37, (0 if window is None else 33)
    for tile in prefill_gemm.build_tiles([0], [150], [start], [first], start + 150 - first, window, group_size):
        scores = (torch.randn(group_size * tile.num_queries, tile.num_columns) * 4).to(dtype)
        expected = scores.float()
        if tile.bias is not None:
            expected.view(group_size, tile.num_queries, -1).add_(tile.bias)
        expected = torch.softmax(expected, dim=-1).to(dtype)
        actual = fused.causal_softmax(scores, tile.num_queries, tile.query_position, tile.key_position, tile.window)
        assert torch.equal(actual == 0, expected == 0)
        rtol = 2e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-7)
