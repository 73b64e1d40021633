"""Session set-up for the whole test run: the C++ kernels are built once, in parallel, up front.

A server start loads the C++ kernels its CPU can run (``servelm/model/cpp_kernel.py``; seven,
``KERNEL_MODULES``), cached under ``~/.cache/servelm/kernels``. On a machine without that cache (CI
starts with an empty HOME) the first server to start compiled them one after the other while the
tests waited. When a run selects end-to-end tests and a
kernel is not cached yet, each missing kernel is built here in its own background process as the
session starts: they compile side by side and alongside the first tests. Whoever needs a
kernel before its build ends (a server, an in-process engine) waits on torch.utils.cpp_extension's
lock in the build directory and then loads the finished build, so nothing builds twice.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("servelm.model.gguf.gguf_kernel", "servelm.model.attention.paged_decode",
                  "servelm.model.attention.prefill_attention",
                  "servelm.model.layers.fused", "servelm.model.gguf.lm_head_screen",
                  "servelm.model.gguf.gguf_rows", "servelm.model.gguf.gguf_i8gemm")
_builders: list[subprocess.Popen[bytes]] = []


def _is_built(module_name: str) -> bool:
    """Every kernel of the module that this CPU can run is built for this source, torch and flags and
    in the cache (a kernel the CPU lacks the instructions of cannot be built here: a builder would
    only say so)."""
    import importlib

    from servelm.model import cpp_kernel, kernel_build

    module = importlib.import_module(module_name)
    # a module may hold several (gguf_kernel: AVX-512 and AVX2 builds, both measured; prefill_attention:
    # a bf16 and a float32 kernel)
    allowed = [kernel for kernel in kernel_build._module_kernels(module) if not kernel.missing_cpu_flags()]
    return all(any((cpp_kernel.CACHE_DIR / f"{kernel.name}_{kernel.build_key()}").glob("*.so")) for kernel in allowed)


def pytest_collection_finish(session: pytest.Session) -> None:
    selects_e2e = any("/tests/e2e/" in str(item.path) for item in session.items)
    if session.config.option.collectonly or not selects_e2e:
        return  # unit runs load a kernel only in the few tests about it: no build up front
    for module_name in KERNEL_MODULES:
        if _is_built(module_name):
            continue
        # what `servelm build-kernels` does for one module: each kernel the CPU can run, built
        code = f"from servelm.model.kernel_build import _build_module; _build_module({module_name!r})"
        # its own session: a Ctrl-C of the run must not kill a compile half-way, which would leave
        # torch's lock in the build directory and every later load waiting on it
        builder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # reaped as soon as it ends: a finished, unreaped builder is a zombie child of the test
        # process, and the tests that list their children (no orphan workers) trip over it
        threading.Thread(target=builder.wait, name=f"reap {module_name}", daemon=True).start()
        _builders.append(builder)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for builder in _builders:  # long finished in a full run; a short run waits for its build
        builder.wait()


@pytest.fixture(autouse=True, scope="session")
def _one_tls_context_for_plain_httpx_calls() -> Iterator[None]:
    """The tests' top-level httpx calls (``httpx.get``, ``post``, ``stream``) each build a client,
    and its transport a TLS context that parses the CA bundle: 20-35 ms of CPU per request, taken
    from the servers under test on a 2-core box. The tests speak plain HTTP to loopback, so calls
    with httpx's default verification share one context; any other (a test's own CA, a client
    certificate) still gets its own."""
    try:
        from httpx._transports import default as transport
    except ImportError:   # another httpx layout: its own contexts, only slower
        yield
        return
    build = transport.create_ssl_context
    shared = functools.cache(lambda trust_env: build(verify=True, cert=None, trust_env=trust_env))

    def create(verify: object = True, cert: object = None, trust_env: bool = True) -> object:
        return shared(trust_env) if verify is True and cert is None else build(verify=verify, cert=cert,
                                                                                   trust_env=trust_env)

    transport.create_ssl_context = create
    yield
    transport.create_ssl_context = build

