"""/v1/completions and /v1/chat/completions against the scripted fake engine."""

from __future__ import annotations

from typing import Any

from server_fakes import EOS_ID, MODEL_NAME, FakeEngine, sse_events


def _complete(client: Any, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": MODEL_NAME, **body})


def _chat(client: Any, **body: Any) -> Any:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return client.post("/v1/chat/completions", json={"model": MODEL_NAME, **body})


def test_completion_shape_and_usage(client, engine: FakeEngine, tokenizer) -> None:
    response = _complete(client, prompt="Say hi", max_tokens=20)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": "Hi there", "logprobs": None, "finish_reason": "stop",
                      "stop_reason": EOS_ID}
    prompt_len = len(tokenizer.encode("Say hi"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len("Hi there") + 1,
                             "total_tokens": prompt_len + len("Hi there") + 1,
                             "prompt_tokens_details": None}
    [(_, prompt_ids, params)] = engine.requests
    assert prompt_ids == tokenizer.encode("Say hi") and params.max_tokens == 20


def test_completion_length_and_default_max_tokens(client, engine: FakeEngine) -> None:
    body = _complete(client, prompt="x", max_tokens=3).json()
    assert body["choices"][0]["text"] == "Hi " and body["choices"][0]["finish_reason"] == "length"
    _complete(client, prompt="x")
    assert engine.requests[-1][2].max_tokens == 16
    _complete(client, prompt="x", max_tokens=None)
    assert engine.requests[-1][2].max_tokens == 64 - 1  # up to the context limit


def test_sampling_parameters_reach_engine(client, engine: FakeEngine) -> None:
    response = _complete(client, prompt="x", temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                         stop=["\n", "END"], stop_token_ids=[7], seed=3, frequency_penalty=0.5,
                         presence_penalty=-0.5, repetition_penalty=1.1, logit_bias={"5": -100},
                         ignore_eos=True, min_tokens=2, skip_special_tokens=False, user="u1",
                         some_vendor_extension=True)
    assert response.status_code == 200, response.text
    params = engine.requests[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert params.stop == ["\n", "END"] and params.stop_token_ids == [7] and params.seed == 3
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert params.logit_bias == {5: -100.0} and params.ignore_eos and params.min_tokens == 2
    assert params.skip_special_tokens is False
    _complete(client, prompt="x", stop="END")
    assert engine.requests[-1][2].stop == ["END"]


def test_token_prompts_and_batches(client, engine: FakeEngine) -> None:
    body = _complete(client, prompt=[72, 105], max_tokens=4).json()
    assert engine.requests[-1][1] == [72, 105] and body["usage"]["prompt_tokens"] == 2
    body = _complete(client, prompt=[[72, 105], [1, 2, 3]], max_tokens=4).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5
    body = _complete(client, prompt=["a", "bb"], max_tokens=4, n=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [r[1] for r in engine.requests[-4:]] == [[64], [64], [65, 65], [65, 65]]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 16


def test_n_choices_get_distinct_ids_and_seeds(client, engine: FakeEngine) -> None:
    body = _complete(client, prompt="x", n=2, seed=10, max_tokens=30).json()
    assert [c["text"] for c in body["choices"]] == ["Hi there #10", "Hi there #11"]
    ids = [r[0] for r in engine.requests]
    assert len(set(ids)) == 2 and [r[2].seed for r in engine.requests] == [10, 11]
    assert body["usage"]["completion_tokens"] == 2 * (len("Hi there #10") + 1)


def _stream_text(events: list[dict], key: str = "text") -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice[key] if key == "text" else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def test_completion_stream_equals_non_stream(client) -> None:
    plain = _complete(client, prompt="x", n=2, seed=1, max_tokens=30).json()
    response = _complete(client, prompt="x", n=2, seed=1, max_tokens=30, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert _stream_text(events) == {c["index"]: c["text"] for c in plain["choices"]}
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finishes == {0: "stop", 1: "stop"}
    assert len({e["id"] for e in events}) == 1


def test_stream_include_usage(client) -> None:
    response = _complete(client, prompt="x", max_tokens=5, stream=True,
                         stream_options={"include_usage": True})
    events = sse_events(response)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["prompt_tokens"] + 5


def test_echo_and_completion_logprobs(client, tokenizer) -> None:
    body = _complete(client, prompt="ab", max_tokens=2, echo=True).json()
    assert body["choices"][0]["text"] == "abHi"
    body = _complete(client, prompt="ab", max_tokens=2, echo=True, logprobs=2).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "H", "i"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.25, -0.25]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][2] == {"H": -0.25, "I": -1.25}
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    streamed = sse_events(_complete(client, prompt="ab", max_tokens=2, echo=True, logprobs=2, stream=True))
    assert _stream_text(streamed) == {0: "abHi"}
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in streamed:
        for key in merged:
            merged[key] += event["choices"][0]["logprobs"][key]
    assert merged == logprobs


def test_completion_logprobs_without_echo(client) -> None:
    body = _complete(client, prompt="ab", max_tokens=3, logprobs=0).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["H", "i", " "] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["top_logprobs"] == [{"H": -0.25}, {"i": -0.25}, {" ": -0.25}]


def test_cached_tokens_reported(engine: FakeEngine, make_client) -> None:
    engine.num_cached_tokens = 16
    body = _complete(make_client(engine, enable_cache_report=True), prompt="x", max_tokens=2,
                     n=2).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    # Without --enable-cache-report (SGLang) / --enable-prompt-tokens-details (vLLM): not shown.
    body = _complete(make_client(engine), prompt="x", max_tokens=2).json()
    assert body["usage"].get("prompt_tokens_details") is None


def test_chat_shape(client, engine: FakeEngine, tokenizer) -> None:
    response = _chat(client, messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     max_completion_tokens=20)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi there", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.requests[-1][1] == tokenizer.encode(expected, add_special_tokens=False)
    assert engine.requests[-1][2].max_tokens == 20
    assert body["usage"]["prompt_tokens"] == len(engine.requests[-1][1])


def test_chat_stream_equals_non_stream(client) -> None:
    plain = _chat(client, n=2, seed=4).json()
    events = sse_events(_chat(client, n=2, seed=4, stream=True, stream_options={"include_usage": True}))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    first = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            first.setdefault(choice["index"], choice["delta"])
    assert first == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert _stream_text(events[:-1], "delta") == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]


def test_chat_logprobs_shape(client) -> None:
    body = _chat(client, logprobs=True, top_logprobs=2, max_tokens=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "H", "logprob": -0.25, "bytes": [72],
                          "top_logprobs": [{"token": "H", "logprob": -0.25, "bytes": [72]},
                                           {"token": "I", "logprob": -1.25, "bytes": [73]}]}
    assert len(content) == 2
    events = sse_events(_chat(client, logprobs=True, top_logprobs=2, max_tokens=2, stream=True))
    streamed = [item for e in events for c in e["choices"] if c["logprobs"] for item in c["logprobs"]["content"]]
    assert streamed == content


def test_chat_template_kwargs_and_continue_final_message(client, engine: FakeEngine, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    response = _chat(client, messages=messages, continue_final_message=True)
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(engine.requests[-1][1])
    assert prompt.endswith("<|im_start|>assistant\nSure")


def test_chat_template_override_inline_and_file(engine: FakeEngine, make_client, tmp_path) -> None:
    inline = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>>"
    _chat(make_client(engine, chat_template=inline))
    assert engine.tokenizer.decode(engine.requests[-1][1]) == "[user]hi>>"
    path = tmp_path / "template.jinja"
    path.write_text("FILE:{{ messages[0]['content'] }}")
    _chat(make_client(engine, chat_template=str(path)))
    assert engine.tokenizer.decode(engine.requests[-1][1]) == "FILE:hi"


def test_chat_without_template_is_400(plain_tokenizer, make_client) -> None:
    client = make_client(FakeEngine(plain_tokenizer))
    response = _chat(client)
    assert response.status_code == 400
    assert "--chat-template" in response.json()["error"]["message"]
    assert _chat(make_client(FakeEngine(plain_tokenizer), chat_template="{{ messages[0]['content'] }}")
                 ).status_code == 200


def test_default_max_tokens_is_capped_by_context(client, engine: FakeEngine) -> None:
    assert _complete(client, prompt="x" * 60).status_code == 200
    assert engine.requests[-1][2].max_tokens == 4
    assert _complete(client, prompt="x" * 60, max_tokens=16).status_code == 400


def test_chat_template_kwargs_reach_template(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, chat_template="{{ greeting | default('none') }}:{{ messages[-1]['content'] }}")
    response = _chat(client, chat_template_kwargs={"greeting": "hello"},
                     messages=[{"role": "user", "content": "q"},
                               {"role": "tool", "content": "42", "tool_call_id": "call-1"}])
    assert response.status_code == 200, response.text
    assert engine.tokenizer.decode(engine.requests[-1][1]) == "hello:42"
