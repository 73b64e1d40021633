"""Server-wide response options: --response-role, --return-tokens-as-token-ids, --max-logprobs,
--stream-output, --preferred-sampling-params, --disable-fastapi-docs and LightLLM's
--return_all_prompt_logprobs (through build_app on the fake engine)."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import FakeEngine, make_config, sse_events

from servelm import cli_args
from servelm.server.app import build_app

MESSAGES = [{"role": "user", "content": "hi"}]


def client_for(engine: FakeEngine, **server: Any) -> Any:
    from fastapi.testclient import TestClient

    return TestClient(build_app(engine, make_config(**server)), raise_server_exceptions=False)


def test_response_role(engine: FakeEngine) -> None:
    client = client_for(engine, response_role="bot")
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert body["choices"][0]["message"]["role"] == "bot"
    stream = client.post("/v1/chat/completions",
                         json={"messages": MESSAGES, "max_tokens": 2, "stream": True})
    assert sse_events(stream)[0]["choices"][0]["delta"]["role"] == "bot"
    # Without the generation prompt the reply continues the last message, in its role.
    continued = client.post("/v1/chat/completions", json={
        "messages": MESSAGES + [{"role": "assistant", "content": "Hel"}], "max_tokens": 2,
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert continued["choices"][0]["message"]["role"] == "assistant"
    default = client_for(engine).post("/v1/chat/completions",
                                      json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert default["choices"][0]["message"]["role"] == "assistant"


def test_return_tokens_as_token_ids(engine: FakeEngine, tokenizer: Any) -> None:
    client = client_for(engine, return_tokens_as_token_ids=True)
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    expected = tokenizer.encode("Hi there", add_special_tokens=False)[:3]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in expected]
    assert all(all(key.startswith("token_id:") for key in top) for top in logprobs["top_logprobs"])
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                     "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [f"token_id:{t}" for t in expected[:2]]
    plain = client_for(engine).post("/v1/completions",
                                    json={"prompt": "x", "max_tokens": 1, "logprobs": 0}).json()
    assert plain["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode(expected[:1])]


def test_max_logprobs(engine: FakeEngine) -> None:
    client = client_for(engine, max_logprobs=2)
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 2})
    assert ok.status_code == 200
    for body in ({"prompt": "x", "max_tokens": 1, "logprobs": 3},
                 {"prompt": "x", "max_tokens": 1, "logprobs": 3, "stream": True},
                 {"prompt": "x", "max_tokens": 1, "echo": True, "logprobs": 3}):
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400, body
        assert "--max-logprobs" in refused.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True,
                                                     "top_logprobs": 3})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "logprobs"
    with pytest.raises(cli_args.CliError, match="--max-logprobs must be in"):
        cli_args.build_config(["--max-logprobs", "21"])


def test_stream_output_sends_disjoint_segments(engine: FakeEngine) -> None:
    request = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 5},
               "return_logprob": True}
    cumulative = sse_events(client_for(engine).post("/generate", json=request))
    segments = sse_events(client_for(engine, stream_output=True).post("/generate", json=request))
    assert len(segments) == len(cumulative) == 5
    assert "".join(s["text"] for s in segments) == cumulative[-1]["text"] == "Hi th"
    assert [i for s in segments for i in s["output_ids"]] == cumulative[-1]["output_ids"]
    assert all(len(s["output_ids"]) == 1 for s in segments)
    assert [len(c["output_ids"]) for c in cumulative] == [1, 2, 3, 4, 5]
    assert [e for s in segments for e in s["meta_info"]["output_token_logprobs"]] == \
        cumulative[-1]["meta_info"]["output_token_logprobs"]
    assert segments[-1]["meta_info"]["completion_tokens"] == 5  # totals stay totals


def test_preferred_sampling_params_in_model_info(engine: FakeEngine) -> None:
    info = client_for(engine, preferred_sampling_params='{"temperature": 0.6, "top_p": 0.9}')
    assert info.get("/get_model_info").json()["preferred_sampling_params"] == \
        {"temperature": 0.6, "top_p": 0.9}
    assert client_for(engine).get("/get_model_info").json()["preferred_sampling_params"] is None
    with pytest.raises(cli_args.CliError, match="--preferred-sampling-params"):
        cli_args.build_config(["--preferred-sampling-params", "[1]"])


def test_disable_fastapi_docs(engine: FakeEngine) -> None:
    default = client_for(engine)
    assert default.get("/openapi.json").status_code == 200 and default.get("/docs").status_code == 200
    off = client_for(engine, disable_fastapi_docs=True)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert off.get(path).status_code == 404, path
    assert off.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_return_all_prompt_logprobs(engine: FakeEngine) -> None:
    client = client_for(engine, use_tgi_api=True, return_all_prompt_logprobs=True)
    body = client.post("/generate", json={"inputs": "xyz", "parameters": {"max_new_tokens": 2}}).json()
    (_, prompt_ids, params), = engine.requests
    assert params.prompt_logprobs == 0
    assert body["prompt_token_ids"] == prompt_ids
    assert body["prompt_logprobs"] == [None] + [-2.0] * (len(prompt_ids) - 1)
    plain = client_for(FakeEngine(engine.tokenizer), use_tgi_api=True)
    assert "prompt_logprobs" not in plain.post("/generate", json={"inputs": "xyz"}).json()
    with pytest.raises(cli_args.CliError, match="no effect without --use-tgi-api"):
        cli_args.build_config(["--return_all_prompt_logprobs"])
