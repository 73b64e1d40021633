"""Rotary position embedding (neox / rotate-half layout, as HF Llama, Qwen and Gemma use).

Invariants:
- ``inv_freq`` is float32; cos/sin are computed in float32 from ``positions * inv_freq`` and cast to
  the activation dtype before rotating, which matches the transformers reference bit for bit.
- Rope parameters are read from ``hf_config.rope_parameters`` (transformers 5) or from
  ``rope_theta`` + ``rope_scaling`` (transformers 4); both become one dict
  ``{"rope_type", "rope_theta", ...}``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from servelm.model.layers import fused

if TYPE_CHECKING:
    from servelm.model.layers.norm import _FusableNorm as _HeadNorm


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope dict of ``hf_config`` (of ``layer_type`` for per-layer-type configs like Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        result = dict(params)
    else:  # transformers 4 layout
        theta = getattr(hf_config, "rope_theta", 10000.0)
        if layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
            theta = hf_config.rope_local_base_freq
            scaling = None
        else:
            scaling = getattr(hf_config, "rope_scaling", None)
        result = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    result["rope_type"] = result.get("rope_type", result.get("type", "default"))
    return result


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies for the rope type in ``params``."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, params)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN (DeepSeek-V2/V3's long-context rope): frequencies that turn fewer than ``beta_slow``
    times over the original context are divided by ``factor``, those turning more than
    ``beta_fast`` times kept, a linear ramp over the dimensions between."""
    factor = float(params["factor"])
    base = float(params["rope_theta"])
    context = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:   # the dimension turning ``rotations`` times
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(params: dict[str, Any]) -> float:
    """What YaRN multiplies cos and sin by (1.0 for every other rope type): the config's
    ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` where
    both are set (DeepSeek), else ``mscale(factor)``."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def yarn_softmax_scale(params: dict[str, Any], scale: float) -> float:
    """DeepSeek's attention scale under YaRN: ``scale * mscale(factor, mscale_all_dim) ** 2``
    (``scale`` itself for other rope types or without ``mscale_all_dim``)."""
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] == "default" or not mscale_all_dim:
        return scale
    return scale * _yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths / factor, short ones kept, smooth between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q ``[T, H, D]`` and k ``[T, Hkv, D]`` at ``positions`` ``[T]``."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_type = params["rope_type"]
        # Not a buffer: model.to(dtype) must never round it.
        self.inv_freq = compute_inv_freq(head_dim, params).to(torch.get_default_device())
        self.attention_factor = rope_attention_factor(params)
        """cos and sin are multiplied by it (YaRN's; 1.0 otherwise)."""
        self.cache_key = (head_dim, repr(sorted(params.items())))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` in ``dtype``. Both halves of a row are the same angles (the reference
        takes cos/sin of ``cat(freqs, freqs)``): cos/sin of one half, rounded, then duplicated is
        bit-identical at half the cost (1,019 positions, D 256: 0.62 -> 0.3 ms, one thread)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cache: dict[Any, Any] | None = None, q_norm: _HeadNorm | None = None,
                k_norm: _HeadNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``: a dict that lives for one forward pass (``ForwardBatch.rope_cache``); layers with
        the same rope parameters then compute cos/sin once per step instead of once per layer.
        ``q_norm``/``k_norm``: per-head norms applied first (Gemma 3, Qwen3). They run as one
        fused call that rotates q and k in place (they are fresh views of the QKV output)."""
        if cache is None:
            cos, sin = self.cos_sin(positions, q.dtype)
        else:
            key = (self.cache_key, q.dtype)
            if key not in cache:
                cache[key] = self.cos_sin(positions, q.dtype)
            cos, sin = cache[key]
        if self._fuses(q, k, q_norm, k_norm):
            q_weight = None if q_norm is None else q_norm.weight
            k_weight = None if k_norm is None else k_norm.weight
            norm = q_norm or k_norm
            fused.norm_rope_(q, k, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1), q_weight, k_weight,
                             norm.eps if norm is not None else 0.0, bool(norm is not None and norm.is_offset))
            return q, k
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @staticmethod
    def _fuses(q: torch.Tensor, k: torch.Tensor, q_norm: _HeadNorm | None, k_norm: _HeadNorm | None) -> bool:
        if not (fused.applies(q) and k.dtype == q.dtype and q.stride(-1) == 1
                and k.stride(-1) == 1):
            return False
        if q_norm is None or k_norm is None:   # one kernel call normalises both or neither
            return q_norm is None and k_norm is None
        return (q_norm.weight.dtype == q.dtype and k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps
                and q_norm.is_offset == k_norm.is_offset)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_type={self.rope_type}"


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rope: positions ``[3, T]`` (temporal, height, width; ``[T]`` means the
    same on all three); frequency section i of ``mrope_section`` (sizes summing to head_dim / 2)
    turns with axis i % 3, as transformers' ``Qwen2VLRotaryEmbedding``."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__(head_dim, params)
        self.mrope_section = [int(size) for size in params["mrope_section"]]
        assert sum(self.mrope_section) == head_dim // 2, "mrope_section covers head_dim / 2 frequencies"
        axes = [index % 3 for index, size in enumerate(self.mrope_section) for _ in range(size)]
        self.axis_of_frequency = torch.tensor(axes, dtype=torch.int64)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, :, None] * inv_freq[None, None, :]          # [3, T, D/2]
        index = self.axis_of_frequency.to(positions.device)[None, None, :].expand(1, freqs.shape[1], -1)
        freqs = freqs.gather(0, index)[0]                                        # [T, D/2]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]
