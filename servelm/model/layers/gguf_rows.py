"""Builds and loads the AVX512-BF16 block kernel for a few to a few dozen rows (gguf_rows.cpp).

``load_kernel()`` returns the compiled module (``rows_linear(x_bf16, codes, scales, offsets, block,
bf16_out)``), or None with a reason (``kernel_status()``) when this CPU lacks AVX512-BF16 (read from
/proc/cpuinfo, never assumed), there is no compiler, or the build fails: callers then keep
today's paths (the VNNI kernel, the dense bf16 copy). Cached like every ``CppKernel``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from servelm.model.cpp_kernel import CppKernel

SOURCE = Path(__file__).with_name("gguf_rows.cpp")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]

KERNEL = CppKernel(SOURCE, "gguf_rows", "GGUF rows kernel (AVX512-BF16)", REQUIRED_FLAGS, COMPILE_FLAGS,
                   link_flags=["-fopenmp"])


missing_cpu_flags = KERNEL.missing_cpu_flags
load_kernel = KERNEL.load
"""The compiled module, or None (the reason is ``kernel_status()``); built at most once."""
kernel_status = KERNEL.status
"""Why the kernel is or is not available (after ``load_kernel``)."""
