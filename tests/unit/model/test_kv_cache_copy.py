"""KVCache.copy_blocks: the copy-on-write of a beam fork (every slot, every layer, K and V)."""

from __future__ import annotations

import pytest
import torch

from servelm.model.kv_cache import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_blocks_copies_whole_blocks_and_nothing_else(dtype: torch.dtype) -> None:
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3,
                    dtype=dtype, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        k = torch.randn(24, 2, 3, generator=generator)
        v = torch.randn(24, 2, 3, generator=generator)
        cache.write(layer, torch.arange(24), k, v)
    before = [(k.clone(), v.clone()) for k, v in (cache.layer(0), cache.layer(1))]
    cache.copy_blocks([(1, 4), (2, 0)])
    for layer in range(2):
        for tensor, old in zip(cache.layer(layer), before[layer]):
            expected = old.clone()
            expected[16:20] = old[4:8]
            expected[0:4] = old[8:12]
            assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [4, 3])
def test_write_of_bf16_rows_split_from_a_fused_projection(head_dim: int) -> None:
    """bf16 K/V viewed out of a wider QKV row (strided, the layer's split) land at their slots
    bit for bit, whether copied as int32 words (even head_dim) or as bf16 elements (odd)."""
    cache = KVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=head_dim,
                    dtype=torch.bfloat16, device=torch.device("cpu"))
    qkv = torch.randn(5, 7, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    k, v = qkv[:, 3:5], qkv[:, 5:7]                                   # [5, 2, head_dim], strided
    slots = torch.tensor([9, 2, 15, 0, 6])
    cache.write(0, slots, k, v)
    k_cache, v_cache = cache.layer(0)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
