"""`servelm build-kernels` finds every kernel, skips those this CPU cannot run, and fills the cache
that serving then loads from."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

import servelm
from servelm.model import cpp_kernel, kernel_build
from servelm.model.cpp_kernel import CppKernel

MODEL_DIR = Path(servelm.__file__).parent / "model"


def test_every_cpp_source_is_a_discovered_kernel() -> None:
    sources = set()
    for name in kernel_build.kernel_modules():
        module = sys.modules[name]
        sources |= {kernel.source.resolve() for kernel in kernel_build._module_kernels(module)}
    on_disk = {path.resolve() for path in MODEL_DIR.rglob("*.cpp")}
    assert on_disk and on_disk == sources


def test_a_kernel_this_cpu_cannot_run_is_skipped_unbuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpp_kernel, "CACHE_DIR", tmp_path)
    module = types.ModuleType("fake_kernel_module")
    module.KERNEL = CppKernel(tmp_path / "k.cpp", "k", "test kernel", ("no_such_flag",), ["-O3"],
                              cpu_flags=lambda: {"avx2"})
    monkeypatch.setitem(sys.modules, "fake_kernel_module", module)
    [result] = kernel_build._build_module("fake_kernel_module")
    assert (result.status, result.reason) == ("skipped", "this CPU lacks no_such_flag")
    assert not any(tmp_path.iterdir())


def test_a_failed_build_is_reported_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpp_kernel, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(cpp_kernel.shutil, "which", lambda name: None)
    module = types.ModuleType("fake_kernel_module")
    module.KERNELS = [CppKernel(tmp_path / "k.cpp", "k", "test kernel", (), ["-O3"], cpu_flags=set)]
    monkeypatch.setitem(sys.modules, "fake_kernel_module", module)
    [result] = kernel_build._build_module("fake_kernel_module")
    assert result.status == "failed" and "no C++ compiler" in result.reason
    text = kernel_build.format_results([result], 1.0)
    assert "failed" in text.splitlines()[0] and text.splitlines()[-1] == "1 kernels in 1.0 s: 1 failed"


def test_a_second_run_loads_every_kernel_from_the_cache() -> None:
    """What setup.sh builds is what serving loads: a second run builds nothing. Where the cache
    was already complete (setup.sh or the test session's start built every kernel, as in CI),
    the first run is that second run and is not repeated (~10 s on a 2-core box)."""
    command = [sys.executable, "-m", "servelm", "build-kernels", "--jobs", "2"]
    last = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert last.returncode == 0, last.stdout + last.stderr
    if not all(row.split()[1:2] in (["cached"], ["skipped"]) for row in last.stdout.splitlines()[:-1]):
        last = subprocess.run(command, capture_output=True, text=True, timeout=300)  # it built some
        assert last.returncode == 0, last.stdout + last.stderr
    rows = last.stdout.splitlines()[:-1]
    kernels = [kernel for name in kernel_build.kernel_modules()
               for kernel in kernel_build._module_kernels(sys.modules[name])]
    assert [row.split()[0] for row in rows] == [kernel.name for kernel in kernels]
    assert all(row.split()[1] in ("cached", "skipped") for row in rows), last.stdout
