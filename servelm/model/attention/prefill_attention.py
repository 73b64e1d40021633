"""Causal prefill attention read in place from the paged KV pool, as flash-style tiles: two kernels, one
per dtype, each built once per machine.

- bf16 (prefill_attention.cpp, ``KERNEL``): AVX512-BF16 dot products, bf16 queries and pools, built where
  the CPU has avx512_bf16;
- float32 (prefill_attention_f32.cpp, ``F32_KERNEL``): FMA vectors (AVX2, which AVX-512 CPUs have too),
  float32 queries over a float32 pool or a bf16 one (a float32 model's opt-in ``--kv-cache-dtype
  bfloat16``; rows widened per key step): the route of float32 models on CPUs without bf16 arithmetic
  (AMD Zen 1-3, most desktops and laptops), where the other routes gather the context and run torch's
  SDPA or oneDNN.

The GEMM path (prefill_gemm.py) gathers each group's context into a copy (``index_select`` of K and V
per layer), then per tile and KV head makes a scaled copy of the queries, a contiguous copy of K,
float32 scores ``[G * n, columns]`` in memory, a softmax pass and a second GEMM: 71 ms of a 347 ms
1,019-token prefill of Gemma 3 270M (2 threads). The kernels read K and V rows from the pool by slot,
keep a tile's scores in a few KB, and skip every key tile no query of the tile sees (causal, and
left of a sliding window), and inside edge tiles the score blocks and value columns nobody sees.
Their tasks split over torch's threads (OpenMP: ``CppKernel`` builds with it).

``supports`` limits them to what they compute: CPU, the dtypes above (bf16: head_dim a multiple of 16 and
V's of 64; float32: V's head_dim a multiple of the build's ``VALUE_LANES``), the kernel built
(``kernel_status(dtype)`` says why not: a missing CPU flag, no compiler). Everything else (an fp8 pool,
draft trees, non-causal layers, position biases) keeps the other routes.
A prefill that continues a cached prefix (chunked prefill, a prefix-cache hit) is the same call: the
view's columns start at the context's first position, the queries at theirs. Which route a call takes is
measured per shape (prefill_routes.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from servelm.model.cpp_kernel import CppKernel

KERNEL = CppKernel.beside(__file__, "prefill_attention.cpp", "prefill_attention",
                          "prefill attention kernel (AVX512-BF16)", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                          ["-mavx512dq", "-mfma"])
F32_KERNEL = CppKernel.beside(__file__, "prefill_attention_f32.cpp", "prefill_attention_f32",
                              "float32 prefill attention kernel (AVX2+FMA)", ("avx2", "fma"))
KERNELS = (KERNEL, F32_KERNEL)
_BY_DTYPE = {torch.bfloat16: KERNEL, torch.float32: F32_KERNEL}

ENABLED = True
"""False: multi-token groups take the next route of the ranking, the GEMMs or SDPA (benchmarks/step_ab.py
--change prefill_attention, tests)."""


def load_kernel(dtype: torch.dtype = torch.bfloat16) -> ModuleType | None:
    """The kernel of ``dtype`` (bf16 or float32), built on first use; None where it cannot be."""
    kernel = _BY_DTYPE.get(dtype)
    return kernel.load() if kernel is not None else None


def kernel_status(dtype: torch.dtype = torch.bfloat16) -> str:
    kernel = _BY_DTYPE.get(dtype)
    return kernel.status() if kernel is not None else f"no prefill attention kernel for {dtype}"


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``attend`` computes these queries over this pool: CPU, bf16 q over bf16 pools or float32 q
    over float32 or bf16 pools, contiguous head rows, head dims the kernel's multiples, the kernel built."""
    pools = {torch.bfloat16} if q.dtype == torch.bfloat16 else {torch.float32, torch.bfloat16}
    if not (ENABLED and q.device.type == "cpu" and q.dtype in _BY_DTYPE and k_cache.dtype in pools
            and v_cache.dtype == k_cache.dtype and q.stride(-1) == 1):
        return False
    module = load_kernel(q.dtype)
    if module is None:
        return False
    if q.dtype == torch.bfloat16:
        return q.shape[-1] % 16 == 0 and v_cache.shape[-1] % 64 == 0
    return v_cache.shape[-1] % module.VALUE_LANES == 0


def plan(row_starts: list[int], query_lens: list[int], starts: list[int], firsts: list[int]) -> torch.Tensor:
    """``[b, 4]`` int64 rows (first token row, queries, first query's position, column 0's position)."""
    return torch.tensor(list(zip(row_starts, query_lens, starts, firsts)), dtype=torch.int64).view(-1, 4)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           sequences: torch.Tensor, window: int | None, scale: float, out: torch.Tensor) -> None:
    """q ``[T, H, D]``; pools ``[slots, Hkv, D]``; ``slots`` ``[b, columns]`` int64 (column c of sequence
    i at position ``sequences[i, 3] + c``); ``sequences`` from ``plan``; writes each sequence's rows of
    ``out`` ``[T, H, Dv]`` (causal; inside ``window`` where given)."""
    module = load_kernel(q.dtype)
    assert module is not None
    module.prefill_attention(q, k_cache, v_cache, slots, sequences, window or 0, scale, out)
