"""Constrained decoding through the engine with a fake model and a one-token-per-byte tokenizer.

The fake model prefers one token per step and is indifferent between the rest, so at temperature
1.0 the grammar's mask is what keeps the output valid: any masking bug shows up as invalid text.
The engine tests run once per installed grammar backend.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from servelm.config import EngineConfig, SchedulerConfig, StructuredOutputConfig
from servelm.constrained.grammar import (BACKENDS, GrammarError, check_backend_available,
                                        make_backend, validate_spec)
from servelm.engine.engine import LLMEngine
from servelm.engine.outputs import RequestOutput
from servelm.sampling.params import SamplingParams, StructuredSpec
from tests.unit.engine.fake_runner import FakeRunner
from tests.unit.server.server_fakes import build_tokenizer

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["x", "yy"]},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["id", "tag", "flags"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"


def installed_backends() -> list[str]:
    """The grammar backends whose package is installed (never "none")."""
    installed = []
    for name in BACKENDS:
        try:
            check_backend_available(name)
        except ValueError:
            continue
        if name != "none":
            installed.append(name)
    return installed


@pytest.fixture(params=installed_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_tokenizer(Path(tmp_path_factory.mktemp("bytes_tok")), None)


def make_engine(tokenizer, num_blocks: int = 64, jump_forward: bool = True, backend: str = "xgrammar",
                **scheduler: int) -> LLMEngine:
    vocab_size = len(tokenizer)
    runner = FakeRunner(num_blocks=num_blocks, block_size=4, vocab_size=vocab_size)
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler),
                          structured=StructuredOutputConfig(
                              grammar_backend=backend, disable_jump_forward=not jump_forward,
                              disable_grammar_compile_process=True))  # test_compile_process.py
    return LLMEngine(config, runner=runner,
                     tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id], context_length=512)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[str, str]]:
    for request_id, (prompt, params) in requests.items():
        assert engine.add_request(request_id, prompt, params) is None
    texts = dict.fromkeys(requests, "")
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            texts[output.request_id] += output.new_text
            if output.finish_reason is not None:
                finished[output.request_id] = (texts[output.request_id], output.finish_reason)
    return finished


def sampled(seed: int, spec: StructuredSpec, max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=spec)


def test_outputs_follow_the_grammar_under_preemption(tokenizer, backend):
    # 20 blocks x 4 slots for 12 requests of ~10-50 tokens: recompute preemption happens, and a
    # recomputed request must not re-feed its grammar.
    engine = make_engine(tokenizer, num_blocks=20, backend=backend, chunked_prefill_size=4,
                         max_prefill_tokens=12)
    specs = {"json": StructuredSpec("json", json.dumps(SCHEMA)), "regex": StructuredSpec("regex", REGEX),
             "choice": StructuredSpec("choice", '["alpha", "beta"]')}
    requests = {f"{kind}-{seed}": ([5 + seed, 6, 7], sampled(seed, spec))
                for kind, spec in specs.items() for seed in range(4)}
    results = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request_id, (text, reason) in results.items():
        assert reason == "stop", (request_id, text)
        kind = request_id.split("-")[0]
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in ("alpha", "beta")
    assert len({text for request_id, (text, _) in results.items() if request_id.startswith("json")}) > 1
    assert engine.grammars.compiler is not None and engine.grammars.compiler.num_misses == 3  # compiled once each
    assert engine.num_jump_forward_tokens > 0  # JSON keys and punctuation were forced
    assert engine.stats()["num_used_blocks"] == 0


def test_terminated_grammar_stops_even_with_ignore_eos(tokenizer, backend):
    engine = make_engine(tokenizer, backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                            structured=StructuredSpec("regex", "abc"))
    ((text, reason),) = run(engine, {"a": ([1, 2], params)}).values()
    assert (text, reason) == ("abc", "stop")


def final_output(engine: LLMEngine, request_id: str, params: SamplingParams) -> RequestOutput:
    """The request's last output: the refusal from add_request, or its finished output."""
    refused = engine.add_request(request_id, [1, 2], params)
    if refused is not None:
        return refused
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.is_finished:
                return output


def test_bad_spec_is_a_400_error_output_and_none_backend(tokenizer, backend):
    engine = make_engine(tokenizer, backend=backend)
    output = final_output(engine, "bad", SamplingParams(structured=StructuredSpec("json", '{"type": 5}')))
    assert output.finish_reason == "error" and "JSON schema" in output.error
    assert output.error_status == 400
    assert engine.scheduler.requests == {} and engine.stats()["num_used_blocks"] == 0
    assert make_backend("none", tokenizer, len(tokenizer), [0]) is None


@pytest.mark.parametrize("kind,spec,words", [
    ("json", "{not json", "not valid JSON"),
    ("json", '{"type": "nonsense"}', "nonsense"),
    ("regex", "a(b", {"xgrammar": "parenthesis", "llguidance": "unclosed group"}),
    ("ebnf", "root ::= missing", "missing"),
    ("choice", "[]", "non-empty"),
])
def test_validate_names_the_problem(backend, kind, spec, words):
    words = words if isinstance(words, str) else words[backend]
    with pytest.raises(GrammarError, match=re.escape(words)):
        validate_spec(backend, kind, spec)


def test_outlines_is_refused_at_start_up():
    with pytest.raises(ValueError, match="outlines is not available"):
        check_backend_available("outlines")


def test_batch_bitmask_masks_only_disallowed_tokens(tokenizer, backend):
    backend = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    digits = backend.make_matcher(backend.compile("regex", "[0-9]+"))
    letters = backend.make_matcher(backend.compile("regex", "[a-z]"))
    bitmask = backend.allocate_bitmask(3)
    digits.fill_bitmask(bitmask, 0)
    letters.fill_bitmask(bitmask, 2)  # row 1 has no grammar: everything stays allowed
    logits = torch.zeros(3, len(tokenizer))
    backend.apply_bitmask(logits, bitmask)
    allowed = [[t for t in range(len(tokenizer)) if logits[row, t] == 0] for row in range(3)]
    assert sorted(tokenizer.decode([t]) for t in allowed[0]) == list("0123456789")
    assert len(allowed[1]) == len(tokenizer)
    assert sorted(tokenizer.decode([t]) for t in allowed[2]) == list("abcdefghijklmnopqrstuvwxyz")
    assert bool((logits[0] == float("-inf")).sum() == len(tokenizer) - 10)
    assert digits.accept_token(tokenizer.encode("7")[0]) and not digits.accept_token(tokenizer.encode("x")[0])
    assert not digits.is_terminated()


@pytest.mark.parametrize("jump_forward", [True, False])
def test_jump_forward_saves_model_steps(tokenizer, backend, jump_forward):
    engine = make_engine(tokenizer, jump_forward=jump_forward, backend=backend)
    spec = StructuredSpec("json", json.dumps({"type": "object", "properties": {
        "first_name": {"enum": ["ann"]}, "last_name": {"enum": ["lee"]}},
        "required": ["first_name", "last_name"], "additionalProperties": False}))
    ((text, reason),) = run(engine, {"a": ([3, 4], sampled(0, spec))}).values()
    assert reason == "stop" and json.loads(text) == {"first_name": "ann", "last_name": "lee"}
    if jump_forward:  # everything is forced: one sampled token, then the rest jumps
        assert engine.num_jump_forward_tokens >= len(text) - 2 and engine.num_steps < 10
    else:
        assert engine.num_jump_forward_tokens == 0 and engine.num_steps >= len(text)  # + EOS on xgrammar


def test_listed_properties_only_unless_the_schema_allows_more(tokenizer, backend):
    # xgrammar's strict reading on every backend: no additionalProperties word = no other keys.
    engine = make_engine(tokenizer, backend=backend)
    spec = StructuredSpec("json", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}))
    results = run(engine, {f"r{seed}": ([7, 8], sampled(seed, spec, max_tokens=40)) for seed in range(6)})
    for text, reason in results.values():
        assert reason == "stop" and list(json.loads(text)) == ["a"], text
