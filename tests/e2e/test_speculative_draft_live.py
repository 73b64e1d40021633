"""Draft-model speculative decoding on a live SmolLM2-135M server, drafted by SmolLM2-135M itself
through vLLM's spelling (--speculative-model PATH): the same greedy text and tokens as a plain
server, streamed or not, with a stop string landing inside an accepted run,
max_tokens cutting one, and a JSON schema; the figures in /get_server_info."""

from __future__ import annotations

import httpx
import pytest

from .conftest import OPS_MODEL
from .server_process import ServerProcess
from .test_speculative_live import complete, stream_text

# -m slow: a third SmolLM2 server; the draft-model mechanics (stops, max_tokens, chunked catch-up,
# sampling) are tested in process on tiny models (test_speculative_draft_tiny.py and
# test_speculative_draft_chunked.py), the live n-gram server covers speculation over HTTP
pytestmark = pytest.mark.slow

# float32 on both: in bfloat16 a 5-token verify step rounds like another batch shape, and a
# near-tie (end of text against a newline, seen here) can flip.
# The plain side is the shared ops server, started with the same four flags.
ARGS = [OPS_MODEL, "--dtype", "float32", "--context-length", "128", "--max-total-tokens", "8192"]


@pytest.fixture(scope="module")
def draft_server():
    args = [*ARGS, "--speculative-model", OPS_MODEL, "--num-speculative-tokens", "4"]
    with ServerProcess(args) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server(ops_server):
    """The shared operations server: ARGS plus metrics, logging and CORS, which change no token."""
    return ops_server


def test_outputs_equal_the_plain_server(draft_server, plain_server):
    plain = complete(plain_server)
    speculative = complete(draft_server)
    choice, reference = speculative["choices"][0], plain["choices"][0]
    assert choice["text"] == reference["text"] and len(choice["text"]) > 20
    assert choice["logprobs"]["tokens"] == reference["logprobs"]["tokens"]
    assert speculative["usage"] == plain["usage"]
    assert stream_text(draft_server) == reference["text"]

    stop = reference["text"][10:14]          # lands inside an accepted run (the draft is the model)
    cut = complete(draft_server, stop=[stop])
    assert cut["choices"][0]["text"] == reference["text"][:reference["text"].index(stop)]
    assert cut["usage"] == complete(plain_server, stop=[stop])["usage"]
    assert stream_text(draft_server, stop=[stop]) == cut["choices"][0]["text"]

    short = complete(draft_server, max_tokens=7)
    assert short["choices"][0]["logprobs"]["tokens"] == reference["logprobs"]["tokens"][:7]
    assert short["usage"]["completion_tokens"] == 7

    info = httpx.get(f"{draft_server.base_url}/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "STANDALONE"
    assert info["spec_accept_length"] > 2.5 and info["spec_draft_used_blocks"] == 0, info


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_equals_the_plain_server(draft_server, plain_server):
    def chat(server) -> str:
        body = {"model": OPS_MODEL, "max_tokens": 40, "temperature": 0,
                "messages": [{"role": "user", "content": "Give a person as JSON."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": SCHEMA}}}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    text = chat(draft_server)
    assert text == chat(plain_server) and text.startswith("{")
