"""`servelm router` in front of two real servelm servers (SmolLM2-135M, float32, one thread each):
greedy tokens through the router equal a direct request (streaming and not), each policy picks as
specified, a killed worker leaves the rotation while requests still succeed, a failure after a
worker took a request is never retried, and with no worker left the answer is a 503."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from .router_process import RouterProcess
from .server_process import ServerProcess, free_port, running_together

MODEL = "smollm2-135m"
WORKER_ARGS = [MODEL, "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "2048",
               "--context-length", "512"]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def worker_pool() -> Iterator[list[ServerProcess]]:
    """The module's two workers, started together; the killed-worker test ends the first (the
    victim it needs: no third start), and the ``workers`` fixture starts it again for a test after it."""
    with contextlib.ExitStack() as stack:
        pool = list(stack.enter_context(running_together(ServerProcess(WORKER_ARGS), ServerProcess(WORKER_ARGS))))
        stack.callback(lambda: [server.__exit__(None, None, None) for server in pool])
        yield pool


@pytest.fixture
def workers(worker_pool: list[ServerProcess]) -> tuple[ServerProcess, ...]:
    """The two running workers (one that a test killed is started again first)."""
    for index, server in enumerate(worker_pool):
        if server.process is None or server.process.poll() is not None:
            worker_pool[index] = ServerProcess(WORKER_ARGS).__enter__()
    return tuple(worker_pool)


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def streamed_text(base_url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """The text of a streamed completion or chat, and every event."""
    events: list[dict] = []
    with httpx.stream("POST", f"{base_url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    text = ""
    for event in events:
        for choice in event.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, events


def server_info(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()


def requests_by_worker(router: RouterProcess) -> dict[str, int]:
    return {url: w["num_requests"] for url, w in router.workers().items()}


def test_greedy_through_the_router_equals_a_direct_request(workers) -> None:
    first, second = workers
    completion = {"model": MODEL, "prompt": "The capital of France is", **GREEDY}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], **GREEDY}
    native = {"text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    direct_completion = post(first.base_url, "/v1/completions", completion).json()["choices"][0]["text"]
    direct_chat = post(first.base_url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    direct_native = post(first.base_url, "/generate", native).json()["output_ids"]
    with RouterProcess(["--worker", first.base_url, second.base_url, "--policy", "round_robin"]) as router:
        for _ in range(2):  # round robin: both workers answer each request once
            assert post(router.base_url, "/v1/completions", completion).json()["choices"][0]["text"] \
                == direct_completion
            assert post(router.base_url, "/v1/chat/completions", chat).json()["choices"][0][
                "message"]["content"] == direct_chat
            assert post(router.base_url, "/generate", native).json()["output_ids"] == direct_native
            text, events = streamed_text(router.base_url, "/v1/completions", completion)
            assert text == direct_completion and len(events) > 3  # chunk by chunk
            assert streamed_text(router.base_url, "/v1/chat/completions", chat)[0] == direct_chat
        models = httpx.get(f"{router.base_url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == MODEL
        bad = httpx.post(f"{router.base_url}/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"}, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json()  # the worker's own answer
        assert sorted(requests_by_worker(router).values()) == [5, 6]  # 10 requests, then the bad one
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
        assert f'servelm_router_requests_total{{worker="{first.base_url}",role="normal"}}' in metrics


def test_round_robin_spreads_evenly_and_shortest_queue_avoids_the_busy_worker(workers) -> None:
    first, second = workers
    short = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    with RouterProcess(["--worker", first.base_url, second.base_url, "--policy", "round_robin"]) as router:
        for _ in range(6):
            assert post(router.base_url, "/v1/completions", short).status_code == 200
        assert requests_by_worker(router) == {first.base_url: 3, second.base_url: 3}
    with RouterProcess(["--worker", first.base_url, second.base_url, "--policy", "shortest_queue"]) as router:
        long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        started, stop = threading.Event(), threading.Event()
        generated_before = server_info(first)["num_generated_tokens"]

        def stream_long() -> None:
            with httpx.stream("POST", f"{router.base_url}/v1/completions", json=long, timeout=300) as response:
                for _ in response.iter_lines():
                    started.set()
                    if stop.is_set():
                        return  # the client goes away mid-stream

        thread = threading.Thread(target=stream_long)
        thread.start()
        assert started.wait(120)
        busy = [url for url, w in router.workers().items() if w["num_in_flight"] == 1]
        assert busy == [first.base_url]  # ties go to the first worker
        for _ in range(3):  # the first worker is busy: each short request goes to the second
            assert post(router.base_url, "/v1/completions", short).status_code == 200
        assert requests_by_worker(router) == {first.base_url: 1, second.base_url: 3}
        stop.set()
        thread.join(60)
        # the client's disconnect reaches the worker through the router: the generation stops
        assert wait_for(lambda: router.workers()[first.base_url]["num_in_flight"] == 0, 30)
        assert wait_for(lambda: server_info(first)["num_running"] == 0, 30)
        assert server_info(first)["num_generated_tokens"] - generated_before < 400  # cut short


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker(workers) -> None:
    first, second = workers
    prefix_a = "You are a helpful assistant who answers questions about geography. " * 3
    prefix_b = "Translate the following English sentences into French, carefully. " * 3
    with RouterProcess(["--worker", first.base_url, second.base_url, "--policy", "cache_aware"]) as router:
        before = requests_by_worker(router)
        counts = []
        for prefix in (prefix_a, prefix_b):
            for question in ("Q1?", "Q2?", "Q3?"):
                assert post(router.base_url, "/v1/completions", {
                    "model": MODEL, "prompt": prefix + question, "max_tokens": 1}).status_code == 200
            now = requests_by_worker(router)
            counts.append({url: now[url] - before[url] for url in now})
            before = now
        # all of a prefix's requests on one worker, and the new prefix on the other (smaller tree)
        assert sorted(counts[0].values()) == [0, 3] and sorted(counts[1].values()) == [0, 3]
        assert [url for url, n in counts[0].items() if n] != [url for url, n in counts[1].items() if n]


def test_workers_added_removed_and_registered(workers) -> None:
    first, second = workers
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with RouterProcess(["--worker", first.base_url, "--policy", "round_robin"]) as router:
        added = httpx.post(f"{router.base_url}/add_worker", params={"url": second.base_url}, timeout=30)
        assert added.status_code == 200 and added.json()["worker"]["is_healthy"]
        listing = httpx.get(f"{router.base_url}/list_workers", timeout=10).json()
        assert listing["urls"] == [first.base_url, second.base_url]
        removed = httpx.post(f"{router.base_url}/remove_worker", params={"url": first.base_url}, timeout=10)
        assert removed.status_code == 200
        for _ in range(2):
            assert post(router.base_url, "/v1/completions", short).status_code == 200
        assert requests_by_worker(router) == {second.base_url: 2}
        missing = httpx.post(f"{router.base_url}/remove_worker", params={"url": first.base_url}, timeout=10)
        assert missing.status_code == 404 and "not registered" in missing.json()["error"]["message"]
        assert httpx.post(f"{router.base_url}/register", json={"url": first.base_url, "mode": "normal"},
                          timeout=10).status_code == 404  # only a pd_master takes registrations
    with RouterProcess([], command=("serve", "--run_mode", "pd_master")) as master:
        assert post(master.base_url, "/v1/completions", short).status_code == 503  # nobody yet
        for body, status in (({"url": first.base_url, "mode": "normal"}, 200),
                             ({"url": first.base_url, "mode": "sideways"}, 400),
                             ({"mode": "normal"}, 400)):
            response = httpx.post(f"{master.base_url}/register", json=body, timeout=30)
            assert response.status_code == status, response.text
        assert post(master.base_url, "/v1/completions", short).status_code == 200


def test_no_worker_answers_503_at_once() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with RouterProcess(["--worker", *dead]) as router:
        started = time.monotonic()
        response = post(router.base_url, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert response.status_code == 503 and time.monotonic() - started < 10
        assert response.json()["error"]["type"] == "server_error"
        assert "no healthy worker" in response.json()["error"]["message"]
        assert all(not w["is_healthy"] for w in router.workers().values())


def test_a_killed_worker_leaves_the_rotation_and_a_started_stream_is_never_retried(workers) -> None:
    victim, survivor = workers  # the module's first worker ends here (started again if needed)
    # probes once a minute: what happens below is the routing path's own doing
    slow_probes = ["--policy", "round_robin", "--health-check-interval-s", "60"]
    short = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    expected_text = post(survivor.base_url, "/v1/completions", short).json()["choices"][0]["text"]
    with RouterProcess(["--worker", victim.base_url, survivor.base_url, *slow_probes]) as router:
        # round robin: the first request (a long stream) goes to the victim; kill it mid-way
        events: list[dict] = []
        body = {**short, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    events.append(json.loads(line[5:]))
                    if len(events) == 3:
                        assert victim.process is not None
                        os.kill(victim.process.pid, signal.SIGKILL)
        assert 3 <= len(events) < 300
        assert "error" in events[-1] and victim.base_url in events[-1]["error"]["message"]
        assert router.workers()[survivor.base_url]["num_requests"] == 0  # not re-sent
        # the 2nd request goes to the survivor; the 3rd to the victim, whose refused
        # connection takes it out of rotation and sends the request (once) to the survivor
        for _ in range(3):
            response = post(router.base_url, "/v1/completions", short)
            assert response.status_code == 200
            assert [c["text"] for c in response.json()["choices"]] == [expected_text]
        view = router.workers()
        assert not view[victim.base_url]["is_healthy"]
        assert view[survivor.base_url]["num_requests"] == 3
        assert view[victim.base_url]["num_errors"] == 2 and view[victim.base_url]["num_in_flight"] == 0
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
        assert "servelm_router_retries_total 1" in metrics


def wait_for(predicate, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


@pytest.mark.slow
def test_a_worker_that_comes_back_rejoins_the_rotation(workers) -> None:
    _, survivor = workers
    fast_probes = ["--policy", "round_robin", "--health-check-interval-s", "0.5",
                   "--health-failure-threshold", "2", "--health-success-threshold", "2"]
    first_life = ServerProcess(WORKER_ARGS)
    with first_life:
        with RouterProcess(["--worker", first_life.base_url, survivor.base_url, *fast_probes]) as router:
            assert router.workers()[first_life.base_url]["is_healthy"]
            assert first_life.process is not None
            os.kill(first_life.process.pid, signal.SIGKILL)
            assert wait_for(lambda: not router.workers()[first_life.base_url]["is_healthy"])
            second_life = ServerProcess(WORKER_ARGS)
            second_life.port, second_life.base_url = first_life.port, first_life.base_url
            with second_life:
                assert wait_for(lambda: router.workers()[first_life.base_url]["is_healthy"])
                for _ in range(4):
                    assert post(router.base_url, "/v1/completions", {
                        "model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
                assert router.workers()[first_life.base_url]["num_requests"] == 2
