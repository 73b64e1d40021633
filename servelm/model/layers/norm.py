"""RMSNorm variants. Both normalise in float32 (as the HF reference does).

- RMSNorm (Llama, Qwen): ``weight * normed.to(input_dtype)`` -- the cast happens before the scale.
- GemmaRMSNorm: ``normed * (1 + weight)`` in float32 -- weights are stored as offsets from 1.

Both take the residual stream's add with them: ``norm(x, residual)`` is ``residual + norm(x)`` (Gemma's
post-norms) and ``add_norm(x, residual)`` is ``(norm(x + residual), x + residual)`` (Llama's pre-norm
stream). Each runs as one fused call (layers/fused.py) where it applies, else as the torch ops below.

Dtypes: x, the residual and the weight are each float32 or bfloat16, independently (a float32 residual
stream between the layers of a bf16 model: norm outputs, the matmul inputs, stay bf16).
- ``norm(x)`` comes out in the weight's dtype, rounded once from float32 (Llama's normed value is
  first rounded to x's dtype, as HF's ``.to(input_dtype)``).
- ``norm(x, residual)``: the norm rounded to the residual's dtype (not the weight's), then the sum
  rounded to it: a float32 residual keeps the updates a bf16 one would round away.
- ``add_norm``: ``x + residual`` computed in float32, rounded to the residual's dtype (its result's
  dtype), normalised as ``norm`` (Llama's intermediate rounding then is to the residual's dtype).
With one dtype for all three, every result is bit-identical to the single-dtype formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model.layers import fused


class _FusableNorm(nn.Module):
    """The residual adds and the fused path shared by both norms; subclasses give ``_norm`` (torch)."""

    is_offset = False
    """Gemma's (1 + w) scale."""
    eps: float
    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        fused.load_kernel()  # at model build: a first build takes a minute, never in a request

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)`` in the weight's dtype, or ``residual + norm(x)`` in the residual's."""
        if fused.norm_applies(x, self.weight, residual):
            return fused.rms_norm(x, self.weight, self.eps, self.is_offset, residual)
        if residual is None:
            return self._norm(x, self.weight.dtype)
        return residual + self._norm(x, residual.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum in the residual's dtype."""
        if fused.norm_applies(x, self.weight, residual):
            return fused.add_rms_norm(x, residual, self.weight, self.eps, self.is_offset)
        total = x + residual   # float32 where either is: one rounding to the residual's dtype
        if total.dtype != residual.dtype:
            total = total.to(residual.dtype)
        return self._norm(total, self.weight.dtype), total

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The norm of x, rounded to ``dtype`` at the end."""
        raise NotImplementedError


class RMSNorm(_FusableNorm):
    """Llama-style RMSNorm; the dummy value of ``weight`` is 1."""

    dummy_fill = 1.0

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        weight = self.weight
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # one fused kernel; bit-identical to the three-op form in float32
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps).to(dtype)
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if normed.dtype == weight.dtype == dtype:
            return weight * normed   # the product in float32, rounded once
        return (weight.float() * normed.float()).to(dtype)


class GemmaRMSNorm(_FusableNorm):
    """Gemma-style RMSNorm with a (1 + weight) scale; the dummy value of ``weight`` is 0."""

    dummy_fill = 0.0
    is_offset = True

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # one fused kernel over float32, bit-identical to normalising then scaling by (1 + w)
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).to(dtype)
