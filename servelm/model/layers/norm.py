"""RMSNorm variants. Both normalise in float32 (as the HF reference does) and return the input dtype.

- RMSNorm (Llama, Qwen): ``weight * normed.to(input_dtype)`` -- the cast happens before the scale.
- GemmaRMSNorm: ``(normed * (1 + weight)).to(input_dtype)`` -- weights are stored as offsets from 1
  and the scale is applied in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style RMSNorm; the dummy value of ``weight`` is 1."""

    dummy_fill = 1.0

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel; bit-identical to the three-op form in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm with a (1 + weight) scale; the dummy value of ``weight`` is 0."""

    dummy_fill = 0.0

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel over float32, bit-identical to normalising then scaling by (1 + w)
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)
