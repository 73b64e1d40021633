"""RMSNorm variants. Both normalise in float32 (as the HF reference does) and return the input dtype.

- RMSNorm (Llama, Qwen): ``weight * normed.to(input_dtype)`` -- the cast happens before the scale.
- GemmaRMSNorm: ``(normed * (1 + weight)).to(input_dtype)`` -- weights are stored as offsets from 1
  and the scale is applied in float32.

Both take the residual stream's add with them: ``norm(x, residual)`` is ``residual + norm(x)`` (Gemma's
post-norms) and ``add_norm(x, residual)`` is ``(norm(x + residual), x + residual)`` (Llama's pre-norm
stream). Each runs as one fused call (layers/fused.py) where it applies, else as the torch ops below.
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

    def _fuses(self, x: torch.Tensor) -> bool:
        return self.weight.dtype == x.dtype and fused.applies(x)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)``, or ``residual + norm(x)`` (the sum in x's dtype)."""
        if self._fuses(x) and (residual is None or residual.dtype == x.dtype):
            return fused.rms_norm(x, self.weight, self.eps, self.is_offset, residual)
        return self._norm(x) if residual is None else residual + self._norm(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum in x's dtype."""
        if self._fuses(x) and residual.dtype == x.dtype:
            return fused.add_rms_norm(x, residual, self.weight, self.eps, self.is_offset)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(_FusableNorm):
    """Llama-style RMSNorm; the dummy value of ``weight`` is 1."""

    dummy_fill = 1.0

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel; bit-identical to the three-op form in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class GemmaRMSNorm(_FusableNorm):
    """Gemma-style RMSNorm with a (1 + weight) scale; the dummy value of ``weight`` is 0."""

    dummy_fill = 0.0
    is_offset = True

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel over float32, bit-identical to normalising then scaling by (1 + w)
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)
