"""Data parallelism: two engine replicas behind one server give dp 1's greedy tokens (float32),
both serve requests, and killing one replica mid-request fails the request and ends the server
with no orphan process. Each replica is a real engine process with one thread."""

from __future__ import annotations

import httpx

from .conftest import OPS_MODEL
from .server_process import ServerProcess, is_running, stream_and_kill, wait_until_gone

MODEL = OPS_MODEL  # dp 1's tokens come from the shared operations server (float32, one engine)
PROMPTS = ["The capital of France is", "def quicksort(items):", "Once upon a time",
           "1, 2, 3, 4,"]


def generate(server: ServerProcess, text: str, max_tokens: int) -> list[int]:
    response = httpx.post(f"{server.base_url}/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True}}, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])



def server_args(dp: int) -> list[str]:
    return [MODEL, "--dp-size", str(dp), "--dtype", "float32", "--num-threads", "1",
            "--max-total-tokens", "1024", "--enable-metrics"]


def test_dp2_matches_dp1_and_both_replicas_serve_then_a_killed_replica_ends_the_server(ops_server) -> None:
    # dp 1: the shared operations server (the same model in float32; one engine in the server)
    expected = [generate(ops_server, text, 8) for text in PROMPTS]
    with ServerProcess(server_args(2)) as server:
        got = [generate(server, text, 8) for text in PROMPTS]  # round robin: 0, 1, 0, 1
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
        replicas = info["dp_replicas"]
        assert [r["num_requests_dispatched"] for r in replicas] == [2, 2]
        assert all(r["num_generated_tokens"] == 16 for r in replicas)
        assert info["num_generated_tokens"] == 32
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert 'dp_replica="1"' in metrics
        assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
        pids = [r["pid"] for r in replicas]
        assert all(is_running(pid) for pid in pids) and pids[0] != pids[1]
        # the next request goes to replica 0 (round robin); kill it mid-generation
        events = stream_and_kill(server.base_url, {"text": "Hello", "sampling_params": {
            "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, pids[0])
        assert 3 < len(events) < 400
        assert events[-1]["error"]["message"].endswith(
            f"data-parallel replica 0 (engine process pid {pids[0]}) was killed by SIGKILL")
        assert server.process is not None
        server.process.wait(timeout=30)
        assert server.process.returncode != 0
        assert wait_until_gone(pids)
    assert got == expected
