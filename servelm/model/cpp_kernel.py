"""One C++ kernel source built with torch.utils.cpp_extension, at most once per process.

The shared object is cached under ``~/.cache/servelm/kernels/<name>_<hash>`` (the hash covers the
source, the shared headers, torch's version and the compile flags), so only the first start on a machine compiles it
(20-60 s on 2 cores) and later starts load it in milliseconds. Building needs the CPU features the
source is compiled for (read from /proc/cpuinfo, never assumed), a C++ compiler and ninja; when
anything is missing or the build fails, ``load`` returns None and ``status`` says why, and the
caller keeps its torch path.

Helpers several kernels use live in headers under ``servelm/model/include`` (``INCLUDE_DIR``): every
kernel is compiled with that directory on its include path, and every header there is part of every
kernel's build key, so editing a header rebuilds the kernels (ninja alone would not notice: the build
directory is named by the key).

Every kernel is compiled and linked with ``-fopenmp`` where torch's parallel backend is OpenMP:
``at::parallel_for`` is a header template whose ``#pragma omp parallel`` is compiled into the kernel's
own module, and without the flag the pragma is dropped and every "parallel" loop runs on the calling
thread alone (the prefill attention, paged decode and fused-ops kernels did until session 10).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.path.expanduser("~/.cache/servelm/kernels"))
INCLUDE_DIR = Path(__file__).with_name("include")
"""Headers shared by the kernels (``#include "servelm_simd.h"``)."""


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` where ATen parallelises with OpenMP (torch's Linux CPU builds), else []."""
    return ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []


def shared_headers() -> list[Path]:
    """The shared headers, in a fixed order (each is hashed into every kernel's build key)."""
    return sorted(INCLUDE_DIR.glob("*.h"))


class CppKernel:
    """``source`` compiled with ``compile_flags`` where the CPU has every one of ``required_flags``."""

    def __init__(self, source: Path, name: str, description: str, required_flags: Sequence[str],
                 compile_flags: Sequence[str], link_flags: Sequence[str] = (),
                 cpu_flags: Callable[[], set[str]] | None = None) -> None:
        self.source = source
        self.name = name
        self.description = description
        """What the kernel is, for the log line: "GGUF block kernel"."""
        self.required_flags = tuple(required_flags)
        openmp = openmp_flags()
        self.compile_flags = list(compile_flags) + [f for f in openmp if f not in compile_flags]
        self.link_flags = list(link_flags) + [f for f in openmp if f not in link_flags]
        self._cpu_flags = cpu_flags
        self._loaded = False
        self._module: ModuleType | None = None
        self._reason = ""

    def cpu_flags(self) -> set[str]:
        if self._cpu_flags is not None:
            return self._cpu_flags()
        from servelm.model.loader import cpu_flags
        return cpu_flags()

    def missing_cpu_flags(self, flags: set[str] | None = None) -> list[str]:
        present = self.cpu_flags() if flags is None else flags
        return [flag for flag in self.required_flags if flag not in present]

    def build_key(self) -> str:
        digest = hashlib.sha256(self.source.read_bytes())
        for header in shared_headers():
            digest.update(header.name.encode())
            digest.update(header.read_bytes())
        digest.update(torch.__version__.encode())
        digest.update(" ".join(self.compile_flags + self.link_flags).encode())
        return digest.hexdigest()[:16]

    def load(self) -> ModuleType | None:
        """The compiled module, or None (the reason is ``status()``); built at most once."""
        if not self._loaded:
            self._module, self._reason = self.build()
            self._loaded = True
            if self._module is None:
                logger.info("%s unavailable (the torch path instead): %s", self.description, self._reason)
            else:
                logger.info("%s: %s", self.description, self._reason)
        return self._module

    def status(self) -> str:
        """Why the kernel is or is not available (loads it first)."""
        self.load()
        return self._reason

    def build(self) -> tuple[ModuleType | None, str]:
        """Compile (or load the cached build): the module and what happened, or None and why."""
        missing = self.missing_cpu_flags()
        if missing:
            return None, f"this CPU lacks {', '.join(missing)}"
        if shutil.which(os.environ.get("CXX") or "c++") is None and shutil.which("g++") is None:
            return None, "no C++ compiler (c++/g++) on PATH to build it"
        from torch.utils import cpp_extension
        if not cpp_extension.is_ninja_available():
            return None, "ninja (needed by torch.utils.cpp_extension) is not installed"
        key = self.build_key()
        build_dir = CACHE_DIR / f"{self.name}_{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cached = any(build_dir.glob("*.so"))
        try:
            module = cpp_extension.load(name=f"servelm_{self.name}_{key}", sources=[str(self.source)],
                                        extra_cflags=self.compile_flags,
                                        extra_include_paths=[str(INCLUDE_DIR)], extra_ldflags=self.link_flags,
                                        build_directory=str(build_dir), verbose=False)
        except Exception as e:  # a compiler error, a missing header: serve without the kernel
            text = str(e).strip()
            return None, f"building {self.source.name} failed: {text.splitlines()[-1] if text else repr(e)}"
        return module, f"{'loaded from' if cached else 'built in'} {build_dir}"
