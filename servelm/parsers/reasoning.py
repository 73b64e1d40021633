"""Reasoning parsers: split ``<think>...</think>`` into reasoning_content and content.

deepseek-r1: the chat template opens ``<think>``, so output starts in reasoning (an explicit
``<think>`` is dropped) and ends reasoning at ``</think>``; no ``</think>`` means all reasoning.
qwen3: output is in reasoning only if it starts with ``<think>`` or the prompt already ended with
``<think>`` (the template opened it); otherwise it is all content.

Invariant: a tag split across deltas is held back until it can be decided, so any chunking of the
same text gives the same (reasoning, content) concatenation as the whole text at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.parsers.text import partial_suffix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek-r1", "qwen3")


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Streams one output; ``mode`` is "deepseek-r1" or "qwen3"."""

    def __init__(self, mode: str, prompt_text: str = "") -> None:
        if mode not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {mode!r}")
        self.mode = mode
        opened = prompt_text.rstrip().endswith(START)
        # start: undecided (qwen3); head: reasoning, an explicit <think> may still come;
        # reasoning; content_head: after </think>, dropping whitespace; content.
        self.state = "head" if (mode == "deepseek-r1" or opened) else "start"
        self.buffer = ""

    def feed(self, delta: str) -> ReasoningDelta:
        self.buffer += delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            if self.state in ("start", "head"):
                stripped = self.buffer.lstrip()
                if stripped.startswith(START):
                    self.buffer, self.state = stripped[len(START):], "reasoning"
                elif not final and START.startswith(stripped):
                    return out  # may still become <think>
                else:
                    self.state = "content" if self.state == "start" else "reasoning"
            elif self.state == "reasoning":
                index = self.buffer.find(END)
                if index >= 0:
                    out.reasoning += self.buffer[:index]
                    self.buffer, self.state = self.buffer[index + len(END):], "content_head"
                    continue
                keep = 0 if final else partial_suffix(self.buffer, END)
                out.reasoning += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            elif self.state == "content_head":
                self.buffer = self.buffer.lstrip()
                if not self.buffer and not final:
                    return out
                self.state = "content"
            else:
                out.content += self.buffer
                self.buffer = ""
                return out
