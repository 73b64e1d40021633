"""Builds and loads the AVX512-VNNI block-quantized linear (gguf_kernel.cpp), once per machine.

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks the instructions (AVX512 F/BW/VL + VNNI, read from /proc/cpuinfo, never assumed), there is
no C++ compiler, or the build fails: callers then fall back to dequantized weights and log why. The
build (torch.utils.cpp_extension, about a minute on 2 cores) is cached under
``~/.cache/servelm/kernels/<hash>``, keyed by the source, torch's version and the flags, so later
starts load the shared object in milliseconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from servelm.model.loader import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_kernel.cpp")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp"]
CACHE_DIR = Path(os.path.expanduser("~/.cache/servelm/kernels"))

_state: dict[str, object] = {}


def missing_cpu_flags(flags: set[str] | None = None) -> list[str]:
    present = cpu_flags() if flags is None else flags
    return [flag for flag in REQUIRED_FLAGS if flag not in present]


def _build_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(COMPILE_FLAGS).encode())
    return digest.hexdigest()[:16]


def load_kernel() -> ModuleType | None:
    """The compiled kernel module, or None (the reason is ``kernel_status()``); built at most once."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module, reason = _load()
    _state["module"], _state["reason"] = module, reason
    if module is None:
        logger.info("GGUF block kernel unavailable: %s", reason)
    return module


def kernel_status() -> str:
    """Why the kernel is or is not available (after ``load_kernel``)."""
    load_kernel()
    return str(_state["reason"])


def _load() -> tuple[ModuleType | None, str]:
    missing = missing_cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++/g++) on PATH to build it"
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        return None, "ninja (needed by torch.utils.cpp_extension) is not installed"
    build_dir = CACHE_DIR / f"gguf_block_{_build_key()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob("*.so"))
    try:
        module = cpp_extension.load(name=f"servelm_gguf_block_{_build_key()}", sources=[str(SOURCE)],
                                    extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
                                    build_directory=str(build_dir), verbose=False)
    except Exception as e:  # a compiler error, a missing header: serve without the kernel
        return None, f"building {SOURCE.name} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    return module, (f"AVX512-VNNI kernel {'loaded from' if cached else 'built in'} {build_dir}")
