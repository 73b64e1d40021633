"""The start-up warm-up on a real server (tiny random Gemma 3 model): it runs before the server is
healthy, and leaves no step, prompt token, cached block or request metric behind; a user prompt
after it matches nothing in the prefix cache. ``--skip-server-warmup`` starts without it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.tiny_models import make_tiny_model_dir

from .server_process import ServerProcess

PROMPT = [(7 * index + 11) % 64 for index in range(40)]
"""What the warm-up computes first (its tokens modulo the vocabulary): nothing of it may be cached."""


def _info(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()


def _metric(server: ServerProcess, counter: str) -> float:
    """A counter's total over its labels (``counter``: the name without ``_total``)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((f"{counter}_total ", f"{counter}_total{{")))


@pytest.mark.slow   # two server starts (~30 s on the shared box); tests/unit/engine/test_warmup.py is the quick one
def test_warm_up_runs_before_ready_and_leaves_no_trace(tmp_path: Path) -> None:
    path = make_tiny_model_dir(tmp_path, "gemma3")
    args = [str(path), "--num-threads", "1", "--max-total-tokens", "2048", "--chunked-prefill-size", "32",
            "--enable-metrics"]
    with ServerProcess(args, warm_up=True) as server:
        assert "start-up warm-up: prefill chunks and decode batches ran in" in server.log(None)
        info = _info(server)
        assert not info["skip_server_warmup"]
        assert info["num_steps"] == 0 and info["num_prompt_tokens"] == 0
        assert info["num_cached_blocks"] == 0 and info["num_used_blocks"] == 0
        assert _metric(server, "servelm:prompt_tokens") == 0
        assert _metric(server, "servelm:request_finished") == 0
        body = {"model": str(path), "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        info = _info(server)
        assert info["num_prompt_tokens"] == len(PROMPT) and info["num_cached_prompt_tokens"] == 0
        assert _metric(server, "servelm:prompt_tokens") == len(PROMPT)
    with ServerProcess([*args, "--skip-server-warmup"]) as server:
        assert "start-up warm-up skipped (--skip-server-warmup)" in server.log(None)
        assert _info(server)["skip_server_warmup"]
