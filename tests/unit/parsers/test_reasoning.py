"""Reasoning parsers on canned text: streamed in any chunking == parsed whole."""

from __future__ import annotations

import random

import pytest

from servelm.parsers.reasoning import ReasoningParser

CASES = [
    ("deepseek-r1", "", "<think>\nWeigh it.\n</think>\n\nThe answer is 4.", "\nWeigh it.\n",
     "The answer is 4."),
    ("deepseek-r1", "<think>\n", "Template opened it.</think>Done.", "Template opened it.", "Done."),
    ("deepseek-r1", "", "still thinking, cut off", "still thinking, cut off", ""),
    ("qwen3", "", "<think>a < b</think>\n\nyes", "a < b", "yes"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened</think>answer", "opened", "answer"),
    ("qwen3", "", "No thinking at all, </think> is just text", "",
     "No thinking at all, </think> is just text"),
    ("qwen3", "", "<thin", "", "<thin"),
]


def _run(mode, prompt, chunks):
    parser = ReasoningParser(mode, prompt)
    reasoning = content = ""
    for chunk in chunks:
        delta = parser.feed(chunk)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize("mode,prompt,text,reasoning,content", CASES)
def test_whole_and_any_chunking(mode, prompt, text, reasoning, content):
    assert _run(mode, prompt, [text]) == (reasoning, content)
    for seed in range(30):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _run(mode, prompt, chunks) == (reasoning, content), chunks


def test_reasoning_streams_before_the_end_tag():
    parser = ReasoningParser("deepseek-r1")
    assert parser.feed("step one, ").reasoning == "step one, "
    delta = parser.feed("step two</th")
    assert delta.reasoning == "step two" and delta.content == ""
    delta = parser.feed("ink>answer")
    assert delta.content == "answer"
