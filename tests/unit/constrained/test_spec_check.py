"""Hostile grammar specs are refused up front, by class, on every backend (issue 19).

Classes: a JSON schema that can match no finite value (a required self-recursion, directly, via
$defs, through arrays, anyOf or oneOf; ``false``, ``"not": {}``, an empty enum, contradictory
bounds), a grammar with no finite sentence, and a spec over the size budget (bytes, nesting).
Recursive schemas that have a way out must still compile.
"""

from __future__ import annotations

import json
import re

import pytest

from servelm.constrained.grammar import GrammarError, validate_spec
from servelm.constrained.spec_check import MAX_SPEC_DEPTH, check_json_schema, check_spec
from tests.unit.constrained.test_grammar import installed_backends

NO_FINITE_VALUE = "matches no finite JSON value"

NO_WAY_OUT = {
    "the issue's payload": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "self-loop $ref": {"$ref": "#"},
    "mutual recursion via $defs": {
        "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                  "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
        "$ref": "#/$defs/a"},
    "through arrays": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "through prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}],
                            "minItems": 2},
    "through anyOf": {"anyOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
    "through oneOf and definitions": {
        "definitions": {"node": {"type": "object", "required": ["next"],
                                 "properties": {"next": {"oneOf": [{"$ref": "#/definitions/node"}]}}}},
        "$ref": "#/definitions/node"},
    "through allOf, three deep": {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "object", "required": ["b"], "properties": {"b": {"allOf": [{"$ref": "#"}]}}}}},
}
OPTIONAL_NO_WAY_OUT = {  # the root has values, but a branch into these never ends
    "optional self-loop property": {"type": "object", "properties": {
        "x": {"$ref": "#/properties/x"}, "y": {"type": "integer"}}},
    "optional property that must contain itself": {"type": "object", "properties": {"x": {
        "type": "object", "properties": {"z": {"$ref": "#/properties/x"}}, "required": ["z"]}}},
    "array items with no way out": {"type": "array", "items": {"$ref": "#/$defs/loop"},
                                    "$defs": {"loop": {"type": "array", "items": {"$ref": "#/$defs/loop"},
                                                       "minItems": 1}}},
}
EMPTY = {
    "false": (False, "is false"),
    "not {}": ({"not": {}}, "not: {}"),
    "required false property": ({"type": "object", "properties": {"x": False}, "required": ["x"]},
                                "#/properties/x is false"),
    "empty enum": ({"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]}, "empty enum"),
    "empty anyOf": ({"anyOf": []}, "empty anyOf"),
    "minimum > maximum": ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 > maximum 1"),
    "minLength > maxLength": ({"type": "string", "minLength": 5, "maxLength": 1}, "minLength 5 > maxLength 1"),
    "minItems > maxItems": ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems 3 > maxItems 2"),
    "minProperties > maxProperties": ({"type": "object", "minProperties": 2, "maxProperties": 1},
                                      "minProperties 2 > maxProperties 1"),
    "required items of an empty schema": ({"type": "array", "items": {"not": True}, "minItems": 1},
                                          "not: {}"),
}
HAS_A_WAY_OUT = {
    "optional self-reference": {"type": "object", "properties": {"x": {"$ref": "#"}}},
    "nullable self-reference": {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}},
                                "required": ["x"]},
    "tree with an empty children list": {
        "$defs": {"node": {"type": "object", "required": ["children"],
                           "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "anyOf with a leaf": {"anyOf": [{"type": "array", "items": {"$ref": "#"}, "minItems": 1},
                                    {"type": "string"}]},
    "optional impossible property": {"type": "object", "properties": {"x": {"enum": []}, "y": {"type": "integer"}},
                                     "required": ["y"]},
}


@pytest.fixture(params=installed_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("name", NO_WAY_OUT)
def test_recursion_with_no_way_out_is_refused_naming_the_loop(backend, name):
    with pytest.raises(GrammarError, match=f"{NO_FINITE_VALUE}.*leads back to .* with no way out"):
        validate_spec(backend, "json", json.dumps(NO_WAY_OUT[name]))


@pytest.mark.parametrize("name", OPTIONAL_NO_WAY_OUT)
def test_an_optional_recursion_with_no_way_out_is_refused(backend, name):
    # xgrammar's compiler allocates without bound on these too; llguidance ends '{"x": ' as "stop".
    with pytest.raises(GrammarError, match="recursion with no way out: .* leads back to"):
        validate_spec(backend, "json", json.dumps(OPTIONAL_NO_WAY_OUT[name]))


@pytest.mark.parametrize("name", EMPTY)
def test_empty_schemas_are_refused_naming_where(backend, name):
    schema, words = EMPTY[name]
    with pytest.raises(GrammarError, match=f"{NO_FINITE_VALUE}.*{re.escape(words)}"):
        validate_spec(backend, "json", json.dumps(schema))


@pytest.mark.parametrize("name", HAS_A_WAY_OUT)
def test_recursion_with_a_way_out_is_accepted(name):
    check_json_schema(HAS_A_WAY_OUT[name])  # no GrammarError: the schema has finite values


@pytest.mark.parametrize("grammar", [
    'root ::= "a" root',
    'root ::= a\na ::= "x" b\nb ::= "y" a',
    'root ::= "{" root "}"',
    'root ::= item+\nitem ::= "(" item ")"',
    'root ::= "a" | loop\nloop ::= "b" loop',
    'root ::= item*\nitem ::= "(" item ")"',
])
def test_grammar_with_no_finite_sentence_is_refused(backend, grammar):
    # xgrammar's compiler allocates without bound on these (std::bad_alloc after gigabytes);
    # llguidance would decode forced text until max_tokens.
    with pytest.raises(GrammarError, match="(no finite output: rule root|rules that) can never finish"):
        validate_spec(backend, "ebnf", grammar)


@pytest.mark.parametrize("grammar", ['root ::= "{" root "}" | "x"', 'root ::= item*\nitem ::= "(" item ")" | "x"',
                                     'root ::= ("a" | [b-d]+ "q")* x{2,3}\nx ::= "q"? [^\\]\\n]'])
def test_recursive_grammar_with_a_way_out_is_accepted(backend, grammar):
    validate_spec(backend, "ebnf", grammar)


def _nested_array_schema(depth: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.mark.parametrize("kind,spec,words", [
    ("json", json.dumps({"enum": [f"v{i}" for i in range(100_000)]}), "--max-grammar-spec-bytes"),
    ("json", json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                          for i in range(10_000)}}), "--max-grammar-spec-bytes"),
    ("choice", json.dumps([f"c{i}" for i in range(100_000)]), "--max-grammar-spec-bytes"),
    ("json", _nested_array_schema(900), f"nested 901 levels deep; at most {MAX_SPEC_DEPTH}"),
    ("regex", "(" * 500 + "a" + ")" * 500, "nested 500 levels deep"),
    ("ebnf", "root ::= " + "(" * 100 + '"a"' + ")" * 100, "nested 100 levels deep"),
])
def test_specs_over_the_size_budget_are_refused(backend, kind, spec, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        validate_spec(backend, kind, spec, max_spec_bytes=32768)


def test_the_size_budget_is_a_flag_and_strings_do_not_count_as_nesting():
    spec = json.dumps({"enum": [f"v{i}" for i in range(5000)]})
    with pytest.raises(GrammarError, match="is 43900 bytes; .* at most 32768 bytes"):
        check_spec("json", spec, 32768)
    check_spec("json", spec, 65536)
    check_spec("json", json.dumps({"const": "[" * 1000}), 65536)  # brackets inside a string
    check_spec("json", _nested_array_schema(MAX_SPEC_DEPTH - 1), 65536)
