"""Structured output and tools at the edge: request fields -> StructuredSpec, validated (400s).

Request forms: OpenAI ``response_format`` (json_object, json_schema), vLLM ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (and the same keys in
``structured_outputs``), SGLang ``sampling_params.json_schema / regex / ebnf``; and the JSON schema
that forces tool calls for ``tool_choice`` "required" or a named function.

Invariant: a spec that reaches the engine has been checked by ``validate`` (the size budget,
satisfiability and the tokenizer-free grammar build), so a bad, oversized or empty schema or
regex is a 400 naming the problem, never an engine error. The engine repeats the cheap checks
(the offline API has no server) and enforces the compile-time budget, also with a 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from servelm.constrained.grammar import GrammarError, validate_spec
from servelm.errors import InvalidRequestError
from servelm.sampling.params import StructuredSpec

_VLLM_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "ebnf"}
_STRUCTURED_OUTPUTS_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "ebnf"}


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        if isinstance(value, str):
            return StructuredSpec("json", value)
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON schema object", param)
        return StructuredSpec("json", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param)
        return StructuredSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param)
    return StructuredSpec(kind, value)


def _response_format_spec(response_format: Any) -> StructuredSpec | None:
    kind = response_format.type
    extra = response_format.model_extra or {}
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        container = extra.get("json_schema")
        if not isinstance(container, dict):
            raise InvalidRequestError("response_format json_schema needs a json_schema object with a "
                                      "schema", "response_format.json_schema")
        schema = container.get("schema", container.get("json_schema"))
        if schema is None:
            raise InvalidRequestError("response_format.json_schema.schema is required",
                                      "response_format.json_schema.schema")
        return _spec("json", schema, "response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format type must be text, json_object or json_schema, got "
                              f"{kind!r}", "response_format.type")


def openai_structured_spec(request: Any) -> tuple[StructuredSpec | None, str | None]:
    """The (spec, param it came from) of a /v1 request; 400 when more than one form is given."""
    found: list[tuple[StructuredSpec, str]] = []
    if request.response_format is not None:
        spec = _response_format_spec(request.response_format)
        if spec is not None:
            found.append((spec, "response_format" if spec.kind == "json_object"
                          else "response_format.json_schema.schema"))
    extra = request.model_extra or {}
    for key, kind in _VLLM_KEYS.items():
        if extra.get(key) is not None:
            found.append((_spec(kind, extra[key], key), key))
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
        for key, kind in _STRUCTURED_OUTPUTS_KEYS.items():
            if outputs.get(key) is not None:
                found.append((_spec(kind, outputs[key], f"structured_outputs.{key}"),
                              f"structured_outputs.{key}"))
    if len(found) > 1:
        raise InvalidRequestError(f"give one structured-output constraint, got {[p for _, p in found]}",
                                  found[1][1])
    return found[0] if found else (None, None)


def native_structured_spec(params: Any) -> tuple[StructuredSpec | None, str | None]:
    """SGLang's sampling_params json_schema / regex / ebnf."""
    found = [(_spec(kind, getattr(params, name), f"sampling_params.{name}"), f"sampling_params.{name}")
             for name, kind in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"))
             if getattr(params, name) is not None]
    if len(found) > 1:
        raise InvalidRequestError("give only one of json_schema, regex and ebnf", found[1][1])
    return found[0] if found else (None, None)


async def validate(config: Any, spec: StructuredSpec | None, param: str | None) -> None:
    """400 naming the problem when the spec does not compile (off the event loop: can be slow)."""
    if spec is None:
        return
    structured = config.structured
    try:
        await asyncio.to_thread(validate_spec, structured.grammar_backend, spec.kind, spec.spec,
                                structured.constrained_json_whitespace_pattern,
                                structured.max_grammar_spec_bytes)
    except GrammarError as error:
        raise InvalidRequestError(str(error), param) from None


# -- tools -------------------------------------------------------------------------------------

def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The function definitions of ``tools``; 400 for a malformed tool or tool_choice."""
    functions: list[dict[str, Any]] = []
    for position, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"tools[{position}] must be {{'type': 'function', 'function': "
                                      "{'name': ..., 'parameters': {...}}}", f"tools[{position}]")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{position}].function.parameters must be a JSON schema "
                                      "object", f"tools[{position}].function.parameters")
        functions.append(function)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if not any(f["name"] == name for f in functions):
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools",
                                      "tool_choice")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise InvalidRequestError("tool_choice must be none, auto, required or a named function",
                                  "tool_choice")
    if tool_choice == "required" and not functions:
        raise InvalidRequestError("tool_choice required needs tools", "tool_choice")
    return functions


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_tool_spec(functions: list[dict[str, Any]], tool_choice: Any,
                     parallel: bool) -> StructuredSpec | None:
    """The grammar that makes the output a JSON list of calls (tool_choice required or named)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [f for f in functions if f["name"] == name]
        items: dict[str, Any] = _call_schema(chosen[0])
    elif tool_choice == "required":
        schemas = [_call_schema(f) for f in functions]
        items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    else:
        return None
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel or isinstance(tool_choice, dict):
        schema["maxItems"] = 1
    return StructuredSpec("json", json.dumps(schema))
