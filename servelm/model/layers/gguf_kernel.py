"""Builds and loads the AVX512-VNNI block-quantized linear (gguf_kernel.cpp), once per machine.

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks the instructions (AVX512 F/BW/VL + VNNI, read from /proc/cpuinfo, never assumed), there is
no C++ compiler, or the build fails: callers then fall back to dequantized weights and log why. The
build (about a minute on 2 cores) is cached like every ``CppKernel``'s.
"""

from __future__ import annotations

from servelm.model.cpp_kernel import CppKernel, isa_flags

REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
"""Also the LM-head screen's (lm_head_screen.py), which runs beside this kernel."""
COMPILE_FLAGS = ["-O3", *isa_flags(REQUIRED_FLAGS)]
"""Without OpenMP's: the benchmarks' reference builds of an older source (benchmarks/gguf_*.py)."""

KERNEL = CppKernel.beside(__file__, "gguf_kernel.cpp", "gguf_block", "GGUF block kernel (AVX512-VNNI)", REQUIRED_FLAGS)
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags
