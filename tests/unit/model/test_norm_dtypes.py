"""The norms with x, residual and weight each in float32 or bfloat16 (a float32 residual stream beside
bf16 activations and weights): the fused kernel (fused_ops.cpp) against the torch path (norm.py),
both against the semantics written out step by step here, the output dtypes, and the single-dtype
cases bit-identical to the formulas before mixed dtypes existed.

Tolerances: where no value is rounded to bf16 on the way, float32 rounding (a different summation
order); else one bf16 step of the norm's magnitude, with at most 1% of the elements off by more than
float32 rounding (a normalised value within float32 rounding of a bf16 tie rounds either way).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from servelm.model.layers import fused
from servelm.model.layers.norm import GemmaRMSNorm, RMSNorm
from tests.unit.model.test_fused_ops import torch_path

pytestmark = pytest.mark.skipif(fused.load_kernel() is None, reason=f"no fused kernel: {fused.kernel_status()}")

F32, BF16 = torch.float32, torch.bfloat16
DTYPE_MIXES = list(itertools.product([F32, BF16], repeat=3))
"""(x, residual, weight) dtypes."""
EPS = 1e-6


def make_norm(kind: type, dim: int, dtype: torch.dtype) -> torch.nn.Module:
    norm = kind(dim, eps=EPS).to(dtype)
    norm.weight.data.normal_(0.0, 0.5)
    return norm


def spec_norm(x: torch.Tensor, weight: torch.Tensor, offset: bool, dtype: torch.dtype) -> torch.Tensor:
    """The semantics, each step written out: float32 math, rounded to x's dtype where HF's Llama norm
    rounds (``.to(input_dtype)``), once to ``dtype`` at the end."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    if offset:
        return (normed * (1.0 + weight.float())).to(dtype)
    return (weight.float() * normed.to(x.dtype).float()).to(dtype)


def spec(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, offset: bool
         ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """norm(x), residual + norm(x), add_norm(x, residual)."""
    post = (residual.float() + spec_norm(x, weight, offset, residual.dtype).float()).to(residual.dtype)
    total = (x.float() + residual.float()).to(residual.dtype)
    return spec_norm(x, weight, offset, weight.dtype), post, (spec_norm(total, weight, offset, weight.dtype), total)


def old_formulas(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, offset: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """norm.py's torch path before mixed dtypes (one dtype for x, residual and weight)."""
    def norm(v: torch.Tensor) -> torch.Tensor:
        if offset:
            return F.rms_norm(v.float(), (v.shape[-1],), 1.0 + weight.float(), EPS).type_as(v)
        if v.dtype == torch.float32:
            return F.rms_norm(v, (v.shape[-1],), weight, EPS)
        v32 = v.float()
        return weight * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + EPS)).to(v.dtype)
    total = x + residual
    return norm(x), residual + norm(x), (norm(total), total)


def within(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Elementwise |actual - expected| <= atol + rtol |expected| in float32 (torch.isclose's rule;
    this form is ~10x faster on CPU, and the test compares 192 cases)."""
    a, e = actual.float(), expected.float()
    return (a - e).abs() <= atol + rtol * e.abs()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rounds_bf16: bool, scale: float) -> None:
    """``rounds_bf16``: some value on the way was rounded to bf16; ``scale``: the norm's magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    close = within(actual, expected, 2e-6, 2e-6)
    if not rounds_bf16:
        assert close.all(), f"{(~close).sum().item()} of {close.numel()} elements off by more than float32 rounding"
        return
    one_step = within(actual, expected, 8e-3, 2 ** -8 * scale)
    assert one_step.all(), f"{(~one_step).sum().item()} of {one_step.numel()} elements off by more than a bf16 step"
    assert (~close).float().mean().item() <= 0.01, f"{(~close).sum().item()} of {close.numel()} elements off"


def results(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    return norm(x), norm(x, residual), norm.add_norm(x, residual)


@pytest.mark.parametrize("x_dtype,residual_dtype,weight_dtype", DTYPE_MIXES,
                         ids=["-".join(str(d)[6:] for d in mix) for mix in DTYPE_MIXES])
@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("dim", [640, 896, 40])   # 40: the kernel's scalar path (not 16 lanes wide)
def test_mixed_dtypes(kind: type, x_dtype: torch.dtype, residual_dtype: torch.dtype, weight_dtype: torch.dtype,
                      rows: int, dim: int) -> None:
    torch.manual_seed(rows * 1000 + dim)
    norm = make_norm(kind, dim, weight_dtype)
    offset = kind is GemmaRMSNorm
    x = (torch.randn(rows, dim) * 3).to(x_dtype)
    residual = (torch.randn(rows, dim) * 4).to(residual_dtype)
    assert fused.norm_applies(x, norm.weight, residual)
    with torch_path():
        expected = results(norm, x, residual)
    actual = results(norm, x, residual)
    wanted = spec(x, residual, norm.weight, offset)

    assert actual[0].dtype == weight_dtype and actual[1].dtype == residual_dtype
    assert actual[2][0].dtype == weight_dtype and actual[2][1].dtype == residual_dtype
    scale = wanted[0].float().abs().max().item()
    llama_bf16 = not offset and x_dtype == BF16           # HF's .to(input_dtype) of the normed x
    for got, ref, rounds_bf16 in [(actual[0], expected[0], llama_bf16 or weight_dtype == BF16),
                                  (actual[1], expected[1], llama_bf16 or residual_dtype == BF16),
                                  (actual[2][0], expected[2][0], residual_dtype == BF16 or weight_dtype == BF16)]:
        assert_close(got, ref, rounds_bf16, scale)          # kernel == torch path
    for got, ref, rounds_bf16 in [(expected[0], wanted[0], llama_bf16 or weight_dtype == BF16),
                                  (expected[1], wanted[1], llama_bf16 or residual_dtype == BF16),
                                  (expected[2][0], wanted[2][0], residual_dtype == BF16 or weight_dtype == BF16)]:
        assert_close(got, ref, rounds_bf16, scale)          # torch path == the semantics
    assert torch.equal(actual[2][1], wanted[2][1]) and torch.equal(expected[2][1], wanted[2][1])  # one rounding

    if x_dtype == residual_dtype == weight_dtype:           # as before mixed dtypes, bit for bit
        old = old_formulas(x, residual, norm.weight, offset)
        assert torch.equal(expected[0], old[0]) and torch.equal(expected[1], old[1])
        assert torch.equal(expected[2][0], old[2][0]) and torch.equal(expected[2][1], old[2][1])


@pytest.mark.parametrize("fuses", [True, False])
def test_a_float32_residual_keeps_small_updates(fuses: bool) -> None:
    """1000 + 0.01: a bf16 residual (steps of 4 at 1000) loses the update, a float32 one keeps it."""
    dim = 64
    norm = make_norm(GemmaRMSNorm, dim, BF16)
    norm.weight.data.fill_(-0.99)                            # (1 + w) ~ 0.01 in bf16
    x = torch.ones(2, dim, dtype=BF16)                       # normalised: 1
    update = spec_norm(x, norm.weight, True, F32)
    assert 0.005 < update.min().item() and update.max().item() < 0.02
    fused.set_enabled(fuses)
    try:
        assert fused.applies(x) == fuses
        for residual_dtype in (F32, BF16):
            residual = torch.full((2, dim), 1000.0, dtype=residual_dtype)
            post = norm(x, residual)
            _, total = norm.add_norm(torch.full((2, dim), 0.01, dtype=BF16), residual)
            if residual_dtype == F32:
                torch.testing.assert_close(post, residual + update, rtol=0, atol=1e-4)
                assert (post != 1000.0).all() and (total != 1000.0).all()
                torch.testing.assert_close(total, residual + 0.01, rtol=0, atol=1e-4)
            else:
                assert (post == 1000.0).all() and (total == 1000.0).all()
    finally:
        fused.set_enabled(True)


def test_the_kernel_refuses_other_dtypes_and_shapes() -> None:
    """float16 takes the torch path; the module's own checks name what is wrong."""
    weight = torch.ones(16)
    assert not fused.norm_applies(torch.zeros(2, 16), weight.half())
    assert not fused.norm_applies(torch.zeros(2, 16), weight, torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="residual: x's shape"):
        fused.rms_norm(torch.zeros(2, 16), weight, EPS, False, torch.zeros(3, 16, dtype=BF16))
    with pytest.raises(RuntimeError, match="weight: contiguous"):
        fused.add_rms_norm(torch.zeros(2, 16), torch.zeros(2, 16), weight.half(), EPS, False)
