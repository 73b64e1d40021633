"""/generate (SGLang native), /tokenize, /detokenize and the informational endpoints."""

from __future__ import annotations

from server_fakes import EOS_ID, MODEL_NAME, FakeEngine, sse_events


def test_generate_text(client, engine: FakeEngine, tokenizer) -> None:
    response = client.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "stop": ["zz"], "sampling_seed": 5}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] == "Hi there #5"
    assert body["output_ids"] == tokenizer.encode("Hi there #5") + [EOS_ID]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(body["output_ids"])
    assert meta["cached_tokens"] == 0 and meta["id"] == engine.requests[-1][0]
    params = engine.requests[-1][2]
    assert params.temperature == 0 and params.stop == ["zz"] and params.max_tokens == 32
    assert client.post("/generate", json={"text": "Hello"}).json()["meta_info"]["completion_tokens"] == 9


def test_generate_input_ids_and_length(client, engine: FakeEngine) -> None:
    body = client.post("/generate", json={"input_ids": [1, 2, 3],
                                          "sampling_params": {"max_new_tokens": 2}}).json()
    assert body["text"] == "Hi" and body["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert engine.requests[-1][1] == [1, 2, 3]


def test_generate_batch(client, engine: FakeEngine, tokenizer) -> None:
    body = client.post("/generate", json={"text": ["a", "bb"], "sampling_params": [
        {"max_new_tokens": 2}, {"max_new_tokens": 3}]}).json()
    assert [item["text"] for item in body] == ["Hi", "Hi "]
    assert [item["meta_info"]["prompt_tokens"] for item in body] == [1, 2]
    body = client.post("/generate", json={"input_ids": [[1], [2, 3]],
                                          "sampling_params": {"max_new_tokens": 1}}).json()
    assert [item["output_ids"] for item in body] == [tokenizer.encode("H")] * 2
    body = client.post("/generate", json={"text": "a", "sampling_params": {"n": 2, "seed": 1}}).json()
    assert [item["text"] for item in body] == ["Hi there #1", "Hi there #2"]


def test_generate_stream(client) -> None:
    plain = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 4}}).json()
    events = sse_events(client.post("/generate", json={"text": "a", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 4}}))
    assert [e["text"] for e in events] == ["H", "Hi", "Hi ", "Hi t"]  # cumulative
    assert events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert events[0]["meta_info"]["finish_reason"] is None
    events = sse_events(client.post("/generate", json={"text": ["a", "b"], "stream": True,
                                                       "sampling_params": {"max_new_tokens": 2}}))
    final = {e["index"]: e["text"] for e in events}
    assert final == {0: "Hi", 1: "Hi"}


def test_generate_logprobs(client, tokenizer) -> None:
    body = client.post("/generate", json={
        "text": "ab", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2}}).json()
    meta = body["meta_info"]
    h, i, big_i, a, b = (tokenizer.encode(c)[0] for c in "HiIab")
    assert meta["output_token_logprobs"] == [[-0.25, h, "H"], [-0.25, i, "i"]]
    assert meta["output_top_logprobs"][0] == [[-0.25, h, "H"], [-1.25, big_i, "I"]]
    assert meta["input_token_logprobs"] == [[None, a, "a"], [-2.0, b, "b"]]


def test_generate_errors(client) -> None:
    for body, param in [({}, "text"), ({"text": "a", "input_ids": [1]}, "text"),
                        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_tokens"),
                        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
                        ({"text": "a", "sampling_params": {"regex": "a(b"}}, "sampling_params.regex"),
                        ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
                        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
                        ({"text": ""}, "text"), ({"input_ids": []}, "text")]:
        response = client.post("/generate", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.json())


def test_tokenize_detokenize(client, tokenizer) -> None:
    body = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "héllo"}).json()
    assert body["tokens"] == tokenizer.encode("héllo") and body["count"] == 6
    assert body["max_model_len"] == 64
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "héllo"}
    assert client.post("/detokenize", json={"tokens": [5000]}).status_code == 400
    assert client.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert client.post("/tokenize", json={}).status_code == 400


def test_info_endpoints(client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL_NAME, "model", 64)]
    info = client.get("/get_model_info").json()
    assert info["model_path"] == "/models/tiny" and info["is_generation"] is True
    assert info["context_length"] == 64
    server = client.get("/get_server_info").json()
    assert server["num_free_blocks"] == 8 and server["port"] == 30000 and server["version"]


def test_unhealthy_engine(engine: FakeEngine, make_client) -> None:
    engine.healthy = False
    client = make_client(engine)
    response = client.get("/health_generate")
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
    engine.is_alive = False  # type: ignore[attr-defined]
    assert client.get("/health").status_code == 503


def test_server_info_masks_api_key(engine: FakeEngine, make_client) -> None:
    client = make_client(engine, api_key="sekret")
    info = client.get("/get_server_info", headers={"Authorization": "Bearer sekret"}).json()
    assert info["api_key"] == "***"
