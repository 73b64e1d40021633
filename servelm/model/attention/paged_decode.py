"""Decode attention read in place from the paged KV pool (paged_decode.cpp), built once per machine.

The torch path of a decode group gathers every context row of every sequence into a padded copy
(``index_select``, ~5 MB per layer at 32 streams x 80 tokens of Gemma 3 270M's float32 K/V), then SDPA
reads the copy again. The kernel reads each K and V row once from the pool, for all query heads
sharing its KV head, one task per (sequence, KV head) across torch's threads.

One source, two builds, picked by the CPU's flags (read from /proc/cpuinfo, never assumed): 16-lane
AVX-512F (``KERNEL``) where the CPU has it, else 8-lane AVX2 + FMA (``AVX2_KERNEL``: AMD Zen 1-3, most
desktops and laptops). ``load_kernel()`` returns the build this CPU takes, or None
(``kernel_status()`` says why: neither instruction set in /proc/cpuinfo, no compiler or ninja, a
failed build); the backend then keeps the gather + SDPA path. ``load_kernel(flags)``, and
``supports``/``attend``'s ``kernel``, choose another build (tests run the AVX2 build on AVX-512
machines too). The builds are cached like every ``CppKernel``'s, so only the first start on a machine
compiles them (about a minute on 2 cores).
``supports`` limits it to what it computes: a float32 or bfloat16 pool (bf16 rows are widened in
registers, arithmetic in float32; q of either dtype), head_dim a multiple of the build's lanes (16,
AVX2: 8), CPU.

``write_and_attend_qkv`` is the flat decode path's one call per layer: K/V written into the pools (as
``index_copy_``) and the kernel on q read in place from the QKV projection's rows, taken whole (no
split, no views; 2 x ``index_copy_``, q's copy, ``.to`` and ``.view`` were ~40 us of a one-stream
layer's ~80, 1 thread, loaded machine). ``write_and_attend`` does the same on q, k, v views (the
equality tests' reference, and step_ab.py's ``qkv_rows`` baseline).

A sequence's columns are taken in segments of ``SEGMENT_COLUMNS`` (512), each segment's softmax and values
on their own, merged in order (each head's max, sum of exps and unnormalized output): a task is a segment
with its query heads (split where the segments are fewer than the threads), so one long context keeps every
thread busy. The segments are fixed: a sequence's floats depend on its length only, never on the threads or
the batch; a sequence of at most 512 columns is one segment (a plain softmax).

Two arrangements of the same arithmetic, equal bit for bit: the tiled one (the default, ``TILED``)
keeps G query heads x 4 columns of scores and G heads x 64 output lanes in registers (over chunks of
128 columns, ``VALUE_COLUMNS``, the partial sums kept in the output between chunks) and prefetches
the next rows; the plain one (one dependent fma chain per score, the output row loaded and stored
per column) stays as its reference: 32 streams x 133 columns of Gemma 3 270M's bf16 pool, 1 thread,
0.59 -> 0.34 ms per layer (noisy, shared machine).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from servelm.model.cpp_kernel import CppKernel, KernelBuilds

KERNEL = CppKernel.beside(__file__, "paged_decode.cpp", "paged_decode", "paged decode attention kernel (AVX-512)",
                          ("avx512f",))
AVX2_KERNEL = CppKernel.beside(__file__, "paged_decode.cpp", "paged_decode_avx2",
                               "paged decode attention kernel (AVX2+FMA)", ("avx2", "fma"))
KERNELS = (KERNEL, AVX2_KERNEL)
"""Every build, preferred first."""
BUILDS = KernelBuilds(*KERNELS)
kernel_status, missing_cpu_flags = BUILDS.status, BUILDS.missing_cpu_flags


@functools.cache
def _own_build() -> ModuleType | None:
    return BUILDS.load()


def load_kernel(flags: set[str] | None = None) -> ModuleType | None:
    """The build this CPU takes (kept for the process: ``supports`` asks on every layer), or the
    build a CPU with ``flags`` would take; None where none does."""
    return _own_build() if flags is None else BUILDS.load(flags)


def supports(q: torch.Tensor, k_cache: torch.Tensor, kernel: ModuleType | None = None) -> bool:
    """Whether ``attend`` computes this layer's decodes on ``kernel`` (None: ``load_kernel()``):
    CPU, float32/bf16 q and pool, D a multiple of the build's lanes."""
    module = kernel if kernel is not None else load_kernel()
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype in _DTYPES
            and module is not None and q.shape[-1] % module.LANES == 0)


_DTYPES = (torch.float32, torch.bfloat16)

TILED = True
"""Run the tiled arrangement (False: the plain one, for A/B runs and the equality test)."""


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           spans: torch.Tensor, scale: float, kernel: ModuleType | None = None) -> torch.Tensor:
    """q ``[b, H, D]``; pools ``[slots, Hkv, D]``; ``slots`` ``[b, columns]`` int64 (column c of
    sequence i), ``spans`` ``[b]`` valid columns (every one visible to the query) -> ``[b, H, D]``
    in q's dtype, on ``kernel`` (None: ``load_kernel()``)."""
    module = kernel if kernel is not None else load_kernel()
    assert module is not None
    return module.decode_attention(q.float().contiguous(), k_cache, v_cache, slots, spans, scale,
                                   TILED).to(q.dtype)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, slots: torch.Tensor, spans: torch.Tensor,
                     scale: float, kernel: ModuleType | None = None) -> torch.Tensor:
    """One call for a decode layer's attention: k, v ``[T, Hkv, D]`` (in the pools' dtype) written at
    ``slot_mapping`` ``[T]`` (as ``index_copy_``), then ``attend`` of q ``[T, H, D]`` -> ``[T, H * D]``
    in q's dtype, the same floats. q, k and v may be views of the QKV projection's rows (each row's
    heads contiguous): a float32 q is read in place, not copied."""
    module = kernel if kernel is not None else load_kernel()
    assert module is not None
    return module.write_and_attend(q, k, v, k_cache, v_cache, slot_mapping, slots, spans, scale, TILED)


def write_and_attend_qkv(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, slots: torch.Tensor, spans: torch.Tensor, scale: float,
                         kernel: ModuleType | None = None) -> torch.Tensor:
    """``write_and_attend`` on the QKV projection's rows ``qkv`` ``[T, (H + 2 Hkv) * D]`` (q's ``num_heads``
    heads, k's, v's; the pools' dtype and D) instead of its q, k, v views: the same floats, without
    the split and the three views (a one-row decode layer's ~5 us, several times that in a step)."""
    module = kernel if kernel is not None else load_kernel()
    assert module is not None
    return module.write_and_attend_qkv(qkv, num_heads, k_cache, v_cache, slot_mapping, slots, spans, scale, TILED)


_WRITE_AND_ATTEND_QKV = write_and_attend_qkv


def qkv_call() -> Callable[..., torch.Tensor]:
    """``write_and_attend_qkv`` as a step should call it, with its arguments (``kernel`` left out): the
    build's own function where this module's is the one in place (a benchmark may replace it) and the
    arrangement is the tiled one, which skips this module's Python frame and ``load_kernel``'s lookup
    per layer (in a decode step each Python call runs with cold caches: the GEMMs between two layers
    evict the interpreter's lines)."""
    module = load_kernel()
    if write_and_attend_qkv is _WRITE_AND_ATTEND_QKV and TILED and module is not None:
        call: Callable[..., torch.Tensor] = module.write_and_attend_qkv
        return call
    return write_and_attend_qkv
