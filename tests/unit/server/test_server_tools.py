"""Tool calls and reasoning through the chat route, on scripted model text (FakeEngine).

The streamed deltas must add up to the non-streamed message, in the OpenAI shapes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_fakes import MODEL_NAME, FakeEngine, build_tokenizer, sse_events

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def _engine(tokenizer: Any, text: str) -> FakeEngine:
    return FakeEngine(tokenizer, context_length=1024, reply=lambda prompt, params: text)


def _both(client, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    message = client.post("/v1/chat/completions", json=body)
    assert message.status_code == 200, message.text
    stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    return message.json(), sse_events(stream)


def _merge(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
                assert call.get("id", "call_").startswith("call_") and call.get("type", "function") == "function"
            finish = choice["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}, finish


def test_hermes_tool_calls_stream_like_the_message(tokenizer, make_client):
    client = make_client(_engine(tokenizer, HERMES), tool_call_parser="hermes")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "max_tokens": 400}
    message, chunks = _both(client, body)
    choice = message["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    merged, finish = _merge(chunks)
    assert finish == "tool_calls" and merged["content"] == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in merged["calls"]] == calls


def test_auto_tool_choice_needs_a_parser_flag(tokenizer, make_client):
    client = make_client(_engine(tokenizer, HERMES))
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "the chat template does not declare tool support" in response.json()["error"]["message"]
    client = make_client(_engine(tokenizer, "plain answer"), enable_auto_tool_choice=True)
    message = client.post("/v1/chat/completions", json={**body, "max_tokens": 50}).json()
    assert message["choices"][0]["message"]["content"] == "plain answer"
    assert message["choices"][0]["finish_reason"] != "tool_calls"


QWEN_LIKE = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}"
             "\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
             "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_auto_tool_choice_from_the_template_with_no_flags(tmp_path, caplog, make_client):
    """A template that declares tools in the hermes format: tools with the default tool_choice
    (auto) are parsed with no flag, the tools reach the prompt, and the choice is logged."""
    tokenizer = build_tokenizer(tmp_path, QWEN_LIKE)
    prompts: list[str] = []
    engine = FakeEngine(tokenizer, context_length=1024,
                        reply=lambda prompt, params: prompts.append(tokenizer.decode(prompt)) or HERMES)
    with caplog.at_level("INFO", logger="servelm.server.serving"):
        client = make_client(engine)
    assert "tool_choice auto parsed as hermes (the chat template declares tools" in caplog.text
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "max_tokens": 400}
    message, chunks = _both(client, body)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message["choices"][0]["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert _merge(chunks)[1] == "tool_calls"
    assert '"name": "get_weather"' in prompts[0] and "<tool_call>" in prompts[0]


def test_required_tool_choice_sends_a_grammar(tokenizer, make_client):
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    engine = _engine(tokenizer, text)
    client = make_client(engine, tool_call_parser="mistral")  # forced calls ignore the parser
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": "required", "max_tokens": 200}
    message, chunks = _both(client, body)
    spec = engine.requests[0][2].structured
    schema = json.loads(spec.spec)
    assert spec.kind == "json" and schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["properties"]["name"] == {"const": "get_weather"}
    call = message["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert message["choices"][0]["message"]["content"] is None
    merged, finish = _merge(chunks)
    assert finish == "tool_calls" and json.loads(merged["calls"][0]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek-r1", "Let me think.</think>\n\nIt is 4.", "Let me think.", "It is 4."),
    ("qwen3", "<think>hmm</think>yes", "hmm", "yes"),
    ("qwen3", "no tags here", None, "no tags here"),
])
def test_reasoning_parser(tokenizer, make_client, parser, text, reasoning, content):
    client = make_client(_engine(tokenizer, text), reasoning_parser=parser)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200}
    message, chunks = _both(client, body)
    assert message["choices"][0]["message"]["reasoning_content"] == reasoning
    assert message["choices"][0]["message"]["content"] == content
    merged, _ = _merge(chunks)
    assert merged["reasoning"] == (reasoning or "") and merged["content"] == content


def test_structured_specs_reach_the_engine(tokenizer, make_client):
    engine = _engine(tokenizer, "left")
    client = make_client(engine)
    for extra, kind in [({"guided_choice": ["left", "right"]}, "choice"),
                        ({"response_format": {"type": "json_object"}}, "json_object"),
                        ({"guided_grammar": 'root ::= "a"'}, "ebnf"),
                        ({"structured_outputs": {"regex": "[ab]+"}}, "regex")]:
        response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                         "max_tokens": 5, **extra})
        assert response.status_code == 200, response.text
        assert engine.requests[-1][2].structured.kind == kind
