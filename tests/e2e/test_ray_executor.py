"""The Ray backend (--distributed-executor-backend ray) on a real local Ray cluster.

`ray start --head` runs as a subprocess of the test (its own port and temp dir, stopped at the end);
the server joins it through Ray's RAY_ADDRESS. Rank 1 is a Ray actor in a placement group; the
ranks meet in real gloo collectives. Slow: a Ray head takes ~10-20 s to start on the 2-core box.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine_drive import reference_greedy

from .server_process import ServerProcess, free_port, stream_and_kill, wait_until_gone


def test_a_missing_ray_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.workers.ray_executor import RAY_MISSING, import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ValueError) as failure:
        import_ray()
    assert str(failure.value) == RAY_MISSING and "pip install 'servelm[ray]'" in RAY_MISSING


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster (2 CPUs); yields its address."""
    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats",
                             "--temp-dir", temp_dir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        status = subprocess.run([str(ray_bin), "status", "--address", address], capture_output=True)
        while status.returncode != 0 and time.monotonic() < deadline:
            time.sleep(2)
            status = subprocess.run([str(ray_bin), "status", "--address", address], capture_output=True)
        assert status.returncode == 0, status.stderr.decode()[-2000:]
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops its cluster on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_ray_tp2_matches_tp1_and_a_dead_actor_ends_the_server(ray_cluster: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, num_new_tokens = "smollm2-135m", 12
    prompts, expected = reference_greedy(("The capital of France is", "def quicksort(items):"),
                                         num_new_tokens, model=model, dtype="float32",
                                         num_threads=1, max_total_tokens=1024)
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    server = ServerProcess([model, "--tp", "2", "--distributed-executor-backend", "ray",
                            "--num-threads", "1", "--dtype", "float32", "--max-total-tokens", "1024"])
    with server:
        got = []
        for prompt in prompts:
            response = httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": num_new_tokens,
                                                         "temperature": 0, "ignore_eos": True}})
            assert response.status_code == 200, response.text
            got.append(response.json()["output_ids"])
        assert got == expected
        layout = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]
        assert (layout["executor"], layout["tp_size"], layout["ray_actors"]) == ("ray", 2, 1)
        engine_pid, actor_pid = layout["ranks"][0]["pid"], layout["ranks"][1]["pid"]
        events = stream_and_kill(server.base_url, {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}, actor_pid)
        assert 3 < len(events) < 300
        assert events[-1]["error"]["message"].startswith(
            f"tensor-parallel rank 1 (Ray actor, pid {actor_pid} on {os.uname().nodename})")
        assert server.process is not None
        assert server.process.wait(timeout=60) != 0
    assert wait_until_gone([engine_pid, actor_pid])
