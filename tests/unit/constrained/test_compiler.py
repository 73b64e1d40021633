"""Grammars compile off the engine step (issue 19): while one compiles, other requests decode.

The backend is the real one (xgrammar or llguidance) behind a gate: its creation and its compile
block on threading Events the test opens, standing in for a compile that takes minutes.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

from servelm.constrained.compiler import GrammarCompiler
from servelm.constrained.grammar import GrammarBackend, make_backend
from servelm.engine.engine import LLMEngine
from servelm.engine.grammar_stage import MAX_JUMP_FORWARD_CHARS
from servelm.engine.request import RequestStatus
from servelm.sampling.params import SamplingParams, StructuredSpec
from tests.unit.constrained.test_grammar import (SCHEMA, final_output, installed_backends,  # noqa: F401
                                                 make_engine, tokenizer)

SPEC = StructuredSpec("json", json.dumps(SCHEMA))


@pytest.fixture(params=installed_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class GatedBackend:
    """A real backend whose compile waits until ``compile_gate`` opens (only for ``slow_spec``
    when that is set)."""

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.compile_gate = threading.Event()
        self.slow_spec: str | None = None
        self.num_compiles = 0

    def compile(self, kind: str, spec: str, is_checked: bool = False) -> Any:
        self.num_compiles += 1
        if self.slow_spec is None or spec == self.slow_spec:
            self.compile_gate.wait()
        return self.inner.compile(kind, spec, is_checked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def gated_engine(tokenizer, backend: str, timeout_s: float = 0.0) -> tuple[LLMEngine, GatedBackend, threading.Event]:
    """An engine whose grammar backend is created only once ``created`` opens, then compiles
    only once its ``compile_gate`` opens."""
    engine = make_engine(tokenizer, num_blocks=128, backend=backend)
    inner = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert inner is not None
    gated = GatedBackend(inner)
    created = threading.Event()

    def create() -> GrammarBackend:
        created.wait()
        return gated  # type: ignore[return-value]

    engine.grammars.compiler = GrammarCompiler(create, timeout_s, 32768)
    return engine, gated, created


def free(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def step_until_finished(engine: LLMEngine, request_id: str, max_steps: int = 500) -> dict[str, Any]:
    """Step until ``request_id`` finishes; its text, finish output and the steps it took."""
    text = ""
    for num_steps in range(1, max_steps + 1):
        for output in engine.step():
            if output.request_id == request_id:
                text += output.new_text
                if output.is_finished:
                    return {"text": text, "output": output, "num_steps": num_steps}
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def test_other_requests_decode_while_a_grammar_compiles(tokenizer, backend):
    engine, gated, created = gated_engine(tokenizer, backend)
    created.set()
    assert engine.add_request("json", [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                                                   structured=SPEC)) is None
    assert engine.add_request("free", [1, 2, 3], free(20)) is None
    finished = step_until_finished(engine, "free")  # the compile is blocked all along
    assert finished["output"].finish_reason == "length" and finished["output"].num_output_tokens == 20
    json_request = engine.scheduler.requests["json"]
    assert json_request.status is RequestStatus.WAITING and json_request.is_compiling
    assert json_request.block_ids == [] and json_request.output_token_ids == []
    gated.compile_gate.set()
    result = step_until_finished(engine, "json")
    assert result["output"].finish_reason == "stop"
    jsonschema.validate(json.loads(result["text"]), SCHEMA)
    assert gated.num_compiles == 1 and engine.stats()["num_used_blocks"] == 0


def test_backend_creation_happens_off_the_step(tokenizer, backend):
    engine, gated, created = gated_engine(tokenizer, backend)
    gated.compile_gate.set()
    assert engine.add_request("json", [5, 6], SamplingParams(temperature=0.0, max_tokens=60,
                                                                structured=SPEC)) is None
    assert engine.add_request("free", [1, 2], free(8)) is None
    assert step_until_finished(engine, "free")["output"].num_output_tokens == 8
    assert engine.scheduler.requests["json"].is_compiling  # still no backend
    created.set()
    result = step_until_finished(engine, "json")
    jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_a_compile_over_its_time_budget_is_a_400_and_the_batch_goes_on(tokenizer, backend):
    engine, gated, created = gated_engine(tokenizer, backend, timeout_s=0.2)
    created.set()
    slow = SamplingParams(max_tokens=20, structured=SPEC)
    assert engine.add_request("slow", [5, 6], slow) is None
    assert engine.add_request("free", [1, 2], free(300)) is None
    num_free_tokens = 0
    while "slow" in engine.scheduler.requests:  # steps go on: no compile in the step
        for output in engine.step():
            if output.request_id == "free":
                num_free_tokens += len(output.new_token_ids)
            else:
                assert output.request_id == "slow" and output.is_finished
                result = output
    assert num_free_tokens > 0
    assert result.finish_reason == "error" and result.error_status == 400
    assert "longer than 0.2 s to compile (--grammar-compile-timeout)" in result.error
    # The same spec again fails at once (the failure is cached: no second compile).
    assert engine.add_request("again", [5, 6], slow) is None
    again = step_until_finished(engine, "again", max_steps=1)["output"]
    assert again.error_status == 400 and gated.num_compiles == 1
    gated.compile_gate.set()  # the abandoned compile ends in its thread; nothing uses it
    if "free" in engine.scheduler.requests:
        assert step_until_finished(engine, "free")["output"].num_output_tokens == 300
    assert engine.stats()["num_used_blocks"] == 0


def test_an_aborted_compiling_request_leaves_nothing_behind(tokenizer, backend):
    engine, gated, created = gated_engine(tokenizer, backend)
    created.set()
    assert engine.add_request("json", [5, 6], SamplingParams(max_tokens=20, structured=SPEC)) is None
    engine.step()
    aborted = engine.abort_request("json")
    assert aborted is not None and aborted.finish_reason == "abort"
    gated.compile_gate.set()
    for _ in range(3):
        assert engine.step() == []
    assert not engine.has_unfinished() and engine.grammars.compiling == []


def test_hostile_schema_through_the_engine_is_a_400_not_a_crash(tokenizer, backend):
    # The 264-byte payload: before, xgrammar allocated until std::bad_alloc killed the engine.
    engine = make_engine(tokenizer, backend=backend)
    spec = StructuredSpec("json", json.dumps({"type": "object", "properties": {"x": {"$ref": "#"}},
                                              "required": ["x"]}))
    output = final_output(engine, "hostile", SamplingParams(max_tokens=50, structured=spec))
    assert output.finish_reason == "error" and output.error_status == 400
    assert "matches no finite JSON value" in output.error


@pytest.mark.parametrize("kind, spec", [
    ("regex", "[^\\x00-\\U0010FFFF]"),       # an empty language: no character at all
    ("regex", "[^\\x00-\\U0010FFFF]abc"),    # ... before a possible tail
])
def test_a_grammar_no_token_can_start_is_a_400(tokenizer, backend, kind, spec):
    # Before: the masked sampler picked token 0 under an all-zero mask, the grammar rejected it
    # and the request ended in a 500 ("token 0 does not follow the request's grammar").
    engine = make_engine(tokenizer, backend=backend)
    output = final_output(engine, "empty", SamplingParams(max_tokens=10,
                                                          structured=StructuredSpec(kind, spec)))
    assert output.finish_reason == "error" and output.error_status == 400, output
    assert output.num_output_tokens == 0


def test_jump_forward_appends_a_bounded_amount_per_step(tokenizer, backend):
    # A 450-character forced run: it is appended across steps, never all at once.
    engine = make_engine(tokenizer, num_blocks=128, backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=500, structured=StructuredSpec("regex", "x{450}y"))
    assert engine.add_request("long", [1, 2], params) is None
    request = engine.scheduler.requests["long"]
    previous = 0
    text = ""
    growth = []
    while engine.has_unfinished():
        for output in engine.step():
            text += output.new_text
        growth.append(len(request.output_token_ids) - previous)
        previous = len(request.output_token_ids)
    assert max(growth) <= MAX_JUMP_FORWARD_CHARS + 1 < 450  # one sampled token plus the capped jump
    assert text == "x" * 450 + "y"
    assert engine.num_jump_forward_tokens >= 440


def test_a_timed_out_compile_does_not_hold_up_the_next_one(tokenizer, backend):
    # One worker, stuck on a compile nobody can stop: after the timeout it is replaced.
    engine, gated, created = gated_engine(tokenizer, backend, timeout_s=0.2)
    created.set()
    gated.slow_spec = SPEC.spec
    assert engine.add_request("slow", [5, 6], SamplingParams(max_tokens=20, structured=SPEC)) is None
    assert step_until_finished(engine, "slow", max_steps=100_000)["output"].error_status == 400
    fast = SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredSpec("regex", "[a-c]{3}"))
    assert engine.add_request("fast", [5, 6], fast) is None
    result = step_until_finished(engine, "fast", max_steps=3000)  # the slow compile still runs
    assert result["output"].finish_reason == "stop" and len(result["text"]) == 3
    assert not gated.compile_gate.is_set()
    gated.compile_gate.set()
