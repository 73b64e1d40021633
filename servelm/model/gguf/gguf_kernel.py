"""Builds and loads the GGUF block-quantized linear, once per machine, in the build this CPU takes.

Two sources with the same Python functions (``block_linear_a16``, ``block_linear``,
``block_linear_float``) and the same arithmetic: gguf_kernel.cpp for AVX512 F/BW/VL + VNNI
(``KERNEL``) and gguf_kernel_avx2.cpp for AVX2 + FMA + F16C (``AVX2_KERNEL``: most desktops and
laptops, AMD Zen 1-3). ``load_kernel()`` returns the first build whose instructions this CPU has
(read from /proc/cpuinfo, never assumed) and that builds, or None with a reason (``kernel_status()``)
where none does (no x86 vector unit, no C++ compiler, a failed build): callers then fall back to
dequantized weights and log why. Which build serves a model where several load is measured
(block_builds.py ``choose_block_build``: on AMD Zen 4 the AVX2 build's one-row pass is faster).
``flags`` replaces the CPU's flags in the choice (tests force the AVX2 build on an AVX-512 machine,
or no x86 build at all, with it); a build still needs the real CPU's instructions. Builds are cached like every ``CppKernel``'s.
"""

from __future__ import annotations

from servelm.model.cpp_kernel import CppKernel, KernelBuilds, isa_flags

REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
"""Also the LM-head screen's (lm_head_screen.py), which runs beside this kernel."""
COMPILE_FLAGS = ["-O3", *isa_flags(REQUIRED_FLAGS)]
"""Without OpenMP's: the benchmarks' reference builds of an older source (benchmarks/gguf_*.py)."""
AVX2_FLAGS = ("avx2", "fma", "f16c")

KERNEL = CppKernel.beside(__file__, "gguf_kernel.cpp", "gguf_block", "GGUF block kernel (AVX512-VNNI)", REQUIRED_FLAGS)
AVX2_KERNEL = CppKernel.beside(__file__, "gguf_kernel_avx2.cpp", "gguf_block_avx2", "GGUF block kernel (AVX2+FMA)",
                               AVX2_FLAGS)
KERNELS = (KERNEL, AVX2_KERNEL)
"""Every build, preferred first."""
BUILDS = KernelBuilds(*KERNELS)
candidates, load_kernel, kernel_status, missing_cpu_flags = (BUILDS.candidates, BUILDS.load, BUILDS.status,
                                                             BUILDS.missing_cpu_flags)
