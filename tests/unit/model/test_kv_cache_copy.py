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
