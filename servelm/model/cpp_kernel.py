"""One C++ kernel source built with torch.utils.cpp_extension, at most once per process.

The shared object is cached under ``~/.cache/servelm/kernels/<name>_<hash>`` (the hash covers the
source, the shared headers, torch's version and installation, and the compile flags), so only the first start on a machine compiles it
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

A kernel module states only what is its own: ``KERNEL = CppKernel.beside(__file__, "x.cpp", name,
description, required_flags, extra_flags)`` and ``load_kernel, kernel_status, missing_cpu_flags =
KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags``. Flags that depend on the CPU (a kernel that
runs everywhere but uses AVX-512 where it is) are a function of the CPU's flags, read at the first
build key or build, never at import (the CPU's flags come from servelm.model.loader, which imports
the layers).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.path.expanduser("~/.cache/servelm/kernels"))
INCLUDE_DIR = Path(__file__).with_name("include")
"""Headers shared by the kernels (``#include "servelm_simd.h"``)."""


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` where ATen parallelises with OpenMP (torch's Linux CPU builds), else []."""
    return ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []


def with_openmp(flags: Sequence[str]) -> list[str]:
    """``flags`` and then OpenMP's (``openmp_flags``) where ``flags`` lacks them."""
    return list(flags) + [flag for flag in openmp_flags() if flag not in flags]


def isa_flags(cpu_flags: Sequence[str]) -> list[str]:
    """The compiler flags that enable the instructions of /proc/cpuinfo's flags: avx512_vnni -> -mavx512vnni."""
    return ["-m" + flag.replace("_", "") for flag in cpu_flags]


def shared_headers() -> list[Path]:
    """The shared headers, in a fixed order (each is hashed into every kernel's build key)."""
    return sorted(INCLUDE_DIR.glob("*.h"))


class CppKernel:
    """``source`` compiled with ``compile_flags`` where the CPU has every one of ``required_flags``.

    ``compile_flags`` is a list, or a function of the CPU's flags (called once, at first use);
    OpenMP's flags are added to it (and to ``link_flags``) where torch parallelises with OpenMP.
    """

    instances: ClassVar[list[CppKernel]] = []
    """Every kernel made (module-level objects): tests that force other CPU flags forget the loads that
    failed under them (``forget_failed_loads``), since a load is kept as this CPU's."""

    def __init__(self, source: Path, name: str, description: str, required_flags: Sequence[str],
                 compile_flags: Sequence[str] | Callable[[set[str]], Sequence[str]],
                 link_flags: Sequence[str] = (), cpu_flags: Callable[[], set[str]] | None = None) -> None:
        self.source = source
        self.name = name
        """Names the build directory (``<name>_<build key>``) and the loaded module."""
        self.description = description
        """What the kernel is, for the log line: "GGUF block kernel"."""
        self.required_flags = tuple(required_flags)
        self._compile_flags = compile_flags
        self._resolved_compile_flags: list[str] | None = None
        self.link_flags = with_openmp(link_flags)
        self._cpu_flags = cpu_flags
        self._loaded = False
        self._module: ModuleType | None = None
        self._reason = ""
        CppKernel.instances.append(self)

    @classmethod
    def beside(cls, module_file: str, source_name: str, name: str, description: str,
               required_flags: Sequence[str] = (), extra_flags: Sequence[str] = ()) -> CppKernel:
        """The kernel in ``source_name`` next to ``module_file`` (its Python module's ``__file__``),
        compiled -O3 with the instructions of ``required_flags`` (``isa_flags``), then ``extra_flags``."""
        return cls(Path(module_file).with_name(source_name), name, description, required_flags,
                   ["-O3", *isa_flags(required_flags), *extra_flags])

    @property
    def compile_flags(self) -> list[str]:
        """The compiler's flags, OpenMP's included (a function of the CPU's flags is called here, once)."""
        if self._resolved_compile_flags is None:
            flags = self._compile_flags
            self._resolved_compile_flags = with_openmp(flags(self.cpu_flags()) if callable(flags) else flags)
        return self._resolved_compile_flags

    def cpu_flags(self) -> set[str]:
        if self._cpu_flags is not None:
            return self._cpu_flags()
        from servelm.model.loader import cpu_flags
        return cpu_flags()

    def missing_cpu_flags(self, flags: set[str] | None = None) -> list[str]:
        """The required flags this CPU (or ``flags``) lacks, in their order; [] where it has them all."""
        present = self.cpu_flags() if flags is None else flags
        return [flag for flag in self.required_flags if flag not in present]

    def build_key(self) -> str:
        digest = hashlib.sha256(self.source.read_bytes())
        for header in shared_headers():
            digest.update(header.name.encode())
            digest.update(header.read_bytes())
        digest.update(torch.__version__.encode())
        # the installation too: its header paths are in ninja's build file, so two environments (two
        # virtualenvs with the same torch) sharing one directory would each rebuild it in turn
        digest.update(str(Path(torch.__file__).resolve().parent).encode())
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

    @classmethod
    def unloaded(cls) -> list[CppKernel]:
        """The kernels not loaded yet (for ``forget_failed_loads``)."""
        return [kernel for kernel in cls.instances if not kernel._loaded]

    @staticmethod
    def forget_failed_loads(kernels: list[CppKernel]) -> None:
        """Of ``kernels``, those that have since failed to load are not loaded again (the next ``load``
        tries afresh): for tests that force other CPU flags, under which a kernel is found missing its
        instructions (a loaded one stays: loading another build under its name rebuilds it)."""
        for kernel in kernels:
            if kernel._loaded and kernel._module is None:
                kernel._loaded, kernel._reason, kernel._resolved_compile_flags = False, "", None

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
        with _build_lock(build_dir):
            source, include_dir = _stage_sources(build_dir, self.source)
            before = {path: path.stat().st_mtime_ns for path in build_dir.glob("*.so")}
            try:
                module = cpp_extension.load(name=f"servelm_{self.name}_{key}", sources=[str(source)],
                                            extra_cflags=self.compile_flags,
                                            extra_include_paths=[str(include_dir)], extra_ldflags=self.link_flags,
                                            build_directory=str(build_dir), verbose=False)
            except Exception as e:  # a compiler error, a missing header: serve without the kernel
                text = str(e).strip()
                return None, f"building {self.source.name} failed: {text.splitlines()[-1] if text else repr(e)}"
            after = {path: path.stat().st_mtime_ns for path in build_dir.glob("*.so")}
        return module, f"{'loaded from' if after == before else 'built in'} {build_dir}"


class KernelBuilds:
    """Builds of one kernel for different instruction sets (an AVX-512 and an AVX2 build, ...),
    preferred first: a CPU takes the first build whose instructions it has and that builds.

    ``flags`` replaces the CPU's flags in the choice (tests force the AVX2 build on an AVX-512 machine,
    or no x86 build at all, with it); a build still needs the real CPU's instructions."""

    def __init__(self, *kernels: CppKernel) -> None:
        self.kernels = kernels

    def candidates(self, flags: set[str] | None = None) -> list[CppKernel]:
        """The builds whose instructions this CPU (or ``flags``) has, preferred first."""
        return [kernel for kernel in self.kernels if not kernel.missing_cpu_flags(flags)]

    def first(self, flags: set[str] | None = None) -> CppKernel | None:
        """The first of ``candidates(flags)`` that builds (or is cached), or None."""
        return next((kernel for kernel in self.candidates(flags) if kernel.load() is not None), None)

    def load(self, flags: set[str] | None = None) -> ModuleType | None:
        """``first(flags)``'s module, or None."""
        kernel = self.first(flags)
        return kernel.load() if kernel is not None else None

    def status(self, flags: set[str] | None = None) -> str:
        """Which build runs and why, or why none does."""
        chosen = self.candidates(flags)
        for kernel in chosen:
            if kernel.load() is not None:
                return f"{kernel.description}: {kernel.status()}"
        if chosen:
            return "; ".join(f"{kernel.description}: {kernel.status()}" for kernel in chosen)
        return "this CPU lacks " + " and ".join(", ".join(kernel.missing_cpu_flags(flags)) for kernel in self.kernels)

    def missing_cpu_flags(self, flags: set[str] | None = None) -> list[str]:
        """[] where some build's instructions are all present, else the last (most portable) build's
        missing flags."""
        return [] if self.candidates(flags) else self.kernels[-1].missing_cpu_flags(flags)


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s build lock: an ``flock``, which the kernel releases when its holder dies.

    torch's own lock (a ``lock`` file that ``cpp_extension.load`` creates and removes) outlives a
    process killed mid-build, and every later start then waits on it forever. Every servelm build
    takes this lock first, so while it is held no other servelm process is building here and a
    ``lock`` file left in the directory is such a leftover: it is removed."""
    with open(build_dir / "servelm.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stage_sources(build_dir: Path, source: Path) -> tuple[Path, Path]:
    """Copy ``source`` and the shared headers into ``build_dir`` (only where they differ) and return the
    copies' paths: ninja's build file then names the same paths from every checkout of servelm (two
    clones or worktrees with the same build key share one build instead of rebuilding it in turn)."""
    include_dir = build_dir / "include"
    include_dir.mkdir(exist_ok=True)
    staged = build_dir / source.name
    for original, copy in [(source, staged)] + [(header, include_dir / header.name) for header in shared_headers()]:
        data = original.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return staged, include_dir
