"""A compile that runs past --grammar-compile-timeout stops at the deadline (issue 19).

The compile runs in a child process the worker kills at the timeout, so the 400 comes at the
deadline and, from then on, nothing compiles the spec: no thread or process burns CPU on it.
Before, the compile ran on a worker thread nobody could stop: after the 400 it went on for the
25 s (xgrammar) it needed, a core busy and its memory growing.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psutil
import pytest

from servelm.constrained.compile_process import BackendRecipe
from servelm.constrained.compiler import GrammarCompiler
from servelm.constrained.grammar import GrammarBackend, GrammarError
from tests.unit.constrained.test_grammar import installed_backends, tokenizer  # noqa: F401

SLOW_PROPERTIES = {"xgrammar": 2000, "llguidance": 12000}
"""Optional properties whose compile takes far longer than the 1 s budget on the byte tokenizer
(xgrammar 25 s for 2000; llguidance 1.2 s for 2000, growing superlinearly)."""


@pytest.fixture(params=installed_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _cpu_s(process: psutil.Process) -> float:
    """CPU seconds of this process and every live child."""
    total = sum(process.cpu_times()[:2])
    for child in process.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _wait(compiler: GrammarCompiler, job, timeout_s: float = 300.0):  # type: ignore[no-untyped-def]
    """Poll as the engine step does until the job is resolved."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        compiled = compiler.poll(job)
        if compiled is not None:
            return compiled
        time.sleep(0.05)
    raise AssertionError("the compile job never finished")


def _compile_children() -> list[psutil.Process]:
    """This process's live compile children (another test's child may be a zombie or gone by the
    time it is read: psutil raises for those, so they are skipped)."""
    children = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "compile_process" in " ".join(child.cmdline()):
                children.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return children


def test_a_timed_out_compile_is_stopped_at_the_deadline(tokenizer, backend, request):
    recipe = BackendRecipe(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id], None)
    compiler = GrammarCompiler(recipe.create, 1.0, 1 << 20, recipe=recipe)
    request.addfinalizer(compiler.close)
    others = {c.pid for c in _compile_children()}  # earlier tests' engines may still hold theirs
    assert _wait(compiler, compiler.submit("regex", "[a-c]{3}")) is not None  # the child is up
    [child] = [c for c in _compile_children() if c.pid not in others]
    schema = {"type": "object",
              "properties": {f"p{i}": {"type": "integer"} for i in range(SLOW_PROPERTIES[backend])}}
    started = time.monotonic()
    slow = compiler.submit("json", json.dumps(schema))
    with pytest.raises(GrammarError, match="longer than 1 s to compile"):
        _wait(compiler, slow)
    assert time.monotonic() - started < 10  # the deadline, not the compile's end
    child.wait(10)  # killed
    me = psutil.Process()
    before = _cpu_s(me)
    time.sleep(2.0)
    assert _cpu_s(me) - before < 0.5, "something still compiles the timed-out spec"
    # The worker goes on: the next spec gets a fresh child and compiles.
    assert _wait(compiler, compiler.submit("regex", "[d-f]{2}")) is not None
    with pytest.raises(GrammarError):  # the failure is cached: no second compile
        compiler.poll(compiler.submit("json", json.dumps(schema)))
    check_a_bad_spec_is_refused_by_the_child_with_the_backends_message(compiler)


def check_a_bad_spec_is_refused_by_the_child_with_the_backends_message(compiler: GrammarCompiler) -> None:
    """On the timed-out test's compiler, whose fresh child is up (it had its own test, which
    started a compile child of its own: ~4 s a backend on a 2-core box)."""
    with pytest.raises(GrammarError, match="matches no text"):
        _wait(compiler, compiler.submit("regex", "[^\\x00-\\U0010FFFF]"))
    assert _wait(compiler, compiler.submit("choice", json.dumps(["yes", "no"]))) is not None


class CountingBackend:
    """The real backend, counting its compiles and the can-start probes (made matchers)."""

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_compiles = 0
        self.num_matchers = 0
        self.num_checked_compiles = 0

    def compile(self, kind: str, spec: str, is_checked: bool = False) -> Any:
        self.num_compiles += 1
        self.num_checked_compiles += is_checked
        return self.inner.compile(kind, spec, is_checked)

    def make_matcher(self, compiled: Any) -> Any:
        self.num_matchers += 1
        return self.inner.make_matcher(compiled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_spec_compiles_once_in_the_child_and_once_in_the_engine(tokenizer, backend, request,
                                                                   monkeypatch):
    """Counts every compile of one spec asked for by three requests: one budget proof in the
    child, one compile in the engine process, and in the engine none of the checks the child
    already passed (size budget and satisfiability, the can-start probe)."""
    import servelm.constrained.compile_process as compile_process

    spec_checks: list[str] = []
    real_check_spec = compile_process.check_spec
    monkeypatch.setattr(compile_process, "check_spec",
                        lambda kind, spec, limit: (spec_checks.append(spec), real_check_spec(kind, spec, limit)))
    finite_checks: list[str] = []  # the engine's grammar checks (the child's run in its own process)
    if backend == "xgrammar":
        import servelm.constrained.xgrammar_backend as xgrammar_backend
        real_check_finite = xgrammar_backend.check_finite
        monkeypatch.setattr(xgrammar_backend, "check_finite",
                            lambda text: (finite_checks.append(text), real_check_finite(text)))
    recipe = BackendRecipe(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id], None)
    counting: list[CountingBackend] = []

    def make() -> CountingBackend:
        inner = recipe.create()
        assert inner is not None
        counting.append(CountingBackend(inner))
        return counting[0]

    compiler = GrammarCompiler(make, 30.0, 1 << 20, num_workers=2, recipe=recipe)
    request.addfinalizer(compiler.close)
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    jobs = [compiler.submit("json", spec) for _ in range(3)]
    assert jobs[0] is jobs[1] is jobs[2]
    assert _wait(compiler, jobs[0]) is not None
    compiler.make_matcher(jobs[0].compiled)  # what a request then does: not a compile
    [engine_backend] = counting
    assert compiler.num_process_compiles == 1
    assert engine_backend.num_compiles == engine_backend.num_checked_compiles == 1
    assert engine_backend.num_matchers == 1  # the request's own; no probe in the engine
    assert spec_checks == []  # the child checked it
    assert finite_checks == []  # and built the grammar with every check: the engine only compiles
    # A later request with the same spec: no compile anywhere.
    assert _wait(compiler, compiler.submit("json", spec)) is not None
    assert (compiler.num_process_compiles, engine_backend.num_compiles) == (1, 1)
