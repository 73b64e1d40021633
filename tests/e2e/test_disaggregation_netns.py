"""The transfer crosses a real interface: the prefill server runs in its own network namespace
joined to this one by a veth pair (root only; skipped otherwise), the decode server here, and the
decode server pulls the K/V from 10.x.y.2 (zmq), or the prefill server writes it into the decode
pool across the veth (nixl, mooncake). Greedy tokens equal one co-located engine's."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port
from tests.e2e.test_disaggregation_onesided import BACKENDS
from tests.e2e.test_multi_node import NodeProcess, second_address  # noqa: F401 (a fixture)
from tests.engine_drive import reference_greedy
from tests.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

FLAGS = ["--skip-tokenizer-init", "--max-total-tokens", "4096", "--num-threads", "1",
         "--dtype", "float32"]


def wait_healthy(url: str, node: NodeProcess, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert node.process is not None and node.process.poll() is None, node.log()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(node.log())


@pytest.mark.parametrize("backend", ["zmq", *BACKENDS])
def test_prefill_in_another_namespace_over_veth(tmp_path: Path, second_address, backend):  # noqa: F811
    namespace, _, prefill_address = second_address
    model = str(make_tiny_model_dir(tmp_path, "llama"))
    prompts = [list(range(3, 60)), [9, 8, 7, 6, 5]]
    _, expected = reference_greedy(prompts, 10, model=model, dtype="float32", num_threads=1,
                                   skip_tokenizer_init=True, max_total_tokens=4096)
    http_port, bootstrap_port = free_port(), free_port()
    prefill_args = [model, *FLAGS, "--host", "0.0.0.0", "--port", str(http_port),
                    "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                    str(bootstrap_port), "--disaggregation-transfer-backend", backend]
    with NodeProcess(prefill_args, tmp_path / "prefill.log",
                     prefix=("ip", "netns", "exec", namespace)) as prefill, \
            ServerProcess([model, *FLAGS, "--disaggregation-mode", "decode",
                           "--disaggregation-transfer-backend", backend]) as decode:
        prefill_url = f"http://{prefill_address}:{http_port}"
        wait_healthy(prefill_url, prefill)
        for prompt, want in zip(prompts, expected):
            body = {"input_ids": prompt, "bootstrap_host": prefill_address,
                    "bootstrap_port": bootstrap_port, "bootstrap_room": random.randrange(2 ** 62),
                    "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(httpx.post, prefill_url + "/generate", json=body, timeout=120)
                second = pool.submit(httpx.post, decode.base_url + "/generate", json=body, timeout=120)
                assert first.result().status_code == 200, first.result().text
                answer = second.result()
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_ids"] == want
        info = httpx.get(decode.base_url + "/get_server_info", timeout=10).json()
        assert info["disaggregation_num_transfers"] == 2 and info["num_used_blocks"] == 0
