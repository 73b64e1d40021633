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
                         ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"tools": [{"type": "function"}]}, "tools[0].name"),
                         ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
                         ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
                          "input[0].arguments"),
                         ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                         ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                          "input[0].content[0]"),  # a text-only model
                         ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
                          "input[0].content[0].type"),
                         ({"text": {"format": {"type": "xml"}}}, "text.format.type")]:
        response = client.post("/v1/responses", json={"input": "hi", **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_function_calls_streamed_and_not(tokenizer, make_client) -> None:
    engine = FakeEngine(tokenizer, context_length=1024, reply=lambda prompt, params: HERMES)
    client = make_client(engine, tool_call_parser="hermes")
    body = {"model": MODEL_NAME, "input": "weather in Paris and Rome?", "tools": TOOLS,
            "max_output_tokens": 400}
    whole = client.post("/v1/responses", json=body).json()
    message, *calls = whole["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Checking."
    assert [(c["type"], c["name"], json.loads(c["arguments"]), c["status"]) for c in calls] == [
        ("function_call", "get_weather", {"city": "Paris"}, "completed"),
        ("function_call", "get_weather", {"city": "Rome"}, "completed")]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc") for c in calls)
    assert whole["tools"][0]["name"] == "get_weather" and whole["tool_choice"] == "auto"
    events = _events(client.post("/v1/responses", json={**body, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"
             and e["item"]["type"] == "function_call"]
    assert [(i["name"], i["arguments"], i["status"]) for i in added] == [("get_weather", "", "in_progress")] * 2
    for index, item in enumerate(final["output"][1:], start=1):
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                         and e["output_index"] == index)
        [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"
                  and e["output_index"] == index]
        assert deltas == done["arguments"] == item["arguments"]
        assert json.loads(item["arguments"]) == json.loads(calls[index - 1]["arguments"])
        assert item["call_id"] == [e for e in added if e["id"] == item["id"]][0]["call_id"]


def test_function_call_output_goes_back_to_the_template(tokenizer, make_client) -> None:
    engine = FakeEngine(tokenizer, context_length=1024, reply=lambda prompt, params: "Sunny in Paris.")
    client = make_client(engine, tool_call_parser="hermes")
    body = {"model": MODEL_NAME, "tools": TOOLS, "max_output_tokens": 50, "input": [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]}
    whole = client.post("/v1/responses", json=body).json()
    assert whole["output"][0]["content"][0]["text"] == "Sunny in Paris."
    prompt = tokenizer.decode(engine.requests[0][1])
    # The test's ChatML template: the user turn, the assistant turn holding the call, the tool's
    # output; the reasoning item is left out.
    assert prompt.index("<|im_start|>user\nweather in Paris?") < prompt.index("<|im_start|>assistant\n") \
        < prompt.index("<|im_start|>tool\nsunny, 21 C<|im_end|>")


def test_forced_function_call(tokenizer, make_client) -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    engine = FakeEngine(tokenizer, context_length=1024, reply=lambda prompt, params: text)
    client = make_client(engine)
    body = {"model": MODEL_NAME, "input": "x", "tools": TOOLS, "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = client.post("/v1/responses", json=body).json()
    [call] = whole["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert engine.requests[0][2].structured.kind == "json"  # the grammar forcing the call
    assert whole["tool_choice"] == {"type": "function", "name": "get_weather"}
    response = client.post("/v1/responses", json={**body, "tool_choice": {"type": "function", "name": "nope"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_input_items_become_chat_messages() -> None:
    from servelm.server.responses import ResponsesRequest, _messages

    request = ResponsesRequest(instructions="sys", input=[
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}])
    assert _messages(request) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
