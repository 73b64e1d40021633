"""CppKernel's build key covers the shared headers, and kernels build with them on the include path."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.model import cpp_kernel
from servelm.model.cpp_kernel import CppKernel


def test_shared_header_edit_changes_every_build_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    include = tmp_path / "include"
    include.mkdir()
    (include / "a.h").write_text("#pragma once\n")
    monkeypatch.setattr(cpp_kernel, "INCLUDE_DIR", include)
    kernel = CppKernel(source, "k", "test kernel", (), ["-O1"])
    before = kernel.build_key()
    assert kernel.build_key() == before
    (include / "a.h").write_text("#pragma once\n// edited\n")
    edited = kernel.build_key()
    assert edited != before
    (include / "b.h").write_text("#pragma once\n")
    assert kernel.build_key() != edited


def test_packaged_kernels_see_the_shared_header() -> None:
    assert (cpp_kernel.INCLUDE_DIR / "servelm_simd.h").is_file()
    assert cpp_kernel.INCLUDE_DIR / "servelm_simd.h" in cpp_kernel.shared_headers()


def test_kernels_split_parallel_for_over_threads() -> None:
    """A kernel built without -fopenmp runs at::parallel_for on the calling thread alone."""
    import torch
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP")
    kernel = CppKernel(Path("unused.cpp"), "k", "test kernel", (), ["-O3"], link_flags=[])
    assert "-fopenmp" in kernel.compile_flags and "-fopenmp" in kernel.link_flags
    again = CppKernel(Path("unused.cpp"), "k", "test kernel", (), ["-O3", "-fopenmp"], link_flags=["-fopenmp"])
    assert again.compile_flags.count("-fopenmp") == 1 and again.link_flags.count("-fopenmp") == 1


def test_a_kernel_beside_its_module_compiles_for_its_required_flags() -> None:
    kernel = CppKernel.beside("/pkg/layers/x.py", "x.cpp", "x", "test kernel", ("avx512f", "avx512_vnni"),
                              ["-mfma"])
    assert kernel.source == Path("/pkg/layers/x.cpp")
    flags = [flag for flag in kernel.compile_flags if flag != "-fopenmp"]
    assert flags == ["-O3", "-mavx512f", "-mavx512vnni", "-mfma"]
    assert kernel.missing_cpu_flags({"avx512f"}) == ["avx512_vnni"]


def test_cpu_dependent_flags_are_read_at_first_use_not_at_construction() -> None:
    calls: list[set[str]] = []

    def flags(cpu: set[str]) -> list[str]:
        calls.append(cpu)
        return ["-O3", "-mavx512f"] if "avx512f" in cpu else ["-O3"]

    kernel = CppKernel(Path("unused.cpp"), "k", "test kernel", (), flags, cpu_flags=lambda: {"avx512f"})
    assert calls == []
    assert kernel.compile_flags[:2] == ["-O3", "-mavx512f"] and kernel.compile_flags is kernel.compile_flags
    assert calls == [{"avx512f"}]


def test_without_a_compiler_load_is_none_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callers' torch paths take over: load() is None, status() says why, and nothing is built."""
    monkeypatch.setattr(cpp_kernel.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpp_kernel, "CACHE_DIR", tmp_path)
    kernel = CppKernel.beside(__file__, "missing.cpp", "k", "test kernel")
    assert kernel.load() is None and kernel.status() == "no C++ compiler (c++/g++) on PATH to build it"
    assert not any(tmp_path.iterdir())


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path: Path) -> None:
    """torch's ``lock`` file outlives a build killed midway; under servelm's flock it is a leftover."""
    (tmp_path / "lock").write_text("")
    with cpp_kernel._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_sources_are_staged_in_the_build_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkout compiles the same paths, so two clones with one build key share one build."""
    include = tmp_path / "include_src"
    include.mkdir()
    (include / "a.h").write_text("#pragma once\n")
    monkeypatch.setattr(cpp_kernel, "INCLUDE_DIR", include)
    source = tmp_path / "k.cpp"
    source.write_text('#include "a.h"\n')
    build = tmp_path / "build"
    build.mkdir()
    staged, staged_include = cpp_kernel._stage_sources(build, source)
    assert staged.read_text() == source.read_text() and (staged_include / "a.h").is_file()
    stamp = staged.stat().st_mtime_ns
    assert cpp_kernel._stage_sources(build, source) == (staged, staged_include)
    assert staged.stat().st_mtime_ns == stamp   # unchanged sources are not rewritten (ninja sees no edit)
