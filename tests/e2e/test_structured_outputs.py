"""Constrained decoding on the default model (Qwen2.5-Coder-0.5B) at temperature 1.0.

Every output under a JSON schema, regex or EBNF grammar must parse and validate, for several
seeds, for each installed grammar backend. All requests of a backend run as one batch through an
in-process LLMEngine (one model load per module, shared by the backends), with schemas bounded so
64 tokens always suffice.
Preemption and matcher bookkeeping are tested with a fake model in tests/unit/constrained.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, StructuredOutputConfig
from servelm.constrained.grammar import BACKENDS, check_backend_available
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams, StructuredSpec

MODEL = "qwen2.5-coder-0.5b"
SEEDS = (0, 1, 2)
MAX_TOKENS = 64

NAME = {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"]},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "name": NAME}, "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"], "additionalProperties": False}, "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
    {"enum": ["yes", "no", 3]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["kind", "r"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,6} [A-Z][a-z]{2,6}",
           r"0x[0-9a-f]{1,6}"]
EBNF = """root ::= term (op term)? (op term)?
term ::= number | "(" number op number ")"
op ::= "+" | "-"
number ::= [1-9] [0-9]?
"""
_EBNF_CHECK = re.compile(r"^[0-9()+\-]+$")


def _backends() -> list[str]:
    installed = []
    for name in BACKENDS:
        if name == "none":
            continue
        try:
            check_backend_available(name)
        except ValueError:
            continue
        installed.append(name)
    return installed


@pytest.fixture(scope="module")
def engines():
    """(model, backend) -> LLMEngine; the weights of a model load once and are shared."""
    made: dict[tuple[str, str], LLMEngine] = {}

    def get(model: str, backend: str) -> LLMEngine:
        if (model, backend) in made:
            return made[(model, backend)]
        structured = StructuredOutputConfig(grammar_backend=backend)
        same_model = [engine for (name, _), engine in made.items() if name == model]
        if same_model:
            first = same_model[0]
            config = EngineConfig(model=first.config.model, cache=first.config.cache, structured=structured)
            engine = LLMEngine(config, runner=first.runner, tokenizer=first.tokenizer,
                               eos_token_ids=first.eos_token_ids, context_length=first.context_length)
        else:
            config = EngineConfig(model=ModelConfig(model=model), cache=CacheConfig(max_total_tokens=16384),
                                  structured=structured)
            engine = LLMEngine(config)
        made[(model, backend)] = engine
        return engine
    return get


# Both cases sample at temperature 1.0. The default run ("quick", on SmolLM2-135M, which the
# default suite loads anyway) gives each schema,
# regex, the EBNF grammar and a choice one request, their seeds cycling through SEEDS, with short
# prompts (little prefill) and no unbounded json_object request, so the batch ends (in about ten
# steps) when its longest bounded output does. The full case (-m slow) runs every spec with every
# seed on the default model, with prompts that show the schema, plus json_object.
# The grammar, not the model, is what makes the output valid.
QUICK_MODEL = "smollm2-135m"
MODEL_CASES = [pytest.param("quick", SEEDS, id="quick"),
               pytest.param("full", SEEDS, marks=pytest.mark.slow, id="full")]


def _run(engine: LLMEngine, jobs: list[tuple[str, str, StructuredSpec, int]]) -> dict[str, tuple[str, str]]:
    """Run (id, prompt, spec, seed) jobs as one batch; returns id -> (text, finish_reason)."""
    texts: dict[str, str] = {}
    finished: dict[str, tuple[str, str]] = {}
    for request_id, prompt, spec, seed in jobs:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=spec)
        error = engine.add_request(request_id, engine.tokenizer.encode(prompt), params)
        assert error is None, error.error
    while engine.has_unfinished():
        for output in engine.step():
            texts[output.request_id] = texts.get(output.request_id, "") + output.new_text
            if output.finish_reason is not None:
                assert output.error is None, output.error
                finished[output.request_id] = (texts[output.request_id], output.finish_reason)
    return finished


# the default run loads the default model with the default backend; the other backend with -m slow
@pytest.mark.parametrize("backend", [name if name == BACKENDS[0] else pytest.param(name, marks=pytest.mark.slow)
                                     for name in _backends()])
@pytest.mark.parametrize("case,seeds", MODEL_CASES)
def test_outputs_always_follow_the_grammar(engines, backend, case, seeds):
    is_full = case == "full"
    engine = engines(MODEL if is_full else QUICK_MODEL, backend)
    jobs = []
    for seed in seeds if is_full else seeds[:1]:
        for i, schema in enumerate(SCHEMAS):
            prompt = f"Answer in JSON matching {json.dumps(schema)}:\n" if is_full else "JSON:"
            jobs.append((f"json-{i}-{seed}", prompt, StructuredSpec("json", json.dumps(schema)), seed))
        for i, regex in enumerate(REGEXES):
            jobs.append((f"regex-{i}-{seed}", "Write something:", StructuredSpec("regex", regex), seed))
        jobs.append((f"ebnf-{seed}", "An arithmetic expression:", StructuredSpec("ebnf", EBNF), seed))
        if is_full:
            jobs.append((f"object-{seed}", "A JSON object about a cat:", StructuredSpec("json_object"), seed))
        jobs.append((f"choice-{seed}", "Is the sky blue?", StructuredSpec("choice", '["yes", "no"]'), seed))
    if not is_full:  # one request per spec, the seeds taking turns
        jobs = [(request_id, prompt, spec, seeds[i % len(seeds)])
                for i, (request_id, prompt, spec, _) in enumerate(jobs)]
    results = _run(engine, jobs)
    assert set(results) == {job[0] for job in jobs}
    for request_id, (text, finish_reason) in results.items():
        kind, _, rest = request_id.partition("-")
        if kind == "object":  # any JSON object: unbounded, so it may reach max_tokens
            assert text.startswith("{") and (finish_reason == "length" or isinstance(json.loads(text), dict))
            continue
        assert finish_reason == "stop", (request_id, text)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMAS[int(rest.split("-")[0])])
        elif kind == "regex":
            assert re.fullmatch(REGEXES[int(rest.split("-")[0])], text), (request_id, text)
        elif kind == "ebnf":
            assert _EBNF_CHECK.match(text) and text.count("(") == text.count(")"), text
            eval(compile(text, "<ebnf>", "eval"), {"__builtins__": {}})  # digits, + - ( ) only
        else:
            assert text in ("yes", "no"), text


def test_bad_spec_is_an_error_output(engines):
    engine = engines(QUICK_MODEL, _backends()[0])
    assert engine.add_request("bad", [1, 2, 3], SamplingParams(structured=StructuredSpec("regex", "a(b"))) is None
    while True:  # the grammar compiles off the step; its failure is the request's (400) output
        outputs = [output for output in engine.step() if output.request_id == "bad"]
        if outputs:
            break
    (output,) = outputs
    assert output.finish_reason == "error" and "regex" in output.error and output.error_status == 400
