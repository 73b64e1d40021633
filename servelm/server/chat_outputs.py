"""One chat choice's text -> OpenAI message fields: content, reasoning_content and tool_calls.

The reasoning parser (``--reasoning-parser``) runs first; its content goes through the tool-call
parser when the request has tools. Streaming and non-streaming use the same ``feed``/``finish``,
so the streamed deltas add up to the non-streamed message. Tool calls stream as OpenAI does: a
call's first delta has its index, id, type and name, later ones ``function.arguments`` fragments.
"""

from __future__ import annotations

from typing import Any

from servelm.parsers.reasoning import ReasoningParser
from servelm.parsers.tool_calls import ToolCall, ToolCallDelta, ToolCallParser


class ChatOutputParser:
    """Splits one choice's text; ``reasoning`` and ``tools`` are parser names or None."""

    def __init__(self, reasoning: str | None, tools: str | None, prompt_text: str) -> None:
        self.reasoning = ReasoningParser(reasoning, prompt_text) if reasoning else None
        self.tools = ToolCallParser(tools) if tools else None
        self.content = ""
        self.reasoning_content = ""
        self.calls: list[ToolCall] = []

    @property
    def is_active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str) -> dict[str, Any]:
        return self._step(text, final=False)

    def finish(self) -> dict[str, Any]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.finish() if final else self.reasoning.feed(text)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            delta = self.tools.feed(content) if content or not final else None
            content = delta.content if delta is not None else ""
            calls = list(delta.calls) if delta is not None else []
            if final:
                rest = self.tools.finish()
                content += rest.content
                calls += rest.calls
                self.calls = self.tools.calls
        self.content += content
        self.reasoning_content += reasoning
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [call.to_openai() for call in merge_call_deltas(calls)]
        return out

    @property
    def has_calls(self) -> bool:
        """Whether any tool call was parsed or started streaming (finish_reason "tool_calls")."""
        return bool(self.calls or (self.tools is not None and self.tools.streamed))

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message (after ``finish``)."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.content if (self.content or not self.calls) else None,
                                   "refusal": None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning_content or None
        if self.calls:
            message["tool_calls"] = [call.to_openai() for call in self.calls]
        return message


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call index (first-seen order): argument fragments of the same call joined."""
    merged: dict[int, ToolCallDelta] = {}
    for delta in deltas:
        if delta.index not in merged:
            merged[delta.index] = ToolCallDelta(delta.index, delta.arguments, delta.id, delta.name)
        else:
            merged[delta.index].arguments += delta.arguments
    return list(merged.values())


def merge_tool_call_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI ``delta.tool_calls`` entries with one entry per index (arguments joined in order)."""
    merged: dict[int, dict[str, Any]] = {}
    for entry in entries:
        first = merged.get(entry["index"])
        if first is None:
            merged[entry["index"]] = {**entry, "function": dict(entry["function"])}
        else:
            first["function"]["arguments"] += entry["function"]["arguments"]
    return list(merged.values())
