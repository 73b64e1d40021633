"""A live server on a real model (SmolLM2-135M) driven by the openai client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from .conftest import KEYED_API_KEY as API_KEY
from .conftest import KEYED_MODEL as MODEL
from .server_process import ServerProcess


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_and_info(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = httpx.get(f"{server.base_url}/get_model_info", headers=auth()).json()
    assert info["model_path"] == MODEL
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/health_generate").status_code == 200


def test_completion_greedy_and_usage(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("length", "stop")
    assert response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_uses_the_models_template(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content
    # The ChatML template wraps the message: far more prompt tokens than the two words.
    assert response.usage.prompt_tokens > 8


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, max_tokens=24, temperature=0)
    text = client.completions.create(prompt="def fibonacci(n):", **kwargs).choices[0].text
    stream = client.completions.create(prompt="def fibonacci(n):", stream=True,
                                       stream_options={"include_usage": True}, **kwargs)
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        pieces.extend(c.text for c in chunk.choices)
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens > 0

    messages = [{"role": "user", "content": "Count from one to five."}]
    chat = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    chat_stream = client.chat.completions.create(messages=messages, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == chat


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95)
    first = client.completions.create(n=2, seed=7, **kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    second = client.completions.create(n=2, seed=7, **kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    other = client.completions.create(n=1, seed=8, **kwargs)
    assert other.choices[0].text != first.choices[0].text or other.choices[0].text != first.choices[1].text


def test_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                         logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy picks the top token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in content)


def test_echo_with_prompt_logprobs(client):
    prompt = "The quick brown fox"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                         echo=True, logprobs=1)
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    num_tokens = response.usage.prompt_tokens + response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert "," in text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16,
                                        temperature=0, stop=[","])
    assert stopped.choices[0].text == text[:text.index(",")]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status", [
    ({"max_tokens": -1}, 400),
    ({"temperature": -0.5}, 400),
    ({"top_p": 1.5}, 400),
    ({"max_tokens": "many"}, 400),
    ({"prompt": "word " * 5000}, 400),
    ({"model": "no-such-model"}, 404),
])
def test_bad_requests(server, body, status):
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, headers=auth(), timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]


def test_api_key_required(server):
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/v1/completions", json=payload).status_code == 401
    bad = httpx.post(f"{server.base_url}/v1/completions", json=payload,
                     headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["message"]


def server_info(server) -> dict:
    return httpx.get(f"{server.base_url}/get_server_info", headers=auth()).json()


def test_client_disconnect_frees_kv(server):
    payload = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
               "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, headers=auth(),
                      timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                chunks += 1
                if chunks == 3:
                    break
    assert server_info(server)["num_running"] + server_info(server)["num_waiting"] <= 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = server_info(server)
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["num_used_blocks"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"KV not freed after disconnect: {info}")


def test_native_generate_and_tokenize(server):
    generated = httpx.post(f"{server.base_url}/generate", headers=auth(), timeout=60, json={
        "text": "The sky is", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert generated["meta_info"]["completion_tokens"] <= 5 and generated["text"]
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=auth(),
                        json={"model": MODEL, "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", headers=auth(),
                      json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "hello world"


GEMMA_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.slow  # two Gemma 3 starts; the default run's check of the same path: tests/unit/server/
# test_server_completions.py (test_chat_without_template_is_400, test_chat_template_override_inline_and_file)
def test_template_less_base_model_needs_chat_template(tmp_path):
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    with ServerProcess(["gemma3-270m", "--max-total-tokens", "4096", "--context-length", "1024"]) as bare:
        response = httpx.post(f"{bare.base_url}/v1/chat/completions", json={
            "model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert response.status_code == 400
        assert "chat template" in response.json()["error"]["message"].lower()
    with ServerProcess(["gemma3-270m", "--chat-template", str(template), "--max-total-tokens", "4096",
                        "--context-length", "1024"]) as templated:
        chat = openai.OpenAI(base_url=f"{templated.base_url}/v1", api_key="none", max_retries=0)
        response = chat.chat.completions.create(
            model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        assert response.choices[0].finish_reason in ("length", "stop")
        assert response.usage.prompt_tokens >= 6
