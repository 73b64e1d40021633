"""Flags that must reach a real server (issue 11): --seed / --random-seed reach sampling, and
--served-model-name takes a list."""

from __future__ import annotations

import httpx
import pytest

from .server_process import ServerProcess, running_together

MODEL = "smollm2-135m"
ARGS = [MODEL, "--num-threads", "1", "--max-total-tokens", "4096", "--context-length", "512",
        "--served-model-name", "smol", "smollm2"]
PROMPTS = ["The best thing about the sea is", "Once upon a time", "The best thing about the sea is"]


def sample_texts(server: ServerProcess) -> list[str]:
    """The prompts one after another (no seed, temperature 1): the server's arrival order."""
    texts = []
    for prompt in PROMPTS:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 1.0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == "smol"  # the first served name, whichever the request used
        texts.append(body["choices"][0]["text"])
    return texts


@pytest.mark.slow   # two server starts; tests/unit/engine/test_server_seed.py checks the seed at engine level
def test_same_seed_same_samples_across_server_starts() -> None:
    """Two starts side by side (--seed and its alias), each asked the prompts in the same order."""
    with running_together(ServerProcess([*ARGS, "--seed", "11"]),
                          ServerProcess([*ARGS, "--random-seed", "11"])) as (first, second):
        models = httpx.get(f"{first.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["smol", "smollm2"]
        texts = sample_texts(first)
        assert sample_texts(second) == texts
    assert texts[0] != texts[2], "the same prompt later in the order must draw differently"
    assert len(set(texts)) == 3
