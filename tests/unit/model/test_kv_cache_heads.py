"""KVCache.read_blocks/write_blocks and select_heads: the byte views a prefill/decode transfer
moves, and a tensor-parallel rank's share of them (its KV heads)."""

from __future__ import annotations

import pytest
import torch

from servelm.model.kv_cache import KVCache, block_heads, select_heads

CPU = torch.device("cpu")


def filled(num_kv_heads: int, dtype: torch.dtype) -> KVCache:
    cache = KVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=num_kv_heads, head_dim=3,
                    dtype=dtype, device=CPU)
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        k, v = (torch.randn(20, num_kv_heads, 3, generator=generator) for _ in range(2))
        cache.write(layer, torch.arange(20), k, v)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_heads_split_over_ranks_and_gathered_back_are_the_whole_pool(dtype: torch.dtype) -> None:
    """Three KV heads split 2 + 1 (SmolLM2 at tp 2): each rank's pool gets exactly its heads'
    values, and the shares put side by side give back the single pool's bytes."""
    whole = filled(3, dtype)
    k, v = whole.read_blocks([3, 1])
    assert k.shape == (2, 2, 4 * 3 * 3 * dtype.itemsize) and k.dtype == torch.uint8
    shares = []
    for start, size in ((0, 2), (2, 1)):
        rank = KVCache(2, 5, 4, size, 3, dtype, CPU)
        rank.write_blocks([0, 2], select_heads(k, 4, 3, start, size), select_heads(v, 4, 3, start, size))
        for layer in range(2):
            for got, full in zip(rank.layer(layer), whole.layer(layer)):
                assert torch.equal(got[0:4].view(torch.uint8), full[12:16, start:start + size].view(torch.uint8))
                assert torch.equal(got[8:12].view(torch.uint8), full[4:8, start:start + size].view(torch.uint8))
        shares.append(rank.read_blocks([0, 2]))
    gathered = torch.cat([block_heads(share[0], 4, size) for share, size in zip(shares, (2, 1))], dim=3)
    assert torch.equal(gathered.view(2, 2, -1), k)
