"""Error responses: status codes and the OpenAI error JSON shape."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import MODEL_NAME, FakeEngine, sse_events


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"suffix": "tail"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_completion_parameters_are_400(client, engine: FakeEngine, fields, param) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", **fields}
    error = _error(client.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert engine.requests == []


def test_missing_field_and_bad_json_are_400(client) -> None:
    error = _error(client.post("/v1/completions", json={"model": MODEL_NAME}), 400)
    assert error["param"] == "prompt" and "required" in error["message"].lower()
    _error(client.post("/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: no flag
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format.json_schema.schema"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # a text-only model (test_server_images.py has the others)
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
def test_invalid_chat_parameters_are_400(client, fields, param) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param, error


def test_chat_template_error_is_400(engine, make_client) -> None:
    client = make_client(engine, chat_template="{{ raise_exception('no system role') }}")
    error = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert "no system role" in error["message"]


def test_unknown_model_is_404(client) -> None:
    error = _error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    _error(client.post("/v1/chat/completions",
                       json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404)
    for name in (MODEL_NAME, "/models/tiny"):
        assert client.post("/v1/completions", json={"model": name, "prompt": "x"}).status_code == 200


def test_unknown_route_is_openai_404(client) -> None:
    _error(client.get("/v1/nothing"), 404)


def test_prompt_longer_than_context(client, engine: FakeEngine) -> None:
    long_prompt = "x" * 64
    error = _error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded"
    error = _error(client.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 10}), 400)
    assert error["code"] == "context_length_exceeded"
    error = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 64}), 400)
    assert error["param"] == "max_tokens"
    assert client.post("/v1/completions", json={"prompt": "x" * 54, "max_tokens": 10}).status_code == 200
    assert engine.requests[-1][2].max_tokens == 10


def test_auto_truncate_keeps_the_end(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, allow_auto_truncate=True)
    prompt = "a" * 50 + "b" * 20
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "echo": True})
    assert response.status_code == 200, response.text
    sent = engine.requests[-1][1]
    assert len(sent) == 54 and engine.tokenizer.decode(sent) == "a" * 34 + "b" * 20
    assert response.json()["choices"][0]["text"].startswith("a" * 34 + "b" * 20)
    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": None})
    assert len(engine.requests[-1][1]) == 63 and engine.requests[-1][2].max_tokens == 1


def test_center_truncation_keeps_both_ends(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, long_truncation_mode="center")
    prompt = "a" * 30 + "m" * 20 + "z" * 30  # 80 tokens; 54 fit with max_tokens 10
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10})
    assert response.status_code == 200, response.text
    assert engine.tokenizer.decode(engine.requests[-1][1]) == "a" * 27 + "z" * 27


def test_engine_error_is_500(engine: FakeEngine, make_client) -> None:
    engine.error = "kv pool exploded"
    client = make_client(engine)
    error = _error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert "kv pool exploded" in error["message"] and error["type"] == "server_error"
    # An engine failure before the first token: the stream has not started, so it gets the status.
    error = _error(client.post("/v1/completions", json={"prompt": "x", "stream": True}), 500)
    assert "kv pool exploded" in error["message"]


def test_engine_exception_is_500(engine: FakeEngine, make_client) -> None:
    async def broken(*args: Any) -> Any:
        raise RuntimeError("engine process exited")
        yield  # pragma: no cover

    engine.generate = broken  # type: ignore[method-assign]
    error = _error(make_client(engine).post("/v1/completions", json={"prompt": "x"}), 500)
    assert "engine process exited" in error["message"]


def test_api_key(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, api_key="sekret")
    body = {"prompt": "x", "max_tokens": 2}
    error = _error(client.post("/v1/completions", json=body), 401)
    assert error["code"] == "invalid_api_key"
    _error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(client.get("/v1/models"), 401)
    _error(client.post("/generate", json={"text": "x"}), 401)
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_skip_tokenizer_init_mode(make_client) -> None:
    engine = FakeEngine(None)
    client = make_client(engine, model={"skip_tokenizer_init": True})
    error = _error(client.post("/v1/completions", json={"prompt": "text"}), 400)
    assert "token ids" in error["message"]
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    _error(client.post("/v1/completions", json={"prompt": [1, 2], "stop": "x"}), 400)
    _error(client.post("/generate", json={"text": "x"}), 400)
    body = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "logprobs": 1}).json()
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:72", "token_id:105", "token_id:32"]
    native = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).json()
    assert native["text"] == "" and native["output_ids"] == [72, 105]
