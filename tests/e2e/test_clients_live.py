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
def server():
    with ServerProcess([MODEL, "--num-threads", "1", "--use_tgi_api", "--context-length", "2048",
                        "--max-total-tokens", "8192"]) as running:
        yield running


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
