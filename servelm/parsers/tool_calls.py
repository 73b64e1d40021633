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

Streaming follows OpenAI: a call's first delta carries its index, id, type and name, and later
deltas for that index carry ``function.arguments`` fragments as the model writes them. Arguments
stream for every JSON format once the text reads ``{"name": "<complete>", "arguments"`` (or
``"parameters"``) ``: {``; pythonic calls (and calls whose arguments are a JSON string) are emitted
whole by ``finish``. The fragments are the normalised arguments text (``json.dumps`` spacing, see
``json_prefix``), never raw model text, so they add up to the non-streamed ``arguments``.

Invariant: ``feed`` emits content only when no later text can turn it into part of a call, and
emits argument text only once no later text can change it; ``finish`` parses the whole text and
emits the rest. So, for any chunking, the streamed content concatenates to the non-streamed
content and each call's streamed name and argument fragments to the non-streamed call. (The one
exception: text that starts a call but never becomes a parseable one, e.g. cut off by max_tokens,
leaves a partial streamed call where the non-streamed message has none.)
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
class ToolCallDelta:
    """One streamed piece of call ``index``: the first carries id and name, the rest ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def json_prefix(text: str, start: int) -> tuple[str, int | None]:
    """The JSON value starting at ``text[start]``, re-serialised as ``json.dumps`` would (", " and
    ": " separators, ``ensure_ascii=False``), as far as the text fixes it; and the index just past
    the value once it is complete (None before).

    A prefix of the value gives a prefix of ``json.dumps(json.loads(value))``: strings are encoded
    character by character (a trailing partial escape waits), numbers and literals only once a
    delimiter ends them. Invalid JSON stops the output where it goes wrong. (Duplicate keys would
    break the prefix property; they are not valid for arguments anyway.)
    """
    out: list[str] = []
    depth, position, length = 0, start, len(text)
    while position < length:
        char = text[position]
        if char in " \t\r\n":
            position += 1
        elif char in "{[":
            out.append(char)
            depth, position = depth + 1, position + 1
        elif char in "}]":
            if depth == 0:
                break
            out.append(char)
            depth, position = depth - 1, position + 1
            if depth == 0:
                return "".join(out), position
        elif char in ",:":
            if depth == 0:
                break
            out.append(char + " ")
            position += 1
        elif char == '"':
            end = _string_end(text, position)
            if end is None:
                out.append(_partial_string(text[position + 1:]))
                break
            try:
                out.append(json.dumps(json.loads(text[position:end]), ensure_ascii=False))
            except json.JSONDecodeError:
                break
            position = end
            if depth == 0:
                return "".join(out), position
        else:
            end = position
            while end < length and text[end] not in " \t\r\n,:]}":
                end += 1
            if end == length:
                break  # a number or literal may go on
            try:
                out.append(json.dumps(json.loads(text[position:end])))
            except json.JSONDecodeError:
                break
            position = end
            if depth == 0:
                return "".join(out), position
    return "".join(out), None


def _string_end(text: str, start: int) -> int | None:
    """Index just past the string literal opening at ``text[start]``; None if it is unterminated."""
    position = start + 1
    while position < len(text):
        if text[position] == "\\":
            position += 2
        elif text[position] == '"':
            return position + 1
        else:
            position += 1
    return None


def _partial_string(body: str) -> str:
    """The opening quote and the encoded characters of an unterminated string literal's body; an
    escape not complete yet (including the high half of a surrogate pair) waits."""
    position = 0
    while position < len(body):
        if body[position] != "\\":
            position += 1
            continue
        size = 2
        if body[position + 1:position + 2] == "u":
            size = 6
            word = body[position + 2:position + 6]
            if len(word) == 4 and all(c in "0123456789abcdefABCDEF" for c in word) \
                    and 0xD800 <= int(word, 16) <= 0xDBFF:
                size = 12  # a surrogate pair comes as two escapes
        if position + size > len(body):
            break
        position += size
    try:
        decoded = json.loads('"' + body[:position] + '"')
    except json.JSONDecodeError:
        return ""
    return json.dumps(decoded, ensure_ascii=False)[:-1]


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                        r'\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass(slots=True)
class _PartialCall:
    name: str
    arguments: str
    """The normalised arguments text fixed so far."""
    is_complete: bool


def _scan_calls(text: str, position: int = 0) -> list[_PartialCall]:
    """The calls of a JSON call object, list, or ``;``-separated run of objects at ``position``, as
    far as they can stream: each ``{"name": ..., "arguments": {...}}`` in order, stopping at the
    first that is incomplete or not in that shape."""
    calls: list[_PartialCall] = []
    while True:
        while position < len(text) and text[position] in " \t\r\n,;[":
            position += 1
        head = _CALL_HEAD.match(text, position)
        if head is None:
            return calls
        arguments, end = json_prefix(text, head.end())
        calls.append(_PartialCall(json.loads(head.group(1)), arguments, end is not None))
        if end is None:
            return calls
        while end < len(text) and text[end] in " \t\r\n":
            end += 1
        if end >= len(text) or text[end] != "}":
            return calls  # other keys after the arguments: the rest waits for finish
        position = end + 1


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

    def partial_calls(self, text: str, is_region: bool) -> list[_PartialCall]:
        """Calls to stream from the region after ``marker`` (``is_region``) or from a whole output
        that starts with a lead; [] for formats that emit calls only at ``finish``."""
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

    def partial_calls(self, text: str, is_region: bool) -> list[_PartialCall]:
        if not is_region:
            body = text.lstrip()
            fence = re.match(r"```(?:json)?\s*", body)
            return _scan_calls(body, fence.end() if fence else 0)
        calls: list[_PartialCall] = []
        for body in text.split("<tool_call>"):
            block = _scan_calls(body.split("</tool_call>")[0])
            calls.extend(block)
            if not block or not block[-1].is_complete:
                break
        return calls


class _Llama3(_Format):
    marker = "<|python_tag|>"
    leads = ("{",)

    def partial_calls(self, text: str, is_region: bool) -> list[_PartialCall]:
        return _scan_calls(text)

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

    def partial_calls(self, text: str, is_region: bool) -> list[_PartialCall]:
        return _scan_calls(text) if is_region else []

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

    def partial_calls(self, text: str, is_region: bool) -> list[_PartialCall]:
        return _scan_calls(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = _calls_from_json(text)
        return ("", calls) if calls else (text, [])


_FORMATS: dict[str, type[_Format]] = {
    "hermes": _Hermes, "qwen25": _Hermes, "llama3": _Llama3, "llama3_json": _Llama3,
    "mistral": _Mistral, "pythonic": _Pythonic, "json": _Json,
}


@dataclass(slots=True)
class _Streamed:
    id: str
    name: str
    arguments: str
    """Argument text sent so far."""


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
        self.region_start = 0
        self.streamed: list[_Streamed] = []
        """Calls whose first delta went out, in index order."""
        self.calls: list[ToolCall] = []
        """The parsed calls of the whole text (after ``finish``), ids matching the streamed ones."""

    def feed(self, delta: str) -> ToolDelta:
        self.text += delta
        out = ToolDelta()
        if self.state == "head":
            stripped, leads = self.text.lstrip(), self.format.leads
            if leads and any(stripped.startswith(lead) for lead in leads):
                self.state = "held"  # the whole output may be calls: content decided at finish
            elif leads and any(lead.startswith(stripped) for lead in leads):
                return out  # undecided: only whitespace or part of a lead so far
            else:
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
        if self.state in ("region", "held"):
            partial = self.format.partial_calls(self.text[self.region_start:], self.state == "region")
            out.calls = self._advance(partial)
        return out

    def _advance(self, partial: list[_PartialCall]) -> list[ToolCallDelta]:
        """Deltas that bring the streamed calls up to ``partial``."""
        deltas = []
        for index, call in enumerate(partial):
            if index == len(self.streamed):
                self.streamed.append(_Streamed(ToolCall(call.name, "").id, call.name, ""))
                deltas.append(ToolCallDelta(index, call.arguments, self.streamed[index].id, call.name))
            else:
                sent = self.streamed[index]
                if not call.arguments.startswith(sent.arguments) or call.name != sent.name:
                    break  # cannot happen for valid JSON; never retract what went out
                if len(call.arguments) > len(sent.arguments):
                    deltas.append(ToolCallDelta(index, call.arguments[len(sent.arguments):]))
            self.streamed[index].arguments = call.arguments
        return deltas

    def finish(self) -> ToolDelta:
        content, calls = self.format.parse(self.text)
        emitted = self.text[:self.num_content_chars]
        assert content.startswith(emitted), "streamed content must be a prefix of the parsed content"
        deltas = []
        for index, call in enumerate(calls):
            if index < len(self.streamed):
                sent = self.streamed[index]
                call.id = sent.id
                if call.name == sent.name and call.arguments.startswith(sent.arguments):
                    if len(call.arguments) > len(sent.arguments):
                        deltas.append(ToolCallDelta(index, call.arguments[len(sent.arguments):]))
            else:
                deltas.append(ToolCallDelta(index, call.arguments, call.id, call.name))
        self.calls = calls
        return ToolDelta(content=content[len(emitted):], calls=deltas)


def parse_tool_calls(name: str, text: str) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (content, calls) of the whole text."""
    return _FORMATS[name]().parse(text)
