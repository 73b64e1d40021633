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
