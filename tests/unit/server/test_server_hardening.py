"""Hostile or careless input on the server routes (issue 19): each answered with the right status.

- A lone UTF-16 surrogate anywhere in a body (prompt, chat message, /tokenize, /generate, nested
  lists, dict keys) is a 400 naming where it is, never a 500 from the tokenizer.
- A streamed request the engine refuses up front (queue full) gets 503 with Retry-After before
  any stream starts, like the non-streamed one; other refusals keep their status too.
- Duplicate request ids inside one /generate batch are a 400.
- A 413 closes the connection (the unread body would otherwise be parsed as the next request).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_fakes import MODEL_NAME, FakeEngine

SURROGATE = "\ud800"

SURROGATE_CASES = [
    ("/v1/completions", {"prompt": f"hello {SURROGATE}", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", f"x{SURROGATE}y"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"{SURROGATE}"], "max_tokens": 2}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"a{SURROGATE}"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": f"\udfff{SURROGATE}"}]}]}, "messages[0].content[0].text"),
    ("/tokenize", {"prompt": f"{SURROGATE}"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": f"{SURROGATE}"}]}, "messages[0].content"),
    ("/generate", {"text": f"x{SURROGATE}", "sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": ["ok", SURROGATE]}, "text[1]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, SURROGATE: 1}, SURROGATE),
]


@pytest.mark.parametrize(("path", "body", "where"), SURROGATE_CASES)
def test_lone_surrogate_is_a_400(client: Any, path: str, body: dict[str, Any], where: str) -> None:
    # json.dumps escapes the surrogate as \ud800, exactly what a client sends on the wire.
    raw = json.dumps({"model": MODEL_NAME, **body}).encode()
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "surrogate" in error["message"]
    assert error["message"].startswith(where.encode("utf-8", "backslashreplace").decode())


def test_valid_astral_text_passes(client: Any) -> None:
    # A proper surrogate pair on the wire is one astral character: valid text.
    raw = json.dumps({"model": MODEL_NAME, "prompt": "smile \U0001F600", "max_tokens": 2}).encode()
    response = client.post("/v1/completions", content=raw,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_streamed_refusal_is_503_before_the_stream(engine: FakeEngine, make_client: Any,
                                                    path: str) -> None:
    engine.error, engine.error_status = "the server is busy: 4 requests are waiting", 503
    client = make_client(engine)
    body: dict[str, Any] = {"stream": True}
    if path == "/v1/completions":
        body.update(prompt="hi", max_tokens=2)
    elif path == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    else:
        body.update(text="hi", sampling_params={"max_new_tokens": 2})
    response = client.post(path, json=body)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert "busy" in response.json()["error"]["message"]
    assert not response.headers["content-type"].startswith("text/event-stream")
    non_streamed = client.post(path, json={**body, "stream": False})
    assert non_streamed.status_code == 503 and non_streamed.headers["retry-after"] == "1"


def test_streamed_invalid_refusal_keeps_400(engine: FakeEngine, make_client: Any) -> None:
    engine.error, engine.error_status = "duplicate request id x", 400
    response = make_client(engine).post("/v1/completions",
                                        json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert response.status_code == 400 and "retry-after" not in response.headers


def test_streams_that_start_still_stream(client: Any) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n")
    assert response.text.count('"text":') == 3


def test_duplicate_rids_in_a_batch_are_a_400(engine: FakeEngine, client: Any) -> None:
    response = client.post("/generate", json={"text": ["a", "b"], "rid": ["same", "same"],
                                              "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "rid"
    assert engine.requests == []  # refused before anything reached the engine


def test_413_closes_the_connection(engine: FakeEngine, make_client: Any) -> None:
    client = make_client(engine, max_request_body_bytes=1000)
    response = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413
    assert response.headers["connection"] == "close"


# -- request-supplied chat templates -------------------------------------------------------------

NESTED_LOOP = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
               "{{ messages[0]['content'] }}")
MEMORY_BOMB = "{{ 'x' * 4000000000 }}"
ECHO_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ eos_token }}]{% endfor %}"


def _chat(client: Any, template: str | None, path: str = "/v1/chat/completions") -> Any:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if template is not None:
        body["chat_template"] = template
    return client.post(path, json=body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_request_chat_template_is_refused_by_default(engine: FakeEngine, client: Any, path: str) -> None:
    response = _chat(client, ECHO_TEMPLATE, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    assert engine.requests == []
    assert _chat(client, None, path).status_code == 200  # the server's own template still works


def test_trusted_request_templates_render_in_a_budgeted_sandbox(engine: FakeEngine,
                                                                make_client: Any) -> None:
    import threading
    import time

    with make_client(engine, trust_request_chat_template=True) as client:
        response = _chat(client, ECHO_TEMPLATE, "/tokenize")
        assert response.status_code == 200, response.text
        text = engine.tokenizer.decode(response.json()["tokens"])
        assert text == "[user|hi|<|im_end|>]"  # rendered by the worker, special tokens included

        results: dict[str, Any] = {}

        def hostile() -> None:
            started = time.monotonic()
            results["hostile"] = _chat(client, NESTED_LOOP)
            results["hostile_s"] = time.monotonic() - started

        thread = threading.Thread(target=hostile)
        thread.start()
        time.sleep(0.3)
        started = time.monotonic()
        normal = _chat(client, None)  # the event loop is free while the template spins
        normal_s = time.monotonic() - started
        thread.join(60)
        assert normal.status_code == 200 and normal_s < 1.5, normal_s
        assert results["hostile"].status_code == 400
        assert "longer than" in results["hostile"].json()["error"]["message"]
        assert results["hostile_s"] < 10
        bomb = _chat(client, MEMORY_BOMB)
        assert bomb.status_code == 400 and "memory" in bomb.json()["error"]["message"], bomb.text
        # a new worker serves the next template after the killed one
        assert _chat(client, ECHO_TEMPLATE).status_code == 200


def test_repeated_log_lines_are_rate_limited() -> None:
    import logging

    from servelm.logging_utils import RepeatFilter

    repeat = RepeatFilter(burst=3, window_s=0.2)

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, None, None)

    kept = [repeat.filter(record("Invalid HTTP request received.")) for _ in range(1000)]
    assert sum(kept) == 3  # a flood of one line writes three
    assert repeat.filter(record("another line"))  # other lines are not affected
    import time

    time.sleep(0.25)
    after = record("Invalid HTTP request received.")
    assert repeat.filter(after) and "997 similar lines dropped" in str(after.msg)
