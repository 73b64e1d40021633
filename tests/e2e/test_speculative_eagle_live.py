"""EAGLE-3 on a live SmolLM2-135M server with a random-weight head in the published format
(``python -m servelm.model.eagle_checkpoint``; no trained head exists offline, so its drafts are
almost never accepted): the same greedy text and tokens as a plain server, streamed or not, with a
stop string, max_tokens and a JSON schema; the head's figures in /get_server_info. One server at
a time: the plain server's answers are collected first."""

from __future__ import annotations

import httpx
import pytest

from servelm.model.eagle_checkpoint import main as write_head

from .conftest import OPS_MODEL
from .server_process import ServerProcess
from .test_speculative_draft_live import SCHEMA
from .test_speculative_live import complete, stream_text

ARGS = [OPS_MODEL, "--dtype", "float32", "--context-length", "128", "--max-total-tokens", "8192",
        "--num-threads", "1"]


def answers(server) -> dict:
    reference = complete(server)
    text = reference["choices"][0]["text"]
    stop = text[10:14]
    body = {"model": OPS_MODEL, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Give a person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert chat.status_code == 200, chat.text
    return {
        "text": text, "tokens": reference["choices"][0]["logprobs"]["tokens"],
        "usage": reference["usage"], "stream": stream_text(server),
        "stop": complete(server, stop=[stop])["choices"][0]["text"],
        "stop_stream": stream_text(server, stop=[stop]),
        "short": complete(server, max_tokens=7)["choices"][0]["logprobs"]["tokens"],
        "json": chat.json()["choices"][0]["message"]["content"],
    }


@pytest.mark.slow
def test_eagle3_server_equals_the_plain_server(tmp_path):
    head = tmp_path / "eagle3-head"
    write_head(["--model", OPS_MODEL, "--algorithm", "EAGLE3", "--out", str(head)])
    with ServerProcess(ARGS) as plain_server:
        plain = answers(plain_server)
    args = [*ARGS, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
            "--speculative-eagle-topk", "1", "--speculative-num-steps", "3"]
    with ServerProcess(args) as eagle_server:
        speculative = answers(eagle_server)
        info = httpx.get(f"{eagle_server.base_url}/get_server_info", timeout=30).json()
    assert len(plain["text"]) > 20 and plain["json"].startswith("{")
    assert plain["stream"] == plain["text"] and plain["stop_stream"] == plain["stop"]
    assert speculative == plain
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["spec_num_draft_tokens"] > 0 and "spec_acceptance_rate" in info, info
    assert info["spec_draft_used_blocks"] == 0, info
