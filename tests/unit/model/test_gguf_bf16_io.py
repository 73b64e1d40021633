"""The GGUF block kernel's bf16 activations and bf16 output (gguf_kernel.cpp's ``bf16_out``): the same
float32 arithmetic as a float32 call on the widened rows, the result rounded as torch rounds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod

pytestmark = pytest.mark.skipif(load_kernel() is None, reason=f"no GGUF kernel: {kernel_status()}")


def random_weight(n: int, k: int, block: int, has_offsets: bool) -> BlockWeight:
    generator = torch.Generator().manual_seed(n * 7 + k)
    codes = torch.randint(-31, 32, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, k // block, generator=generator) * 0.01
    offsets = torch.rand(n, k // block, generator=generator) * 0.01 - 0.005 if has_offsets else None
    return BlockWeight(codes, scales, offsets, block, "test")


@pytest.mark.parametrize("name", ["block_linear_a16", "block_linear", "block_linear_float"])
@pytest.mark.parametrize("rows,n,k,block,has_offsets", [(1, 37, 128, 32, False), (3, 64, 192, 16, True)])
def test_bf16_rows_in_and_out(name: str, rows: int, n: int, k: int, block: int, has_offsets: bool) -> None:
    kernel = getattr(load_kernel(), name)
    weight = random_weight(n, k, block, has_offsets)
    x = torch.randn(rows, k).to(torch.bfloat16)
    args = (weight.codes, weight.scales, weight.offsets, weight.block)
    reference = kernel(x.float(), *args)
    assert torch.equal(kernel(x, *args), reference)                       # widened exactly
    rounded = kernel(x, *args, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, reference.to(torch.bfloat16))
    assert torch.equal(kernel(x.float(), *args, bf16_out=True), rounded)


@pytest.mark.parametrize("name", ["block_linear_a16", "block_linear", "block_linear_float"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bias_is_added_before_the_rounding(name: str, bias_dtype: torch.dtype) -> None:
    """``bias``: the kernel's float32 result + bias, rounded once, as torch's ``(out + bias).to(bf16)``
    (a biased decode layer's one call)."""
    kernel = getattr(load_kernel(), name)
    weight = random_weight(48, 128, 32, True)
    x = torch.randn(2, 128).to(torch.bfloat16)
    bias = torch.randn(48).to(bias_dtype)
    args = (weight.codes, weight.scales, weight.offsets, weight.block)
    exact = kernel(x, *args)
    assert torch.equal(kernel(x, *args, False, bias), exact + bias)
    assert torch.equal(kernel(x, *args, True, bias), (exact + bias).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias"):
        kernel(x, *args, True, torch.zeros(47, dtype=bias_dtype))


def test_linear_method_keeps_float_where_a_bias_or_the_head_follows() -> None:
    weight = random_weight(64, 128, 32, False)
    method = GGUFBlockLinearMethod(load_kernel(), torch.bfloat16)
    layer = nn.Module()
    method.process(layer, weight)
    x = torch.randn(1, 128).to(torch.bfloat16)
    exact = load_kernel().block_linear_a16(x.float(), weight.codes, weight.scales, weight.offsets, weight.block)
    assert torch.equal(method.apply(layer, x, None), exact.to(torch.bfloat16))
    bias = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x, bias), (exact + bias).to(torch.bfloat16))  # one rounding
    head = nn.Module()
    method.process(head, weight, float_output=True)
    assert torch.equal(method.apply(head, x, None), exact)
