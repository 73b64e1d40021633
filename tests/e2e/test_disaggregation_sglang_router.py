"""SGLang's own router (`sglang-router` from PyPI, `--pd-disaggregation`) drives a servelm prefill
and decode server unchanged: greedy answers equal one co-located engine's. The router lives in
its own environment (it pins its own dependencies): set SERVELM_SGLANG_ROUTER_PYTHON to a Python
that imports ``sglang_router`` (`python -m venv /tmp/sgr && /tmp/sgr/bin/pip install
sglang-router`); skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port
from tests.engine_drive import reference_greedy

pytestmark = pytest.mark.slow

ROUTER_PYTHON = os.environ.get("SERVELM_SGLANG_ROUTER_PYTHON")
COMMON = ["smollm2-135m", "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "4096"]


@pytest.fixture
def router_python() -> str:
    if not ROUTER_PYTHON or subprocess.run([ROUTER_PYTHON, "-c", "import sglang_router"],
                                           capture_output=True).returncode != 0:
        pytest.skip("set SERVELM_SGLANG_ROUTER_PYTHON to a Python with sglang-router installed")
    return ROUTER_PYTHON


def test_sglang_router_drives_servelm_prefill_and_decode(router_python, tmp_path):
    prompts = ["The capital of France is", "def quicksort(items):"]
    ids, expected = reference_greedy(prompts, 12, model="smollm2-135m", dtype="float32",
                                     num_threads=1, max_total_tokens=4096)
    bootstrap_port, router_port = free_port(), free_port()
    with ServerProcess([*COMMON, "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(bootstrap_port)]) as prefill, \
            ServerProcess([*COMMON, "--disaggregation-mode", "decode"]) as decode:
        log = open(tmp_path / "router.log", "wb")
        router = subprocess.Popen(
            [router_python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill.base_url, str(bootstrap_port), "--decode", decode.base_url,
             "--host", "127.0.0.1", "--port", str(router_port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{router_port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and router.poll() is None, \
                    (tmp_path / "router.log").read_text(errors="replace")[-3000:]
                time.sleep(0.5)
            for prompt_ids, want in zip(ids, expected):
                response = httpx.post(url + "/generate", timeout=120, json={
                    "input_ids": prompt_ids, "sampling_params": {
                        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
                assert response.status_code == 200, response.text
                assert response.json()["output_ids"] == want
            chat = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": prompts[0], "max_tokens": 12, "temperature": 0})
            assert chat.status_code == 200, chat.text
            info = httpx.get(decode.base_url + "/get_server_info", timeout=10).json()
            assert info["disaggregation_num_transfers"] == 3 and info["num_used_blocks"] == 0
        finally:
            router.terminate()
            router.wait(10)
            log.close()
