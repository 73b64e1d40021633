"""The hierarchical cache through a real server on SmolLM2-135M (float32): a long shared system
prompt computed by one server is served from disk by a server restarted on the same directory,
on its very first request, with the same greedy text; the tiers' figures reach /metrics and
/get_server_info."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess

SYSTEM = ("You are a careful assistant for a small bakery. " * 12
          + "Answer in one short sentence, and never invent prices or opening hours.")


def server_args(store: Path, *extra: str) -> list[str]:
    return ["--model", "smollm2-135m", "--dtype", "float32", "--num-threads", "1",
            "--max-total-tokens", "1024", "--enable-metrics",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"file_path": str(store)}),
            "--hicache-storage-prefetch-policy", "wait_complete", *extra]


def ask(server: ServerProcess) -> tuple[str, int]:
    body = {"model": "smollm2-135m", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Do you sell rye bread?"}]}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return str(answer["choices"][0]["message"]["content"]), int(answer["usage"]["prompt_tokens"])


@pytest.mark.slow
def test_restart_serves_the_system_prompt_from_disk(tmp_path: Path) -> None:
    with ServerProcess(server_args(tmp_path)) as first:
        text, num_prompt_tokens = ask(first)
        info = httpx.get(f"{first.base_url}/get_server_info", timeout=30).json()
        assert info["hicache_storage_hit_tokens"] == 0
    files = list(tmp_path.glob("*/*.kv"))
    num_cached = (num_prompt_tokens - 1) // 16 * 16  # every full block of the prompt (page 16)
    assert len(files) >= num_cached // 16 and num_cached >= 128  # (+ blocks the answer filled)
    with ServerProcess(server_args(tmp_path)) as again:
        assert ask(again) == (text, num_prompt_tokens)
        info = httpx.get(f"{again.base_url}/get_server_info", timeout=30).json()
        assert info["hicache_storage_hit_tokens"] == num_cached, info
        assert info["hicache_prefetch_waits"] == 1
        metrics = httpx.get(f"{again.base_url}/metrics", timeout=30).text
        line = next(l for l in metrics.splitlines() if l.startswith("servelm:hicache_storage_hit_tokens{"))
        assert float(line.split()[-1]) == num_cached
        assert "hicache storage: directory" in again.log(None)
