"""`servelm build-kernels`: compile every C++ kernel this CPU can run, in parallel, before serving.

A kernel (``CppKernel``) is otherwise built the first time a model needs it, inside start-up: on a
fresh machine seven kernels compiled one after another, 20-30 s each, before the first request could
be answered. ``scripts/setup.sh`` runs this command instead, so the first ``servelm serve`` loads every
kernel from the cache (``~/.cache/servelm/kernels``; the build key covers the source, the shared
headers, torch's version and the compile flags, so a build made here is the one serving loads).

Invariants:
- The kernels are found, not listed: every module under ``servelm.model`` that defines a ``KERNEL``
  (or a ``KERNELS`` sequence) of ``CppKernel`` is one, so a new kernel needs no change here.
- Each build runs in its own process (``ProcessPoolExecutor``): the compiler runs in parallel, and a
  crash or a hung import in one build cannot take the others with it. The parent process compiles
  nothing itself.
- A kernel the CPU cannot run (missing instructions) is skipped with that reason; a missing compiler
  or a failed build is reported and the command exits 1, but serving still works through the torch
  paths (every caller falls back when ``load`` returns None).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from servelm.model.cpp_kernel import CppKernel

PACKAGE = "servelm.model"


@dataclass(frozen=True, slots=True)
class BuildResult:
    """What became of one kernel."""

    module: str
    """The Python module that defines it (``servelm.model.gguf.gguf_kernel``)."""
    name: str
    """The kernel's name (its build directory's prefix)."""
    status: str
    """``cached``, ``built``, ``skipped`` (this CPU lacks its instructions) or ``failed``."""
    reason: str
    """The kernel's own words: where it was built or loaded from, or why not."""
    seconds: float


def _module_kernels(module: object) -> list[CppKernel]:
    found: list[CppKernel] = []
    single = getattr(module, "KERNEL", None)
    if isinstance(single, CppKernel):
        found.append(single)
    for kernel in getattr(module, "KERNELS", ()):
        if isinstance(kernel, CppKernel) and kernel not in found:
            found.append(kernel)
    return found


def kernel_modules(package: str = PACKAGE) -> list[str]:
    """The modules under ``package`` that define kernels, sorted by name (imports them)."""
    root = importlib.import_module(package)
    names = []
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        module = importlib.import_module(info.name)
        if _module_kernels(module):
            names.append(info.name)
    return sorted(names)


def _build_module(module_name: str) -> list[BuildResult]:
    """Build the kernels of one module, in this (child) process."""
    module = importlib.import_module(module_name)
    results = []
    for kernel in _module_kernels(module):
        start = time.perf_counter()
        missing = kernel.missing_cpu_flags()
        if missing:
            results.append(BuildResult(module_name, kernel.name, "skipped",
                                       f"this CPU lacks {', '.join(missing)}", 0.0))
            continue
        built, reason = kernel.build()
        if built is None:
            status = "failed"
        else:
            status = "cached" if reason.startswith("loaded from") else "built"
        results.append(BuildResult(module_name, kernel.name, status, reason, time.perf_counter() - start))
    return results


def build_all(jobs: int | None = None, modules: Sequence[str] | None = None) -> list[BuildResult]:
    """Build every kernel of ``modules`` (default: all of ``kernel_modules()``), ``jobs`` at a time
    (default: the CPUs this process may use)."""
    names = list(modules) if modules is not None else kernel_modules()
    workers = max(1, min(len(names), jobs or len(os.sched_getaffinity(0))))
    if not names:
        return []
    # spawn: a forked child would inherit the parent's OpenMP/torch thread state
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        per_module = list(pool.map(_build_module, names))
    return [result for results in per_module for result in results]


def format_results(results: Sequence[BuildResult], wall_s: float) -> str:
    """One line per kernel, then a summary line."""
    lines = []
    width = max((len(result.name) for result in results), default=4)
    for result in results:
        took = f"{result.seconds:5.1f} s" if result.status in ("built", "failed") else "       "
        lines.append(f"  {result.name:<{width}}  {result.status:<7}  {took}  {result.reason}")
    counts = {status: sum(result.status == status for result in results)
              for status in ("built", "cached", "skipped", "failed")}
    summary = ", ".join(f"{count} {status}" for status, count in counts.items() if count)
    lines.append(f"{len(results)} kernels in {wall_s:.1f} s: {summary or 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``servelm build-kernels``."""
    parser = argparse.ArgumentParser(
        prog="servelm build-kernels",
        description="Compile servelm's C++ kernels for this CPU, in parallel, into ~/.cache/servelm/kernels "
                    "(scripts/setup.sh runs this; serving otherwise builds a missing kernel at start-up).")
    parser.add_argument("--jobs", type=int, default=None,
                        help="kernels compiled at once (default: the CPUs this process may use)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be at least 1")
    start = time.perf_counter()
    results = build_all(args.jobs)
    sys.stdout.write(format_results(results, time.perf_counter() - start) + "\n")
    if any(result.status == "failed" for result in results):
        sys.stderr.write("servelm build-kernels: some kernels failed to build; serving uses the torch "
                         "paths in their place\n")
        raise SystemExit(1)
