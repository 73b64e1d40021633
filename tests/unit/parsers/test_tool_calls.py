"""Tool-call parsers on canned model text: streamed in any chunking == parsed whole."""

from __future__ import annotations

import json
import random

import pytest

from servelm.parsers.tool_calls import ToolCallParser, json_prefix, parse_tool_calls

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


def _stream(parser: str, text: str, rng: random.Random) -> tuple[str, list[dict], ToolCallParser]:
    """Feed ``text`` in random chunks; the content and the calls assembled OpenAI-style by index."""
    stream = ToolCallParser(parser)
    content, calls, position = "", {}, 0
    deltas = []
    while position < len(text):
        end = position + rng.randint(1, 7)
        deltas.append(stream.feed(text[position:end]))
        position = end
    deltas.append(stream.finish())
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            entry = piece.to_openai()
            if piece.index not in calls:  # the first delta of a call names it
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                calls[piece.index] = {"id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
            else:
                assert "id" not in entry and "name" not in entry["function"]
            calls[piece.index]["arguments"] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], stream


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_any_chunking_equals_whole(parser, text, content, calls):
    _, whole_calls = parse_tool_calls(parser, text)
    for seed in range(25):
        streamed_content, streamed_calls, stream = _stream(parser, text, random.Random(seed))
        assert streamed_content == content, seed
        # exact text: the argument fragments add up to the non-streamed arguments string
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == \
            [(c.name, c.arguments) for c in whole_calls], seed
        assert [c["id"] for c in streamed_calls] == [c.id for c in stream.calls]


STREAMING = [  # (parser, text); each call's arguments must start streaming before the text ends
    ("hermes", 'Hi<tool_call>\n{"name": "f", "arguments": {"city":"Paris","days" : 3,"tags":["a","b"]}}\n'
               '</tool_call><tool_call>{"name": "g", "arguments": '
               '{"q": "caf\\u00e9 \\"x\\" \\ud83d\\ude00 naïve"}}'
               '</tool_call>'),
    ("qwen25", '{"name": "add", "arguments": {"a": 1.50, "b": -2e3, "c": null, "d": {"e": [true, false]}}}'),
    ("llama3", '<|python_tag|>{"name": "search", "parameters": {"query": "long text here"}}; '
               '{"name": "other", "parameters": {"n": 10}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"k": "value one"}}, '
                '{"name": "g", "arguments": {"x": [1]}}]'),
    ("json", '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'),
]


@pytest.mark.parametrize("parser,text", STREAMING)
def test_arguments_stream_as_they_are_written(parser, text):
    _, whole_calls = parse_tool_calls(parser, text)
    assert whole_calls
    for seed in range(40):
        _, streamed_calls, _ = _stream(parser, text, random.Random(seed))
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == \
            [(c.name, c.arguments) for c in whole_calls], seed
    # Cut inside the last call's arguments: its name and part of its arguments are already out.
    cut = text.rindex('": ', 0, text.rindex("}") - 2) + 3
    stream = ToolCallParser(parser)
    pieces = stream.feed(text[:cut]).calls
    last = len(whole_calls) - 1
    started = [p for p in pieces if p.index == last]
    assert started and started[0].name == whole_calls[last].name
    sent = "".join(p.arguments for p in started)
    assert len(sent) > 1 and whole_calls[last].arguments.startswith(sent)
    assert len(sent) < len(whole_calls[last].arguments)


def test_pythonic_calls_come_whole_at_the_end():
    stream = ToolCallParser("pythonic")
    assert not stream.feed('[get_weather(city="Paris"), ').calls
    assert not stream.feed("now()]").calls
    rest = stream.finish().calls
    assert [(p.index, p.name, p.arguments) for p in rest] == [(0, "get_weather", '{"city": "Paris"}'),
                                                               (1, "now", "{}")]


@pytest.mark.parametrize("value", [
    {"a": 1, "b": [True, None, 2.5, -0.0, 1e300], "c": "x\ny\u00e9\U0001F600 \"q\" \\ end"},
    {}, [], {"k": {"z": [], "w": {}}}, "plain", 12345, [[1, [2, [3]]], {"x": "\t"}],
])
def test_json_prefix_of_any_cut_is_a_prefix_of_the_normalised_text(value):
    full = json.dumps(value, ensure_ascii=False)
    for raw in (json.dumps(value), json.dumps(value, separators=(",", ":")),
                json.dumps(value, indent=2), json.dumps(value, ensure_ascii=False)):
        for cut in range(len(raw) + 1):
            prefix, end = json_prefix(raw[:cut], 0)
            assert full.startswith(prefix), (raw[:cut], prefix)
            if end is not None:
                assert prefix == full and end == len(raw)
        prefix, end = json_prefix(raw + " tail", 0)
        assert prefix == full and end == len(raw)


def test_hermes_streams_content_and_calls_before_the_end():
    stream = ToolCallParser("hermes")
    assert stream.feed("Checking ").content == "Checking "
    assert stream.feed("now <tool_").content == "now "
    delta = stream.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert [(p.index, p.name, p.arguments) for p in delta.calls] == [(0, "f", "{}")]
    assert not stream.finish().calls


def test_unknown_parser_is_an_error():
    with pytest.raises(ValueError):
        ToolCallParser("nope")
