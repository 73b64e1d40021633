"""Tool-call parsers: turn a model's text into OpenAI tool calls, streaming or not.

Formats (``--tool-call-parser``):
- hermes / qwen25: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated for
  parallel calls, text around them is content. A bare JSON call object (or a list of them),
  optionally in a ```json fence, is also a call: the Qwen models often answer that way.
- llama3 / llama3_json: optional ``<|python_tag|>``, then JSON objects ``{"name", "parameters"}``
  separated by ``;``.
- mistral: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}``.
- pythonic: a Python list of calls, ``[get_weather(city="Paris"), now()]``.
- json (internal, for tool_choice required/named): a JSON list of ``{"name", "arguments"}``,
  which constrained decoding guarantees.

Invariant: ``feed`` emits content only when no later text can turn it into part of a call, and
emits a call only once it is complete; ``finish`` parses the whole text and emits the rest. So the
streamed content concatenates to the non-streamed content, and the streamed calls are the
non-streamed calls, for any chunking.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from servelm.parsers.text import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "llama3_json", "mistral", "pythonic", "json")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _call_from_object(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
                      ) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls_from_json(text: str) -> list[ToolCall] | None:
    """A JSON call object or list of them (``` fence allowed); None when it is not one."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    if fence:
        body = fence.group(1)
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_object(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


class _Format:
    """One format: where calls may start, and how to parse the whole text."""

    marker: str | None = None
    """A tag that opens the tool-call region anywhere in the text."""
    leads: tuple[str, ...] = ()
    """If the (left-stripped) text starts with one of these, the whole output may be calls."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def complete_calls(self, region: str) -> list[ToolCall]:
        """Calls already complete in the region after ``marker`` (streaming); [] if unknown."""
        return []


class _Hermes(_Format):
    marker = "<tool_call>"
    leads = ("{", "[", "```")
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def _parse_blocks(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._block.finditer(text):
            call = _calls_from_json(match.group(1))
            calls.extend(call or [])
        return calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            calls = _calls_from_json(text) if text.lstrip().startswith(self.leads) else None
            return ("", calls) if calls else (text, [])
        calls = self._parse_blocks(text)
        last_end = text.rfind("</tool_call>")
        tail = text[last_end + len("</tool_call>"):] if last_end > start else ""
        if last_end < start:  # an unterminated final call: take its body if it parses
            calls.extend(_calls_from_json(text[start + len("<tool_call>"):]) or [])
        if not calls:
            return text, []
        return text[:start] + tail.strip(), calls

    def complete_calls(self, region: str) -> list[ToolCall]:
        return self._parse_blocks("<tool_call>" + region)


class _Llama3(_Format):
    marker = "<|python_tag|>"
    leads = ("{",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        prefix, body = (text[:start], text[start + len(self.marker):]) if start >= 0 else ("", text)
        if start < 0 and not text.lstrip().startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        body = body.strip()
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_object(value, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return (prefix, calls) if calls else (text, [])


class _Mistral(_Format):
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = _calls_from_json(text[start + len(self.marker):])
        return (text[:start], calls) if calls else (text, [])


class _Pythonic(_Format):
    leads = ("[",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) \
                    or node.args:
                return text, []
            name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            except ValueError:
                return text, []
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return "", calls


class _Json(_Format):
    leads = ("[", "{")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = _calls_from_json(text)
        return ("", calls) if calls else (text, [])


_FORMATS: dict[str, type[_Format]] = {
    "hermes": _Hermes, "qwen25": _Hermes, "llama3": _Llama3, "llama3_json": _Llama3,
    "mistral": _Mistral, "pythonic": _Pythonic, "json": _Json,
}


class ToolCallParser:
    """Streams one output through a format; see the module invariant."""

    def __init__(self, name: str) -> None:
        if name not in _FORMATS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(_FORMATS)}")
        self.format = _FORMATS[name]()
        self.text = ""
        self.state = "head"  # head -> content -> region, or head -> held
        self.num_content_chars = 0
        """Characters of ``text`` emitted as content."""
        self.num_calls = 0
        self.region_start = 0

    def feed(self, delta: str) -> ToolDelta:
        self.text += delta
        out = ToolDelta()
        if self.state == "head":
            stripped, leads = self.text.lstrip(), self.format.leads
            if leads and any(stripped.startswith(lead) for lead in leads):
                self.state = "held"  # the whole output may be calls: decided at finish
                return out
            if leads and any(lead.startswith(stripped) for lead in leads):
                return out  # undecided: only whitespace or part of a lead so far
            self.state = "content"
        if self.state == "content":
            marker = self.format.marker
            end = len(self.text)
            if marker is not None:
                index = self.text.find(marker, self.num_content_chars)
                if index >= 0:
                    end, self.state, self.region_start = index, "region", index + len(marker)
                else:
                    end -= partial_suffix(self.text, marker)
            out.content = self.text[self.num_content_chars:end]
            self.num_content_chars = max(self.num_content_chars, end)
        if self.state == "region":
            calls = self.format.complete_calls(self.text[self.region_start:])
            out.calls = calls[self.num_calls:]
            self.num_calls = max(self.num_calls, len(calls))
        return out

    def finish(self) -> ToolDelta:
        content, calls = self.format.parse(self.text)
        emitted = self.text[:self.num_content_chars]
        assert content.startswith(emitted), "streamed content must be a prefix of the parsed content"
        return ToolDelta(content=content[len(emitted):], calls=calls[self.num_calls:])


def parse_tool_calls(name: str, text: str) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (content, calls) of the whole text."""
    return _FORMATS[name]().parse(text)
