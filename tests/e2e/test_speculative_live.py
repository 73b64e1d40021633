"""N-gram speculative decoding on a live SmolLM2-135M server: the same greedy text and tokens as
the plain server (ops_server), streamed or not, with a stop string landing inside an accepted run
and max_tokens cutting one; the acceptance figures in /get_server_info, /metrics and the stats
line."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import OPS_MODEL
from .server_process import ServerProcess

# A prompt whose continuation copies it: the n-gram proposer's case.
PROMPT = ("Copy the list exactly.\nList: alpha, beta, gamma, delta, epsilon, zeta, eta, theta.\n"
          "Copy: alpha, beta, gamma, delta,")


@pytest.fixture(scope="module")
def spec_server():
    args = [OPS_MODEL, "--speculative-algorithm", "NGRAM", "--num-speculative-tokens", "4",
            "--enable-metrics", "--log-stats-interval", "1", "--context-length", "128",
            "--max-total-tokens", "8192", "--dtype", "float32"]
    with ServerProcess(args) as running:
        yield running


def complete(server, **extra) -> dict:
    body = {"model": OPS_MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "logprobs": 1, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_text(server, **extra) -> str:
    body = {"model": OPS_MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "stream": True, **extra}
    text = ""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_outputs_equal_the_plain_server(spec_server, ops_server):
    plain = complete(ops_server)
    speculative = complete(spec_server)
    choice, reference = speculative["choices"][0], plain["choices"][0]
    assert choice["text"] == reference["text"] and len(choice["text"]) > 20
    assert choice["logprobs"]["tokens"] == reference["logprobs"]["tokens"]
    assert speculative["usage"] == plain["usage"]
    assert stream_text(spec_server) == reference["text"]

    stop = reference["text"][10:14]          # lands inside a copied (accepted) run
    cut = complete(spec_server, stop=[stop])
    assert cut["choices"][0]["text"] == reference["text"][:reference["text"].index(stop)]
    assert cut["usage"] == complete(ops_server, stop=[stop])["usage"]
    assert stream_text(spec_server, stop=[stop]) == cut["choices"][0]["text"]

    short = complete(spec_server, max_tokens=7)
    assert short["choices"][0]["logprobs"]["tokens"] == reference["logprobs"]["tokens"][:7]
    assert short["usage"]["completion_tokens"] == 7


def test_acceptance_figures_are_reported(spec_server):
    complete(spec_server)
    info = httpx.get(f"{spec_server.base_url}/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["spec_num_draft_tokens"] > 0 and info["spec_accept_length"] > 1.5, info
    metrics = httpx.get(f"{spec_server.base_url}/metrics", timeout=30).text
    line = next(m for m in metrics.splitlines() if m.startswith("servelm:spec_accept_length{"))
    assert float(line.split()[-1]) > 1.5
    assert "spec_accept_length=" in spec_server.log(None)
