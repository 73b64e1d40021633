"""Builds and loads the AVX512-VNNI block-quantized linear (gguf_kernel.cpp), once per machine.

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks the instructions (AVX512 F/BW/VL + VNNI, read from /proc/cpuinfo, never assumed), there is
no C++ compiler, or the build fails: callers then fall back to dequantized weights and log why. The
build (torch.utils.cpp_extension, about a minute on 2 cores) is cached under
``~/.cache/servelm/kernels/<hash>``, keyed by the source, torch's version and the flags, so later
starts load the shared object in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from servelm.model.cpp_kernel import CppKernel

SOURCE = Path(__file__).with_name("gguf_kernel.cpp")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]

KERNEL = CppKernel(SOURCE, "gguf_block", "GGUF block kernel (AVX512-VNNI)", REQUIRED_FLAGS,
                   COMPILE_FLAGS)


def missing_cpu_flags(flags: set[str] | None = None) -> list[str]:
    return KERNEL.missing_cpu_flags(flags)


def load_kernel() -> ModuleType | None:
    """The compiled kernel module, or None (the reason is ``kernel_status()``); built at most once."""
    return KERNEL.load()


def kernel_status() -> str:
    """Why the kernel is or is not available (after ``load_kernel``)."""
    return KERNEL.status()
