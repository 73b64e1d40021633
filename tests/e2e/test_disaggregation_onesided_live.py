"""The one-sided backends (nixl, mooncake) between real `servelm serve` processes (smollm2-135m,
float32, 1 thread each): greedy answers equal one co-located server's for a completion with a stop
string, a 1,024-token prompt and 8 concurrent requests; the decode server killed while its pull
waits leaves the prefill server's pool idle; the prefill server killed gives the decode client a
503, never a hang. Skipped where a backend's package is absent."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port
from tests.e2e.test_disaggregation_live import both, choices, colocated
from tests.e2e.test_disaggregation_onesided import BACKENDS

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
COMMON = ["--model", MODEL, "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "16384"]
TIMEOUT_S = 20


def start(backend: str, mode: str, bootstrap_port: int) -> ServerProcess:
    return ServerProcess([*COMMON, "--disaggregation-mode", mode,
                          "--disaggregation-bootstrap-port", str(bootstrap_port),
                          "--disaggregation-transfer-backend", backend,
                          "--disaggregation-transfer-timeout", str(TIMEOUT_S)])


def server_info(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/get_server_info", timeout=10).json()


def wait_idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 15
    while True:
        info = server_info(server)
        figures = (info["num_used_blocks"], info["num_running"], info["num_waiting"],
                   info.get("disaggregation_num_parked_blocks", 0),
                   info.get("disaggregation_num_waiting_pulls", 0),
                   info.get("disaggregation_num_held_blocks", 0))
        if figures == (0,) * 6:
            return
        assert time.monotonic() < deadline, figures
        time.sleep(0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_servers_match_colocated_and_survive_either_side_dying(backend):
    bootstrap_port = free_port()
    servers = [ServerProcess(COMMON), start(backend, "prefill", bootstrap_port),
               start(backend, "decode", bootstrap_port)]
    with ThreadPoolExecutor(3) as pool:
        reference, prefill, decode = pool.map(lambda server: server.__enter__(), servers)
    try:
        routed = {"prefill": prefill, "decode": decode, "colocated": reference,
                  "bootstrap_port": bootstrap_port}
        body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0,
                "stop": ["\n\n"]}
        _, answer = both(routed, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        assert choices(answer.json()) == choices(colocated(routed, "/v1/completions", body))
        words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
        rng = random.Random(5)
        long_body = {"text": " ".join(rng.choice(words) for _ in range(1000)),
                     "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        _, answer = both(routed, "/generate", long_body)
        assert answer.json()["text"] == colocated(routed, "/generate", long_body)["text"]
        bodies = [{"model": MODEL, "prompt": f"Item {i}: the sky is", "max_tokens": 6,
                   "temperature": 0} for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda b: colocated(routed, "/v1/completions", b), bodies))
            got = list(pool.map(lambda b: both(routed, "/v1/completions", b)[1], bodies))
        assert [choices(g.json()) for g in got] == [choices(e) for e in expected]
        sent = server_info(prefill)["disaggregation_bytes_sent"]
        assert sent > 0 and server_info(decode)["disaggregation_bytes_received"] == sent
        wait_idle(prefill)
        wait_idle(decode)

        # the decode server dies while its pull waits: the prefill request's K/V is freed
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "bootstrap_room": 4242}
        lonely = {"model": MODEL, "prompt": "Nobody will decode this", "max_tokens": 8, **room}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, decode.base_url + "/v1/completions", json=lonely,
                                  timeout=60)
            deadline = time.monotonic() + 30
            while server_info(prefill)["disaggregation_num_waiting_pulls"] == 0:
                assert time.monotonic() < deadline, "the pull never arrived"
                time.sleep(0.1)
            decode.process.send_signal(signal.SIGKILL)
            decode.process.wait()
            with pytest.raises(httpx.HTTPError):
                pending.result()
        answer = httpx.post(prefill.base_url + "/v1/completions", json=lonely, timeout=60)
        assert answer.status_code == 200, answer.text  # the prefill half: one token, K/V parked
        deadline = time.monotonic() + TIMEOUT_S + 15
        while True:  # its write fails (the agent is gone) or nobody pulls again: freed
            info = server_info(prefill)
            if info["num_used_blocks"] == 0 and info["disaggregation_num_parked_blocks"] == 0 \
                    and info["disaggregation_num_waiting_pulls"] == 0:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.5)
    finally:
        for server in servers:
            server.__exit__(None, None, None)
