"""Tool-call parsers on canned model text: streamed in any chunking == parsed whole."""

from __future__ import annotations

import json
import random

import pytest

from servelm.parsers.tool_calls import ToolCallParser, parse_tool_calls

CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("qwen25", '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```',
     "", [("add", {"a": 1, "b": 2})]),
    ("qwen25", '{"name": "add", "arguments": "{\\"a\\": 1}"}', "", [("add", {"a": 1})]),
    ("hermes", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2]}}]',
     "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", "Plain answer with a < sign and <tool", "Plain answer with a < sign and <tool", []),
    ("hermes", '{"answer": 42}', '{"answer": 42}', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "x"}}', "", [("f", {"q": "x"})]),
    ("llama3", '<|python_tag|>{"name": "search", "parameters": {"query": "cats"}}',
     "", [("search", {"query": "cats"})]),
    ("llama3_json", '{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
     "", [("a", {"n": 1}), ("b", {})]),
    ("llama3", "No tools needed here.", "No tools needed here.", []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"k": "v"}}, {"name": "g", "arguments": {}}]',
     "Sure ", [("f", {"k": "v"}), ("g", {})]),
    ("mistral", "[TOOL no calls", "[TOOL no calls", []),
    ("pythonic", '[get_weather(city="San Francisco", days=3), get_time()]',
     "", [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {})]),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("json", '[{"name": "f", "arguments": {"x": true}}]', "", [("f", {"x": True})]),
]


def _calls(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_text(parser, text, content, calls):
    parsed_content, parsed_calls = parse_tool_calls(parser, text)
    assert parsed_content == content
    assert _calls(parsed_calls) == calls


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_any_chunking_equals_whole(parser, text, content, calls):
    for seed in range(25):
        rng = random.Random(seed)
        stream = ToolCallParser(parser)
        streamed_content, streamed_calls, position = "", [], 0
        while position < len(text):
            end = position + rng.randint(1, 7)
            delta = stream.feed(text[position:end])
            streamed_content += delta.content
            streamed_calls += delta.calls
            position = end
        delta = stream.finish()
        assert streamed_content + delta.content == content, seed
        assert _calls(streamed_calls + delta.calls) == calls, seed


def test_hermes_streams_content_and_calls_before_the_end():
    stream = ToolCallParser("hermes")
    assert stream.feed("Checking ").content == "Checking "
    assert stream.feed("now <tool_").content == "now "
    delta = stream.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert _calls(delta.calls) == [("f", {})]  # emitted as soon as the call closes
    assert not stream.finish().calls


def test_unknown_parser_is_an_error():
    with pytest.raises(ValueError):
        ToolCallParser("nope")
