"""`servelm router` in PD mode (SGLang's protocol) over real servelm prefill and decode servers
(SmolLM2-135M, float32, one thread each), and the same servers driven by `sglang-router`.

The greedy tokens through the pair equal those of one co-located server, streaming and not.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack

import httpx
import pytest

from .router_process import RouterProcess
from .server_process import ServerProcess, free_port
from .test_router import MODEL, WORKER_ARGS, streamed_text

pytestmark = pytest.mark.slow

NATIVE = {"text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def start(stack: ExitStack, args: list[str]) -> ServerProcess:
    return stack.enter_context(ServerProcess(args))


@pytest.fixture(scope="module")
def pd_servers():
    with ExitStack() as stack:
        colocated = stack.enter_context(ServerProcess(WORKER_ARGS))
        bootstrap_port = free_port()
        prefill = start(stack, [*WORKER_ARGS, "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(bootstrap_port)])
        decode = start(stack, [*WORKER_ARGS, "--disaggregation-mode", "decode"])
        yield colocated, prefill, bootstrap_port, decode


def expected(colocated: ServerProcess) -> tuple[list[int], str]:
    native = httpx.post(f"{colocated.base_url}/generate", json=NATIVE, timeout=120).json()
    completion = httpx.post(f"{colocated.base_url}/v1/completions", json=COMPLETION, timeout=120).json()
    return native["output_ids"], completion["choices"][0]["text"]


def check_pair(base_url: str, colocated: ServerProcess) -> None:
    output_ids, text = expected(colocated)
    native = httpx.post(f"{base_url}/generate", json=NATIVE, timeout=120)
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == output_ids
    completion = httpx.post(f"{base_url}/v1/completions", json=COMPLETION, timeout=120)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == text
    assert streamed_text(base_url, "/v1/completions", COMPLETION)[0] == text


def test_our_router_drives_a_prefill_decode_pair(pd_servers) -> None:
    colocated, prefill, bootstrap_port, decode = pd_servers
    with RouterProcess(["--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap_port),
                        "--decode", decode.base_url]) as router:
        check_pair(router.base_url, colocated)
        batch = httpx.post(f"{router.base_url}/generate", timeout=120, json={
            "text": ["Hello, my name is", "1, 2, 3,"], "sampling_params": {"max_new_tokens": 8,
                                                                          "temperature": 0}})
        assert batch.status_code == 200 and len(batch.json()) == 2, batch.text
    # no port on the command line: the router reads it from the prefill server
    with RouterProcess(["--prefill", prefill.base_url, "--decode", decode.base_url]) as router:
        assert router.workers()[prefill.base_url]["bootstrap_port"] == bootstrap_port
        check_pair(router.base_url, colocated)


def test_pd_master_with_registered_servers(pd_servers) -> None:
    colocated, prefill, bootstrap_port, decode = pd_servers
    with RouterProcess([], command=("serve", "--run_mode", "pd_master")) as master:
        for body in ({"url": prefill.base_url, "mode": "prefill", "bootstrap_port": bootstrap_port},
                     {"url": decode.base_url, "mode": "decode"}):
            assert httpx.post(f"{master.base_url}/register", json=body, timeout=30).status_code == 200
        check_pair(master.base_url, colocated)


def test_a_dead_decode_server_gives_an_error_not_a_hang(pd_servers) -> None:
    colocated, prefill, bootstrap_port, _ = pd_servers
    dead = f"http://127.0.0.1:{free_port()}"
    with RouterProcess(["--prefill", prefill.base_url, str(bootstrap_port), "--decode", dead]) as router:
        response = httpx.post(f"{router.base_url}/generate", json=NATIVE, timeout=60)
        assert response.status_code == 503 and "decode" in response.json()["error"]["message"]


# --- sglang-router (PyPI), installed apart from servelm's venv ----------------------------------

SGLANG_ROUTER_PYTHON = "/tmp/sglr-venv/bin/python"
"""python -m venv /tmp/sglr-venv && /tmp/sglr-venv/bin/pip install sglang-router (README, Router)."""


def sglang_router(args: list[str]) -> RouterProcess:
    if not os.path.exists(SGLANG_ROUTER_PYTHON):
        pytest.skip(f"sglang-router is not installed at {SGLANG_ROUTER_PYTHON} (see README, Router)")
    return RouterProcess(args, startup_timeout_s=180, program=[
        SGLANG_ROUTER_PYTHON, "-m", "sglang_router.launch_router", "--log-level", "warn"])


def wait_for_workers(router: RouterProcess, count: int, timeout_s: float = 120) -> None:
    """sglang-router answers /health before it has checked its workers: wait for them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{router.base_url}/workers", timeout=10).json().get("workers", [])
        if sum(1 for w in workers if w.get("is_healthy")) >= count:
            return
        time.sleep(1)
    raise TimeoutError(f"sglang-router did not take its workers:\n{router.log()}")


def test_sglang_router_drives_servelm_in_data_parallel_mode() -> None:
    """Two servelm servers behind sglang-router (round robin): greedy outputs, streaming and not,
    equal a direct request's, and both servers served."""
    if not os.path.exists(SGLANG_ROUTER_PYTHON):
        pytest.skip(f"sglang-router is not installed at {SGLANG_ROUTER_PYTHON} (see README, Router)")
    with ServerProcess(WORKER_ARGS) as first, ServerProcess(WORKER_ARGS) as second:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 12, "temperature": 0}
        output_ids, text = expected(first)
        direct_chat = httpx.post(f"{first.base_url}/v1/chat/completions", json=chat,
                                 timeout=120).json()["choices"][0]["message"]["content"]
        with sglang_router(["--worker-urls", first.base_url, second.base_url,
                            "--policy", "round_robin"]) as router:
            wait_for_workers(router, 2)
            for _ in range(2):
                check_pair(router.base_url, first)
                routed = httpx.post(f"{router.base_url}/v1/chat/completions", json=chat, timeout=120)
                assert routed.json()["choices"][0]["message"]["content"] == direct_chat
                assert streamed_text(router.base_url, "/v1/chat/completions", chat)[0] == direct_chat
        for server in (first, second):
            info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
            assert info["num_generated_tokens"] > 0


def test_sglang_router_drives_servelm_in_pd_mode(pd_servers) -> None:
    colocated, prefill, bootstrap_port, decode = pd_servers
    with sglang_router(["--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap_port),
                        "--decode", decode.base_url, "--policy", "round_robin"]) as router:
        wait_for_workers(router, 2)
        check_pair(router.base_url, colocated)


def test_prefill_and_decode_servers_register_themselves_with_a_pd_master(pd_servers) -> None:
    """LightLLM's flow: the master first, then servers started with --pd_master_ip/--pd_master_port
    announce themselves (POST /register) and the master routes over them."""
    colocated, _, _, _ = pd_servers
    master_port = free_port()
    master = RouterProcess([], command=("serve", "--run_mode", "pd_master"))
    master.port, master.base_url = master_port, f"http://127.0.0.1:{master_port}"
    register = ["--pd_master_ip", "127.0.0.1", "--pd_master_port", str(master_port)]
    with master, ExitStack() as stack:
        prefill = start(stack, [*WORKER_ARGS, "--run_mode", "prefill", *register,
                                        "--disaggregation-bootstrap-port", str(free_port())])
        decode = start(stack, [*WORKER_ARGS, "--run_mode", "decode", *register])
        listing = httpx.get(f"{master.base_url}/list_workers", timeout=10).json()
        assert listing["prefill"] == [prefill.base_url] and listing["decode"] == [decode.base_url]
        deadline = time.monotonic() + 60  # a server that registered before it served /health
        while not all(w["is_healthy"] for w in master.workers().values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        check_pair(master.base_url, colocated)
