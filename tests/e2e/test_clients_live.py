"""Clients people already use, unchanged, against a live server on SmolLM2-135M: the OpenAI
Responses API (the openai client), the TGI API (--use_tgi_api), lm-eval's loglikelihood calls,
Open WebUI's and llama.cpp's UI calls."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .server_process import ServerProcess

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(clients_server):
    """The session's clients server (SmolLM2-135M, float32, one thread, the TGI routes; shared with
    test_structured_live): float32 because the tests compare two requests token for token."""
    return clients_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


# -- OpenAI Responses API ----------------------------------------------------------------------

def test_responses_text_equals_chat(client) -> None:
    response = client.responses.create(model=MODEL, input="What is the capital of France?",
                                       instructions="Answer briefly.", max_output_tokens=12,
                                       temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")


def test_responses_stream_adds_up(client) -> None:
    kwargs = {"model": MODEL, "max_output_tokens": 16, "temperature": 0,
              "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text and deltas
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == deltas
    assert events[-1].response.output_text == whole.output_text


def test_responses_json_schema(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Name a city in France as JSON.", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    value = json.loads(response.output_text)
    assert list(value) == ["city"] and isinstance(value["city"], str)


def test_responses_refuses_what_it_does_not_do(client) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", temperature=-1)


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}


def test_responses_function_call_round_trip(client) -> None:
    """tool_choice required (a grammar forces the call): a function_call item, streamed events
    that add up to it, then the call and its output sent back as input items."""
    kwargs = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER_TOOL],
              "tool_choice": "required", "max_output_tokens": 64, "temperature": 0}
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls), response.output
    arguments = json.loads(calls[0].arguments)
    assert list(arguments) == ["city"] and isinstance(arguments["city"], str)
    assert response.tools[0].name == "get_weather" and response.tool_choice == "required"

    with client.responses.stream(**kwargs) as stream:  # the client's own event accumulator
        events = list(stream)
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    kinds = [event.type for event in events]
    assert kinds.count("response.function_call_arguments.done") == len(calls)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == streamed.output.index(
                         next(i for i in streamed.output if i.type == "function_call")))
    assert deltas == calls[0].arguments

    follow_up = client.responses.create(
        model=MODEL, tools=[WEATHER_TOOL], max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               *[call.model_dump(exclude_none=True) for call in calls],
               *[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
                 for call in calls]],
        tool_choice="none")
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text


def test_responses_named_function(client) -> None:
    response = client.responses.create(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], max_output_tokens=64,
        temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)


# -- TGI API (--use_tgi_api) -------------------------------------------------------------------

def _tgi_stream(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def test_tgi_generate_shapes_and_greedy_equals_completions(server, client) -> None:
    prompt = "The capital of France is"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True,
                                             "decoder_input_details": True, "top_n_tokens": 2}}
    reply = httpx.post(f"{server.base_url}/generate", json=body, timeout=120).json()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply["generated_text"] == completion.choices[0].text
    details = reply["details"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["tokens"]) == completion.usage.completion_tokens
    assert [token["logprob"] is None for token in details["prefill"]][:2] == [True, False]
    assert len(details["prefill"]) == completion.usage.prompt_tokens
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert all(len(top) == 2 for top in details["top_tokens"])
    # The compat route: a one-element list (what the text-generation client reads).
    listed = httpx.post(f"{server.base_url}/", json=body, timeout=120).json()
    assert isinstance(listed, list) and listed[0]["generated_text"] == reply["generated_text"]


def test_tgi_stream_adds_up(server) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 10, "stop": ["\n\n"]}}
    whole = httpx.post(f"{server.base_url}/generate", json=body, timeout=120).json()
    for url, extra in ((f"{server.base_url}/generate_stream", {}), (f"{server.base_url}/", {"stream": True})):
        events = _tgi_stream(url, {**body, **extra})
        assert [event["index"] for event in events] == list(range(1, len(events) + 1))
        assert all(event["generated_text"] is None for event in events[:-1])
        assert events[-1]["generated_text"] == whole["generated_text"]
        assert "".join(event["token"]["text"] for event in events) == whole["generated_text"]
        assert events[-1]["details"]["generated_tokens"] == len(events)


def test_tgi_info_and_errors(server) -> None:
    info = httpx.get(f"{server.base_url}/info").json()
    assert info["model_id"] == MODEL and info["max_total_tokens"] == 2048
    assert info["model_pipeline_tag"] == "text-generation"
    bad = httpx.post(f"{server.base_url}/generate", json={"inputs": "x", "parameters": {"watermark": True}})
    assert bad.status_code == 400 and "watermark" in bad.text
    typo = httpx.post(f"{server.base_url}/generate", json={"inputs": "x", "parameters": {"max_tokens": 3}})
    assert typo.status_code == 400


def test_text_generation_client(server) -> None:
    """The PyPI `text-generation` client, when importable (it pins huggingface-hub<1, which
    transformers 5 cannot use, so it is not in our extras: install it --no-deps to run this)."""
    text_generation = pytest.importorskip("text_generation")
    tgi_client = text_generation.Client(server.base_url, timeout=120)
    response = tgi_client.generate("The capital of France is", max_new_tokens=8,
                                   decoder_input_details=True)
    assert response.details.generated_tokens == len(response.details.tokens) > 0
    streamed = "".join(item.token.text for item in
                       tgi_client.generate_stream("The capital of France is", max_new_tokens=8))
    assert streamed == response.generated_text


# -- lm-eval: remote tokenizer and loglikelihood requests ----------------------------------------

def test_tokenizer_info_matches_the_tokenizer(server) -> None:
    from tests.reference import packaged_reference_tokenizer

    tokenizer = packaged_reference_tokenizer(MODEL)
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["eos_token_id"] == tokenizer.eos_token_id
    assert info["bos_token"] == tokenizer.bos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 2048
    # lm-eval's RemoteTokenizer: /tokenize without special tokens, /detokenize back.
    text = "Hello world, the quick brown fox."
    tokens = httpx.post(f"{server.base_url}/tokenize",
                        json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"] == text


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A random-weight llama in HF format (transformers loads the very same weights), served
    without a tokenizer: lm-eval's loglikelihood requests send token ids."""
    from tests.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")
    with ServerProcess([str(path), "--num-threads", "1", "--skip-tokenizer-init", "--dtype", "float32",
                        "--max-total-tokens", "4096"]) as running:
        running.model_path = path
        yield running


def _reference_logprobs(path, token_ids: list[int]) -> list[float]:
    import torch

    from tests.reference import load_reference_model

    model = load_reference_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[position - 1, token].item() for position, token in enumerate(token_ids)][1:]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihood_request_equals_transformers(tiny_server, max_tokens) -> None:
    """lm-eval's loglikelihood payload (token ids, echo, logprobs 1, max_tokens 1; vLLM also
    takes 0) scores the prompt exactly as transformers does."""
    tokens = [5, 17, 99, 3, 42, 7, 7, 64, 12, 88, 31]
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=120, json={
        "model": str(tiny_server.model_path), "prompt": [tokens], "temperature": 0,
        "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True})
    assert response.status_code == 200, response.text
    body = response.json()
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None
    assert len(logprobs["token_logprobs"]) == len(tokens) + max_tokens
    assert body["usage"]["completion_tokens"] == max_tokens
    expected = _reference_logprobs(tiny_server.model_path, tokens)
    assert logprobs["token_logprobs"][1:len(tokens)] == pytest.approx(expected, abs=1e-4)
    # lm-eval's is_greedy: the chosen token's logprob compared with the best of top_logprobs.
    for value, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert max(top.values()) >= value - 1e-6


def test_max_tokens_zero_needs_echo(server) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


# -- Open WebUI and llama.cpp's web UI -----------------------------------------------------------

def test_open_webui_calls(server, client) -> None:
    # Its model list (with and without /v1), a streamed answer, then the title and follow-up
    # task calls: plain non-streamed chat requests carrying Open WebUI's extra fields.
    assert httpx.get(f"{server.base_url}/models").json() == httpx.get(f"{server.base_url}/v1/models").json()
    assert [model.id for model in client.models.list().data] == [MODEL]
    history = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model=MODEL, messages=history, stream=True, max_tokens=16,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert answer and chunks[-1].usage.completion_tokens > 0
    history.append({"role": "assistant", "content": answer})
    for task in ("title", "follow_ups"):
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "stream": False, "max_tokens": 24,
            "messages": [{"role": "user", "content": f"Generate a {task} for this chat as JSON:\n"
                          + json.dumps(history)}],
            "metadata": {"task": task, "chat_id": "local"}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]


def test_llama_cpp_ui_calls(server) -> None:
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["model_alias"] == MODEL and "im_start" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    # What does not apply answers a clean JSON 404, never a crash.
    for method, path in (("GET", "/slots"), ("POST", "/completion"), ("POST", "/apply-template")):
        response = httpx.request(method, f"{server.base_url}{path}", json={})
        assert response.status_code == 404 and response.json()["error"]["message"]


LM_EVAL_TASK = """task: servelm_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LM_EVAL_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven", "blue"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "loud"], "answer": 1},
]


@pytest.mark.slow
def test_lm_eval_local_completions(server, tmp_path, monkeypatch) -> None:
    """lm_eval --model local-completions on a local JSON task: it finds /tokenizer_info (no
    tokenizer download), and its loglikelihoods are the server's echo logprobs."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    (tmp_path / "servelm_tiny.yaml").write_text(LM_EVAL_TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.base_url}/v1/completions,model={MODEL},num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True",
        tasks=["servelm_tiny"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=1)
    assert results["results"]["servelm_tiny"]["acc,none"] == 1.0
    tokenize = lambda text: httpx.post(f"{server.base_url}/tokenize", json={  # noqa: E731
        "prompt": text, "add_special_tokens": False}).json()["tokens"]
    for sample in results["samples"]["servelm_tiny"]:
        doc = sample["doc"]
        for choice, [(loglikelihood, _)] in zip(doc["choices"], sample["resps"]):
            context, continuation = tokenize(doc["question"]), tokenize(" " + choice)
            body = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": [context + continuation], "max_tokens": 0, "echo": True,
                "logprobs": 1, "temperature": 0}).json()
            expected = sum(body["choices"][0]["logprobs"]["token_logprobs"][len(context):])
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
