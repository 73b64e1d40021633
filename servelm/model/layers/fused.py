"""Fused elementwise ops of a decoder layer (fused_ops.cpp): RMSNorm with its residual add, q/k norm +
RoPE, act(gate) * up, and the causal softmax of prefill attention's tiles. Built once per machine; the layers call them through ``applies`` and keep their
torch path otherwise.

Why: a single-stream decode step runs each of these ops on one row of a few hundred floats, where
torch's per-op dispatch (3-7 ops per norm, 6 per RoPE) costs more than the arithmetic. One call per
fused op removes most of it. At many rows (prefill, large batches) the same calls win by memory
traffic: each op reads its input once and writes its output once, where torch's 3-7 ops each make a
temporary (1,019 rows of Gemma 3 270M, bf16, one thread: norm + residual 0.48 -> 0.15 ms, GELU-tanh * up
3.9 -> 1.7 ms, q/k norm + RoPE 2.5 -> 0.7 ms; noisy, shared machine). Numerics follow the torch reference step by step (float32 arithmetic,
rounded to the activation dtype where the reference rounds); the sum of squares and exp are ordered
or approximated differently, so results equal the reference to float32 rounding (tests/unit/model/
test_fused_ops.py, test_norm_dtypes.py), not always bit for bit.

Mixed dtypes (a float32 residual stream in a bf16 model): the norms take x, the residual and the
weight each in float32 or bfloat16, with norm.py's semantics: ``norm(x)`` comes out in the weight's
dtype, ``residual + norm(x)`` and the pre-add's ``x + residual`` in the residual's (each sum computed
in float32 and rounded once to it). Every other op takes one dtype.

Invariants:
- ``applies`` is True only on CPU, for float32 or bfloat16 tensors of any number of rows, outside
  torch.compile tracing (a compiled layer fuses the same ops itself), with the kernel built. Rows
  are split over torch's threads past ``kParallelElements`` (fused_ops.cpp; CppKernel builds every
  kernel with -fopenmp, without which ATen's parallel_for runs every chunk on the calling thread).
- Prefill and decode take the same path, so a prompt's tokens are computed as a decode step would
  compute them (same rounding points, same approximated exp).
- The kernel is plain C++ that needs no CPU feature (AVX-512 flags are added where /proc/cpuinfo
  has them, else AVX2's: the same floats, vectorized); ``load_kernel`` returns None without a
  compiler or ninja, and everything runs as before.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from servelm.model.cpp_kernel import CppKernel, isa_flags

_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _compile_flags(cpu: set[str]) -> list[str]:
    flags = ["-O3", "-ffp-contract=off"]
    if all(flag in cpu for flag in _AVX512):
        flags += isa_flags(_AVX512)
        if "avx512_bf16" in cpu and "fma" in cpu:
            flags += ["-mavx512bf16", "-mfma"]   # one-instruction bf16 rounding; GELU-tanh's FMA path
    elif "avx2" in cpu:
        # 8 lanes for the compiler's vectorizer (and SSE4.1's floor: exp_poly's loops vectorize); the
        # same float operations in the same order (no FMA contraction), so the same results
        flags += isa_flags(("avx2",))
    return flags


KERNEL = CppKernel(Path(__file__).with_name("fused_ops.cpp"), "fused_ops", "fused decode ops (RMSNorm, RoPE, act * up)",
                   (), _compile_flags)


ACTIVATION_KINDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2}
"""Activation name -> the kernel's ``kind``."""

_DTYPES = (torch.float32, torch.bfloat16)
_enabled = True
"""False: every op takes the torch path (benchmarks/step_ab.py's ``fused_ops`` change, tests)."""


_module_loaded: ModuleType | None = None
"""The module once ``load_kernel`` built it: ``applies`` reads it without a call per op."""


def load_kernel() -> ModuleType | None:
    """The compiled module, or None (the reason is ``kernel_status()``); built at most once. The
    layers call it when they are built: until then ``applies`` is False."""
    global _module_loaded
    _module_loaded = KERNEL.load()
    return _module_loaded


def kernel_status() -> str:
    return KERNEL.status()


def set_enabled(enabled: bool) -> None:
    """Switch the fused path on or off for the process (A/B benchmarks, tests of the torch path)."""
    global _enabled
    _enabled = enabled


def applies(x: torch.Tensor) -> bool:
    """Whether the fused ops compute on ``x`` (any number of rows)."""
    if _module_loaded is None or not _enabled or x.dtype not in _DTYPES or x.device.type != "cpu":
        return False
    return not torch.compiler.is_compiling()


def _module() -> ModuleType:
    assert _module_loaded is not None, "applies() was not checked"
    return _module_loaded


def norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``rms_norm``/``add_rms_norm`` compute on ``x`` with this weight and residual (each
    float32 or bfloat16, in any mix)."""
    return (weight.dtype in _DTYPES and (residual is None or residual.dtype in _DTYPES)
            and applies(x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(x)`` in the weight's dtype, or ``residual + norm(x)`` in the residual's dtype (the norm
    rounded to it first); ``offset``: Gemma's (1 + w) scale."""
    x2 = x.reshape(-1, x.shape[-1])
    r2 = None if residual is None else residual.reshape(-1, x.shape[-1])
    out: torch.Tensor = _module().rms_norm(x2, weight, eps, offset, r2)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``: the sum in the residual's dtype, the norm in the weight's."""
    shape = x.shape
    out, total = _module().add_rms_norm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]),
                                        weight, eps, offset)
    return out.view(shape), total.view(shape)


def first_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of float32 CPU rows ``x`` ``[M, V]`` (rows contiguous) in one call (the
    sampler's greedy rows), or None where the fused ops do not take ``x``."""
    if _module_loaded is None or not _enabled or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    out: torch.Tensor = _module_loaded.first_argmax(x)
    return out


def packed_rows(data: torch.Tensor, bits: int, centered: bool, ids: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor | None, block: int) -> torch.Tensor | None:
    """Rows ``ids`` ``[T]`` of a packed GGUF weight (gguf_blocks.PackedCodes' ``data``, ``bits``,
    ``centered``) dequantized with its float32 ``scales`` (and ``offsets``) per ``block`` inputs:
    float32 ``[T, K]`` in one call, as gguf_linear.BlockRows computes them with torch's ops (an
    embedding lookup); None where the fused ops are not built or not on."""
    if (_module_loaded is None or not _enabled or ids.device.type != "cpu" or ids.dtype != torch.int64
            or scales.dtype != torch.float32 or not scales.is_contiguous() or not data.is_contiguous()
            or (offsets is not None and not offsets.is_contiguous())):
        return None
    out: torch.Tensor = _module_loaded.packed_rows(data, bits, centered, ids.contiguous(), scales, offsets, block)
    return out


def norm_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, offset: bool) -> None:
    """q ``[T, H, D]``, k ``[T, Hkv, D]`` in place: per-head RMSNorm (where a weight is given),
    then rotate-half RoPE with cos/sin ``[T, D]`` in q's dtype."""
    _module().norm_rope_(q, k, cos, sin, q_weight, k_weight, eps, offset)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of ``[..., 2d]`` -> ``[..., d]``."""
    shape = gate_up.shape
    out: torch.Tensor = _module().act_and_mul(gate_up.reshape(-1, shape[-1]), ACTIVATION_KINDS[activation])
    return out.view(*shape[:-1], shape[-1] // 2)


def causal_softmax(scores: torch.Tensor, num_queries: int, query_position: int, key_position: int,
                   window: int | None) -> torch.Tensor:
    """Softmax of a prefill tile's scores ``[G * n, C]`` (row r: query ``r % n`` at position
    ``query_position + r % n``; column c: key position ``key_position + c``) over the keys each
    query sees (causal, inside ``window`` where given), 0 elsewhere; float32 math, one rounding to
    the scores' dtype (servelm.model.attention.prefill_gemm)."""
    out: torch.Tensor = _module().causal_softmax(scores, num_queries, query_position, key_position, window or 0)
    return out
