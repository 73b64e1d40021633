"""Causal prefill attention read in place from the paged bf16 KV pool (prefill_attention.cpp): flash-style
tiles with AVX512-BF16 dot products, built once per machine where the CPU has avx512_bf16.

The GEMM path (prefill_gemm.py) gathers each group's context into a copy (``index_select`` of K and V
per layer), then per tile and KV head makes a scaled copy of the queries, a contiguous copy of K,
float32 scores ``[G * n, columns]`` in memory, a softmax pass and a second GEMM: 71 ms of a 347 ms
1,019-token prefill of Gemma 3 270M (2 threads). The kernel reads K and V rows from the pool by slot,
keeps a tile's scores in a few KB, and skips every key tile no query of the tile sees (causal, and
left of a sliding window), and inside edge tiles the 8-column score blocks and value pairs nobody sees.
Its tasks split over torch's threads (OpenMP: ``CppKernel`` builds with it).

``supports`` limits it to what it computes: CPU, bf16 queries and pools, head_dim a multiple
of 16 and V's of 64, the kernel built (``kernel_status()`` says why not: no avx512_bf16 in /proc/cpuinfo, no
compiler). Everything else (float32 models, an fp8 pool, draft trees, non-causal layers, position
biases) keeps the GEMM path. A prefill that continues a cached prefix (chunked prefill, a prefix-cache
hit) is the same call: the view's columns start at the context's first position, the queries at theirs.
"""

from __future__ import annotations

import torch

from servelm.model.cpp_kernel import CppKernel

KERNEL = CppKernel.beside(__file__, "prefill_attention.cpp", "prefill_attention",
                          "prefill attention kernel (AVX512-BF16)", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                          ["-mavx512dq", "-mfma"])
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags

ENABLED = True
"""False: multi-token groups take the GEMM path (benchmarks/step_ab.py --change prefill_attention, tests)."""


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``attend`` computes these queries over this pool: CPU, bf16 throughout, head_dim % 16, V's % 64."""
    return (ENABLED and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16
            and q.shape[-1] % 16 == 0 and v_cache.shape[-1] % 64 == 0 and q.stride(-1) == 1
            and load_kernel() is not None)


def plan(row_starts: list[int], query_lens: list[int], starts: list[int], firsts: list[int]) -> torch.Tensor:
    """``[b, 4]`` int64 rows (first token row, queries, first query's position, column 0's position)."""
    return torch.tensor(list(zip(row_starts, query_lens, starts, firsts)), dtype=torch.int64).view(-1, 4)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           sequences: torch.Tensor, window: int | None, scale: float, out: torch.Tensor) -> None:
    """q ``[T, H, D]``; pools ``[slots, Hkv, D]``; ``slots`` ``[b, columns]`` int64 (column c of sequence
    i at position ``sequences[i, 3] + c``); ``sequences`` from ``plan``; writes each sequence's rows of
    ``out`` ``[T, H, Dv]`` (causal; inside ``window`` where given)."""
    module = load_kernel()
    assert module is not None
    module.prefill_attention(q, k_cache, v_cache, slots, sequences, window or 0, scale, out)
