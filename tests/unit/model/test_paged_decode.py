"""The paged decode attention kernel against gather + SDPA, on a pool laid out in blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import paged_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (6, 2), (2, 2)])
def test_kernel_matches_sdpa(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    if paged_decode.load_kernel() is None:
        pytest.skip(paged_decode.kernel_status())
    torch.manual_seed(0)
    b, head_dim, block_size, columns = 5, 32, 4, 12
    k_pool = torch.randn(64 * block_size, num_kv_heads, head_dim).to(dtype)
    v_pool = torch.randn_like(k_pool)
    blocks = torch.randperm(64)[:b * columns // block_size].view(b, -1)
    slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).reshape(b, columns)
    spans = torch.tensor([12, 1, 7, 12, 3])
    q = torch.randn(b, num_heads, head_dim).to(dtype)
    out = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.3)
    assert out.dtype == dtype
    q, k_pool, v_pool = q.float(), k_pool.float(), v_pool.float()   # the reference in float32
    k = k_pool[slots.flatten()].view(b, columns, num_kv_heads, head_dim).transpose(1, 2)
    v = v_pool[slots.flatten()].view(b, columns, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(columns)[None, :] < spans[:, None])[:, None, None, :]
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(q.view(b, num_kv_heads, group, head_dim), k, v,
                                              attn_mask=mask, scale=0.3).reshape(b, num_heads, head_dim)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2   # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_supports_only_float32_multiples_of_16() -> None:
    pool = torch.zeros(8, 1, 32)
    assert not paged_decode.supports(torch.zeros(1, 2, 32, dtype=torch.float16), pool)
    assert not paged_decode.supports(torch.zeros(1, 2, 32), pool.to(torch.float8_e4m3fn))
    assert not paged_decode.supports(torch.zeros(1, 2, 24), torch.zeros(8, 1, 24))
    assert paged_decode.supports(torch.zeros(1, 2, 32), pool) == (paged_decode.load_kernel() is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (4, 1, 256), (14, 2, 64), (9, 3, 64), (16, 1, 32), (12, 2, 128), (7, 7, 16)])
def test_tiled_kernel_equals_plain_bit_for_bit(num_heads: int, num_kv_heads: int, head_dim: int,
                                               dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every head-group size (1-8 per chunk, 16 in two chunks), D not a multiple of 64, spans
    that leave a partial tile of columns: the tiled arrangement computes the same floats."""
    if paged_decode.load_kernel() is None:
        pytest.skip(paged_decode.kernel_status())
    torch.manual_seed(1)
    b, block_size, columns = 6, 4, 23
    k_pool = torch.randn(64 * block_size, num_kv_heads, head_dim).to(dtype)
    v_pool = torch.randn_like(k_pool)
    slots = torch.randperm(64 * block_size)[:b * columns].view(b, columns)
    spans = torch.tensor([23, 1, 2, 3, 5, 22])
    q = torch.randn(b, num_heads, head_dim)
    tiled = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.125)
    monkeypatch.setattr(paged_decode, "TILED", False)
    plain = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.125)
    assert torch.equal(tiled, plain)
