"""Gated activations over a fused gate_up projection: ``act(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ActAndMul(nn.Module):
    """Splits ``[..., 2 * d]`` into gate and up halves and returns ``act(gate) * up`` ``[..., d]``."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"activation {activation!r} is not supported "
                                      f"(supported: {sorted(_ACTIVATIONS)})")
        self.activation = activation
        self._fn = _ACTIVATIONS[activation]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self._fn(gate) * up

    def extra_repr(self) -> str:
        return self.activation


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
