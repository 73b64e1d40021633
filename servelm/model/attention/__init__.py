"""Attention backends by name (one file each) and the Attention layer the architectures use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from servelm.model.attention.base import Attention, AttentionBackend, LatentAttention


def _torch_native() -> Any:
    from servelm.model.attention.torch_native import TorchNativeAttention
    return TorchNativeAttention()


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch_native": _torch_native}


def get_attention_backend(name: str = "torch_native") -> AttentionBackend:
    """A new backend instance by name; KeyError lists the known names."""
    if name not in ATTENTION_BACKENDS:
        raise KeyError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()


__all__ = ["Attention", "AttentionBackend", "LatentAttention", "ATTENTION_BACKENDS", "get_attention_backend"]
