"""Prefill and decode as separate `servelm serve` processes (smollm2-135m, float32, 1 thread each)
driven as SGLang's router drives them: the test sends the same request, with the same
bootstrap_host/port/room, to both servers at once and keeps the decode server's answer. Greedy
answers equal one co-located server's: completions, chat streaming and not, n>1, a stop string, a
JSON schema, logprobs, /generate, a 1,024-token prompt, 32 concurrent requests, and vLLM's
two-call flow (kv_transfer_params). Faults: a decode request whose prefill server never answers,
a client leaving during the transfer, the prefill server killed: an OpenAI error, never a hang, and
both pools back to idle."""

from __future__ import annotations

import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
COMMON = ["--model", MODEL, "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "16384"]
TIMEOUT_S = 20


@pytest.fixture(scope="module")
def servers():
    bootstrap_port = free_port()
    colocated = ServerProcess(COMMON)
    prefill = ServerProcess([*COMMON, "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(bootstrap_port),
                             "--disaggregation-transfer-timeout", str(TIMEOUT_S)])
    decode = ServerProcess([*COMMON, "--disaggregation-mode", "decode",
                            "--disaggregation-transfer-timeout", str(TIMEOUT_S)])
    with ThreadPoolExecutor(3) as pool:  # start all three at once
        started = list(pool.map(lambda server: server.__enter__(), [colocated, prefill, decode]))
    try:
        yield {"colocated": started[0], "prefill": started[1], "decode": started[2],
               "bootstrap_port": bootstrap_port}
    finally:
        for server in (colocated, prefill, decode):
            server.__exit__(None, None, None)


def both(servers: dict[str, Any], path: str, body: dict[str, Any],
         stream: bool = False) -> tuple[httpx.Response, Any]:
    """The router's part: the same request, one room, to the prefill and the decode server at
    once. Returns (prefill response, decode response or its streamed events)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": servers["bootstrap_port"],
              "bootstrap_room": random.randrange(2 ** 63)}
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(httpx.post, servers["prefill"].base_url + path,
                              json={**body, **fields}, timeout=300)
        if stream:
            decode = pool.submit(events, servers["decode"].base_url + path, {**body, **fields})
        else:
            decode = pool.submit(httpx.post, servers["decode"].base_url + path,
                                 json={**body, **fields}, timeout=300)
        return prefill.result(), decode.result()


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        return [json.loads(line[5:]) for line in response.iter_lines()
                if line.startswith("data:") and line != "data: [DONE]"]


def colocated(servers: dict[str, Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(servers["colocated"].base_url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def choices(body: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(c.get("text", c.get("message", {}).get("content")), c["finish_reason"])
            for c in body["choices"]]


def assert_idle(servers: dict[str, Any]) -> None:
    deadline = time.monotonic() + 15
    while True:
        infos = [httpx.get(servers[name].base_url + "/get_server_info", timeout=10).json()
                 for name in ("prefill", "decode")]
        busy = [(info["num_used_blocks"], info["num_running"], info["num_waiting"],
                 info.get("disaggregation_num_parked_blocks", 0),
                 info.get("disaggregation_num_waiting_pulls", 0)) for info in infos]
        if all(figures == (0, 0, 0, 0, 0) for figures in busy):
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.3)


def test_completions_stop_string_and_logprobs_match_colocated(servers):
    body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0,
            "stop": ["\n\n"], "logprobs": 2}
    prefill, decode = both(servers, "/v1/completions", body)
    assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
    assert prefill.json()["usage"]["completion_tokens"] == 1  # SGLang's prefill answer
    expected = colocated(servers, "/v1/completions", body)
    assert choices(decode.json()) == choices(expected)
    got = decode.json()["choices"][0]["logprobs"]
    want = expected["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert_idle(servers)


def test_chat_streaming_n2_and_json_schema_match_colocated(servers):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 24, "temperature": 0, "n": 2}
    expected = colocated(servers, "/v1/chat/completions", body)
    _, decode = both(servers, "/v1/chat/completions", body)
    assert choices(decode.json()) == choices(expected)
    _, streamed = both(servers, "/v1/chat/completions", body, stream=True)
    texts = ["", ""]
    for event in streamed:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == [c[0] for c in choices(expected)]
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    expected = colocated(servers, "/v1/chat/completions", body)
    _, decode = both(servers, "/v1/chat/completions", body)
    assert choices(decode.json()) == choices(expected)
    json.loads(decode.json()["choices"][0]["message"]["content"])
    assert_idle(servers)


def test_generate_long_prompt_and_32_concurrent_match_colocated(servers):
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    long_text = " ".join(rng.choice(words) for _ in range(1000))
    body = {"text": long_text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    tokens = httpx.post(servers["colocated"].base_url + "/tokenize",
                        json={"prompt": long_text}, timeout=60).json()["count"]
    assert tokens >= 1000
    expected = colocated(servers, "/generate", body)
    _, decode = both(servers, "/generate", body)
    assert decode.json()["text"] == expected["text"]
    bodies = [{"model": MODEL, "prompt": f"Item {i}: the colour of the sky is", "max_tokens": 6,
               "temperature": 0} for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        expected_all = list(pool.map(lambda b: colocated(servers, "/v1/completions", b), bodies))
        got_all = list(pool.map(lambda b: both(servers, "/v1/completions", b)[1], bodies))
    for want, got in zip(expected_all, got_all):
        assert got.status_code == 200, got.text
        assert choices(got.json()) == choices(want)
    assert_idle(servers)


def test_vllm_two_call_flow_matches_colocated(servers):
    body = {"model": MODEL, "prompt": "The three laws of motion are", "max_tokens": 20,
            "temperature": 0}
    first = httpx.post(servers["prefill"].base_url + "/v1/completions", timeout=120,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == servers["bootstrap_port"]
    second = httpx.post(servers["decode"].base_url + "/v1/completions", timeout=120,
                        json={**body, "kv_transfer_params": params})
    assert second.status_code == 200, second.text
    assert choices(second.json()) == choices(colocated(servers, "/v1/completions", body))
    # the same params again: the K/V was taken by the first pull, so this is an error, not a hang
    again = httpx.post(servers["decode"].base_url + "/v1/completions", timeout=60,
                       json={**body, "kv_transfer_params": params})
    assert again.status_code == 503 and "error" in again.json()
    assert_idle(servers)


def test_client_leaving_during_the_transfer_frees_both_sides(servers):
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": servers["bootstrap_port"],
              "bootstrap_room": 12345}
    body = {"model": MODEL, "prompt": "A lonely request", "max_tokens": 8, **fields}
    with pytest.raises(httpx.ReadTimeout):  # the prefill half never comes: the client gives up
        httpx.post(servers["decode"].base_url + "/v1/completions", json=body, timeout=1.0)
    assert_idle(servers)


def test_bad_transfer_fields_are_400(servers):
    base = servers["decode"].base_url
    bad = httpx.post(base + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "bootstrap_host": "127.0.0.1", "bootstrap_room": "abc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bootstrap_room"
    wrong_role = httpx.post(servers["colocated"].base_url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
    assert wrong_role.status_code == 400


def test_prefill_server_killed_decode_answers_an_error(servers):
    """Last in the module: it kills the prefill server."""
    body = {"model": MODEL, "prompt": "After the crash", "max_tokens": 8, "temperature": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": servers["bootstrap_port"],
            "bootstrap_room": 777}
    servers["prefill"].process.send_signal(signal.SIGKILL)
    servers["prefill"].process.wait()
    start = time.monotonic()
    response = httpx.post(servers["decode"].base_url + "/v1/completions", json=body, timeout=60)
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert response.status_code == 503, response.text
    assert "prefill server" in response.json()["error"]["message"]
    info = httpx.get(servers["decode"].base_url + "/get_server_info", timeout=10).json()
    assert info["num_used_blocks"] == 0 and info["num_waiting"] == 0
