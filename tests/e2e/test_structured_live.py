"""Structured output and tool calls on a live server (SmolLM2-135M) through the openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                           "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]


@pytest.fixture(scope="module")
def server(clients_server):
    """The session's clients server (SmolLM2-135M with --tool-call-parser qwen25, a 2048-token
    context; shared with test_clients_live)."""
    return clients_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_response_format_json_schema_and_object(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                              "strict": True}}
    for seed in (1,):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], seed=seed,
            temperature=1.0, max_tokens=40, response_format=response_format)
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], seed=3, max_tokens=40,
        response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
def test_response_format_json_object(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object please."}], seed=4,
        max_tokens=200, response_format={"type": "json_object"}, temperature=0.0)
    text = chat.choices[0].message.content
    assert text.startswith("{")
    if chat.choices[0].finish_reason == "stop":  # an unbounded object may hit max_tokens
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_tool_choice_required(client, seed):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="required", seed=seed, max_tokens=80)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)


def test_tool_choice_named(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, seed=5, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = chat.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"]
    _check_calls(calls)


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", seed=7, max_tokens=80, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:  # OpenAI's shape: the first delta has id, type and name
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": "", "num_fragments": 0}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
            calls[delta.index]["num_fragments"] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMETERS[entry["name"]])
        assert entry["num_fragments"] > 2  # the arguments streamed as they were generated


@pytest.mark.slow
def test_tool_choice_auto_answers(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=1,
                                          max_tokens=40, temperature=0.0)
    message = chat.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:
        assert chat.choices[0].finish_reason == "tool_calls"


def test_vllm_and_sglang_forms(ops_server, client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                                          max_tokens=10, extra_body={"guided_choice": ["left", "right"]})
    assert chat.choices[0].message.content in ("left", "right")
    completion = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, seed=2,
                                           extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", completion.choices[0].text)
    # SGLang's /generate on the operations server (the same model): the clients server answers
    # /generate in TGI's form (--use_tgi_api)
    server = ops_server
    body = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Answer:", "sampling_params": {"max_new_tokens": 20, "regex": "(yes|no)!"}}).json()
    assert body["text"] in ("yes!", "no!")
    body = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "JSON:", "sampling_params": {"max_new_tokens": 40, "json_schema": json.dumps(PERSON)}}).json()
    jsonschema.validate(json.loads(body["text"]), PERSON)


def test_invalid_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integer",
                                                                                   "minimum": 5, "maximum": 1}}})
    assert "minimum" in str(caught.value) or "maximum" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="parenthesis"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "(ab"})
