"""The fused ops (servelm/model/layers/fused_ops.cpp) against the layers' torch path.

Tolerances: float32 results equal torch's to float32 rounding (a different summation order, exp by
polynomial); bf16 results within one bf16 rounding step (the same roundings, taken at the same points,
of float32 values that may differ in the last bits). RoPE alone is bit-equal (the same products). 300-row cases are split over torch's threads
(fused_ops.cpp's ``kParallelElements``) where it has more than one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from servelm.model.layers import fused
from servelm.model.layers.activation import ActAndMul
from servelm.model.layers.norm import GemmaRMSNorm, RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(fused.load_kernel() is None, reason=f"no fused kernel: {fused.kernel_status()}")

DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    fused.set_enabled(False)
    try:
        yield
    finally:
        fused.set_enabled(True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bf16_atol: float = 1e-5) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    else:  # one bf16 step (2^-8 relative) at most
        torch.testing.assert_close(actual.float(), expected.float(), rtol=8e-3, atol=bf16_atol)


def make_norm(kind: type, dim: int, dtype: torch.dtype) -> torch.nn.Module:
    norm = kind(dim, eps=1e-6).to(dtype)
    norm.weight.data.normal_(0.0, 0.5)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows,dim", [(1, 640), (5, 37), (32, 896), (300, 640)])
def test_norm_and_residual_adds(kind: type, dtype: torch.dtype, rows: int, dim: int) -> None:
    torch.manual_seed(0)
    norm = make_norm(kind, dim, dtype)
    x = torch.randn(rows, dim, dtype=dtype) * 3
    residual = torch.randn(rows, dim, dtype=dtype)
    assert fused.applies(x)
    with torch_path():
        assert not fused.applies(x)
        expected = norm(x), norm(x, residual), norm.add_norm(x, residual)
    actual = norm(x), norm(x, residual), norm.add_norm(x, residual)
    assert_close(actual[0], expected[0])
    assert_close(actual[1], expected[1])
    assert_close(actual[2][0], expected[2][0])
    assert torch.equal(actual[2][1], expected[2][1])           # the sum is one rounding, as torch's


def test_norm_reads_strided_rows_and_keeps_leading_dims() -> None:
    torch.manual_seed(1)
    norm = make_norm(GemmaRMSNorm, 64, torch.bfloat16)
    wide = torch.randn(3, 200, dtype=torch.bfloat16)
    x = wide[:, 10:74]                                          # rows 200 apart
    with torch_path():
        expected = norm(x)
    assert_close(norm(x), expected)
    heads = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    with torch_path():
        expected = norm(heads)
    assert_close(norm(heads), expected)


def test_other_dtypes_keep_the_torch_path() -> None:
    assert fused.applies(torch.zeros(1, 8)) and fused.applies(torch.zeros(1019, 8))
    assert not fused.applies(torch.zeros(2, 8, dtype=torch.float16))
    norm = make_norm(RMSNorm, 16, torch.float32)
    x = torch.randn(2, 16, dtype=torch.bfloat16)               # mixed float32 / bf16 fuses (test_norm_dtypes.py)
    assert fused.norm_applies(x, norm.weight) and not fused.norm_applies(x, norm.weight.half())
    assert norm(x).dtype == torch.float32                      # the weight's dtype


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 2
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_kind", [None, RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 1, 256), (3, 14, 2, 64), (7, 3, 3, 10),
                                                            (300, 4, 1, 256)])
def test_norm_rope_in_place(dtype: torch.dtype, norm_kind: type | None, tokens: int, heads: int, kv_heads: int,
                            head_dim: int) -> None:
    torch.manual_seed(2)
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    norms = (None, None) if norm_kind is None else (make_norm(norm_kind, head_dim, dtype),
                                                     make_norm(norm_kind, head_dim, dtype))
    positions = torch.arange(tokens) * 37 + 5
    q, k = qkv_views(tokens, heads, kv_heads, head_dim, dtype)
    with torch_path():
        expected_q, expected_k = rope(positions, q, k, None, *norms)
    actual_q, actual_k = rope(positions, q.clone(), k.clone(), None, *norms)
    # a normed element one bf16 step off moves x c - y s by that step, which is not small against
    # the result where the two products cancel: one step of the inputs' magnitude, absolute
    atol = 1e-5 if norm_kind is None else 2 ** -8 * max(expected_q.abs().max().item(), expected_k.abs().max().item())
    assert_close(actual_q, expected_q, atol)
    assert_close(actual_k, expected_k, atol)
    if norm_kind is None:   # rope alone: the same roundings of the same products, bit for bit
        assert torch.equal(actual_q, expected_q) and torch.equal(actual_k, expected_k)
    fused_q, _ = rope(positions, q, k, None, *norms)
    assert fused_q.data_ptr() == q.data_ptr()                    # in place on the QKV output



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 14, 2, 64), (3, 4, 1, 256), (300, 3, 3, 10)])
def test_norm_rope_qkv_equals_it_on_the_views(dtype: torch.dtype, offset: bool, tokens: int, heads: int,
                                              kv_heads: int, head_dim: int) -> None:
    """``norm_rope_qkv_`` on the QKV rows whole (a row stride past their width) writes the same bits as
    ``norm_rope_`` on their q and k views, with and without the per-head norms; v is left as it was."""
    torch.manual_seed(4)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(tokens, width + 8) * 2).to(dtype)[:, :width]
    cos, sin = torch.randn(tokens, head_dim).to(dtype), torch.randn(tokens, head_dim).to(dtype)
    ops = fused._module()
    for weights in ((None, None), (torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype))):
        expected = qkv.clone()
        q, k, _ = expected.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        ops.norm_rope_(q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), cos, sin, *weights,
                       1e-6, offset)
        actual = qkv.clone()
        ops.norm_rope_qkv_(actual, heads, kv_heads, cos, sin, *weights, 1e-6, offset)
        assert torch.equal(actual, expected)
        assert not torch.equal(actual, qkv) and torch.equal(actual[:, (heads + kv_heads) * head_dim:],
                                                           qkv[:, (heads + kv_heads) * head_dim:])

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("rows,width", [(1, 2048), (4, 37), (32, 80), (300, 2048)])
def test_act_and_mul(activation: str, dtype: torch.dtype, rows: int, width: int) -> None:
    torch.manual_seed(3)
    act = ActAndMul(activation)
    gate_up = torch.randn(rows, 2 * width, dtype=dtype) * 4
    with torch_path():
        expected = act(gate_up)
    actual = act(gate_up)
    # exp and tanh differ from torch's (Sleef) in the last bits of float32, which shows where
    # 1 + tanh(u) cancels (GELU of large negative inputs, outputs ~1e-4): 2e-5 absolute there
    atol = 2e-5 * (1 + gate_up.abs().max().item())
    rtol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
    assert actual.dtype == dtype and actual.shape == (rows, width)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul_vector_lanes_equal_the_scalar_tail(activation: str) -> None:
    """SiLU's vector loops (AVX-512: 16 lanes, AVX2: 8) and GELU tanh's (AVX2; the AVX-512 build with FMA
    takes a faster reciprocal there) compute each element as the scalar loop that takes a row's last
    ``width % lanes`` columns: each value in every column of a 17-column row (lanes 0-15 vectorized
    where a build has them, column 16 scalar) gives the same float32 bits, across exp's clamps (|g| past
    87), signed zeros, infinities and subnormals."""
    if activation != "silu" and "-mfma" in fused.KERNEL.compile_flags:
        pytest.skip("this build's GELU tanh lanes take the FMA reciprocal (not the scalar loop's floats)")
    values = torch.cat([torch.randn(2000, generator=torch.Generator().manual_seed(5)) * 30,
                        torch.tensor([0.0, -0.0, 87.0, -87.0, 88.5, -88.5, 200.0, -200.0, 1e-40, -1e-40,
                                      float("inf"), float("-inf")])])
    width = 17
    gate_up = torch.cat([values[:, None].expand(-1, width), torch.full((len(values), width), 1.5)], dim=1)
    out = fused._module().act_and_mul(gate_up.contiguous(), fused.ACTIVATION_KINDS[activation])
    bits = out.view(torch.int32)
    assert torch.equal(bits, bits[:, -1:].expand(-1, width))


def test_rows_split_over_torchs_threads() -> None:
    """The module is built with OpenMP: without it ATen's parallel_for runs every chunk on the calling
    thread, and a 2-thread prefill ran these ops on one core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fused._module().parallel_threads(64) == 2
    finally:
        torch.set_num_threads(threads)


def test_without_a_built_kernel_the_layers_keep_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler or ninja: ``load_kernel`` gave None, and every layer runs its torch ops."""
    norm = make_norm(GemmaRMSNorm, 64, torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch_path():
        expected = norm(x, x)
    monkeypatch.setattr(fused, "_module_loaded", None)
    assert not fused.applies(x)
    assert torch.equal(norm(x, x), expected)
    assert torch.equal(ActAndMul("silu")(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])
