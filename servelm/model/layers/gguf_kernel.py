"""Builds and loads the GGUF block-quantized linear, once per machine, in the build this CPU takes.

Two sources with the same Python functions (``block_linear_a16``, ``block_linear``,
``block_linear_float``) and the same arithmetic: gguf_kernel.cpp for AVX512 F/BW/VL + VNNI
(``KERNEL``) and gguf_kernel_avx2.cpp for AVX2 + FMA + F16C (``AVX2_KERNEL``: most desktops and
laptops, AMD Zen 1-3). ``load_kernel()`` returns the first build whose instructions this CPU has
(read from /proc/cpuinfo, never assumed) and that builds, or None with a reason (``kernel_status()``)
where none does (no x86 vector unit, no C++ compiler, a failed build): callers then fall back to
dequantized weights and log why. ``flags`` replaces the CPU's flags in the choice (tests force the
AVX2 build on an AVX-512 machine, or no x86 build at all, with it); a build still needs the real
CPU's instructions. Builds are cached like every ``CppKernel``'s.
"""

from __future__ import annotations

from types import ModuleType

from servelm.model.cpp_kernel import CppKernel, isa_flags

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


def candidates(flags: set[str] | None = None) -> list[CppKernel]:
    """The builds whose instructions this CPU (or ``flags``) has, preferred first."""
    return [kernel for kernel in KERNELS if not kernel.missing_cpu_flags(flags)]


def load_kernel(flags: set[str] | None = None) -> ModuleType | None:
    """The first of ``candidates(flags)`` that builds (or is cached), or None."""
    for kernel in candidates(flags):
        module = kernel.load()
        if module is not None:
            return module
    return None


def kernel_status(flags: set[str] | None = None) -> str:
    """Which build runs and why, or why none does."""
    chosen = candidates(flags)
    for kernel in chosen:
        if kernel.load() is not None:
            return f"{kernel.description}: {kernel.status()}"
    if chosen:
        return "; ".join(f"{kernel.description}: {kernel.status()}" for kernel in chosen)
    return "this CPU lacks " + " and ".join(", ".join(kernel.missing_cpu_flags(flags)) for kernel in KERNELS)


def missing_cpu_flags(flags: set[str] | None = None) -> list[str]:
    """[] where some build's instructions are all present, else the AVX2 build's missing flags."""
    return [] if candidates(flags) else AVX2_KERNEL.missing_cpu_flags(flags)
