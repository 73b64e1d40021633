"""/v1/responses against the scripted fake engine: reasoning items, streamed events adding up to
the response, the text.format mapping and refusals."""

from __future__ import annotations

import json

from server_fakes import MODEL_NAME, FakeEngine


def _events(response) -> list[dict]:
    events = []
    for block in response.text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "):
            event = json.loads(lines[1][6:])
            assert event["type"] == lines[0][7:]
            events.append(event)
        else:
            assert not block.strip(), block
    return events


def test_reasoning_and_message_items_streamed_and_not(tokenizer, make_client) -> None:
    engine = FakeEngine(tokenizer, context_length=1024, reply=lambda prompt, params: "<think>hmm</think>yes")
    client = make_client(engine, reasoning_parser="qwen3")
    body = {"model": MODEL_NAME, "input": "2+2?", "instructions": "Be brief.", "max_output_tokens": 100}
    whole = client.post("/v1/responses", json=body).json()
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "hmm"
    assert message["type"] == "message" and message["content"][0]["text"] == "yes"
    assert whole["usage"]["output_tokens"] == len("<think>hmm</think>yes") + 1  # + EOS
    events = _events(client.post("/v1/responses", json={**body, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "hmm"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "yes"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "yes"
    # The instructions became the system message of the chat template.
    prompt = tokenizer.decode(engine.requests[0][1])
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_text_format_and_length(tokenizer, make_client) -> None:
    engine = FakeEngine(tokenizer, context_length=1024)
    client = make_client(engine)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = client.post("/v1/responses", json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "max_output_tokens": 3, "temperature": 0.5, "seed": 7,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["text"]["format"]["type"] == "json_schema"
    params = engine.requests[0][2]
    assert params.max_tokens == 3 and params.temperature == 0.5 and params.seed == 7
    assert params.structured.kind == "json" and json.loads(params.structured.spec) == schema


def test_refusals(client) -> None:
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools"),
                         ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].type"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                          "input[0].content[0].type"),
                         ({"text": {"format": {"type": "xml"}}}, "text.format.type")]:
        response = client.post("/v1/responses", json={"input": "hi", **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param
