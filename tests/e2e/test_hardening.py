"""Issue 19 on a live SmolLM2 server: what a careless or hostile client can do, answered properly.

- Idle and slowloris sockets are closed after the header timeout; a body that never completes is
  closed after the body timeout; connections past --max-connections are closed at once; normal
  requests keep working throughout. A connection past the limit is answered 503 with
  Retry-After before it is closed.
- A 413 closes the connection.
- /get_server_info answers within seconds while the engine is stopped (SIGSTOP), from the last
  known figures and their age; /health_generate stays cheap and 200 while the server is busy.
- A streamed request refused for a full queue is a 503 with Retry-After, before any stream.
- A request id already in use on /generate is a 400.
- A request over --max-sequences-per-request (prompts x n) is a 400.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from .server_process import ServerProcess

MODEL = "smollm2-135m"
ARGS = [MODEL, "--context-length", "2048", "--max-total-tokens", "8192", "--num-threads", "1",
        "--http-header-timeout-s", "2", "--http-body-timeout-s", "2", "--max-connections", "40",
        "--max-running-requests", "2", "--max-queued-requests", "2",
        "--max-sequences-per-request", "8"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS) as running:
        yield running


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _is_closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


def _complete(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body})


def test_idle_slow_and_excess_connections_are_closed(server):
    idle = [_connect(server) for _ in range(20)]
    slow = _connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    body = _connect(server)
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    stop = threading.Event()

    def trickle() -> None:  # slowloris: a header byte every 0.3 s, never finishing
        while not stop.wait(0.3):
            try:
                slow.sendall(b"X")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    try:
        excess = [_connect(server) for _ in range(30)]  # 20 + 2 + 30 > 40
        assert sum(_is_closed_by_server(sock, 0.5) for sock in excess) >= 10
        started = time.monotonic()
        assert _is_closed_by_server(slow, 10), "a slowloris connection was kept open"
        assert _is_closed_by_server(body, 10), "an unfinished body was waited on for good"
        assert all(_is_closed_by_server(sock, 10) for sock in idle), "idle sockets kept open"
        assert time.monotonic() - started < 8
        assert _complete(server).status_code == 200
    finally:
        stop.set()
        for sock in [*idle, slow, body, *excess]:
            sock.close()


def test_a_connection_past_the_limit_gets_a_503(server):
    """Past --max-connections a new connection is answered 503 + Retry-After (OpenAI error JSON)
    and closed, instead of being dropped with nothing said."""
    held = [_connect(server) for _ in range(40)]  # the limit; they close after the 2 s header timeout
    try:
        time.sleep(0.2)
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.headers["connection"] == "close"
        error = response.json()["error"]
        assert error["type"] == "server_error" and "--max-connections" in error["message"]
        raw = _connect(server)  # a client that sends nothing reads the same answer, then EOF
        raw.settimeout(5)
        head = raw.recv(4096)
        assert head.startswith(b"HTTP/1.1 503"), head[:100]
        assert _is_closed_by_server(raw, 5)
        raw.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert _complete(server).status_code == 200


def test_413_closes_the_connection(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 99999999\r\n\r\n{\"prompt\": \"")
    sock.settimeout(10)
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    assert _is_closed_by_server(sock, 5)
    sock.close()


def test_server_info_answers_while_the_engine_is_stopped(server):
    import psutil

    assert httpx.get(f"{server.base_url}/get_server_info", timeout=10).status_code == 200
    children = psutil.Process(server.process.pid).children()
    engine = next(c for c in children if "spawn_main" in " ".join(c.cmdline())
                  and "servelm-template" not in c.name())
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = httpx.get(f"{server.base_url}/get_server_info", timeout=30)
        elapsed_s = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert elapsed_s < 5, elapsed_s
        assert response.json()["stats_age_s"] >= 1.5  # stale figures, and they say so
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    assert httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()["stats_age_s"] < 1


class _Stream(threading.Thread):
    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.status: int | None = None
        self.started = threading.Event()
        self.stop = threading.Event()
        """Set: close the stream at its next line (the client disconnects; the server aborts it)."""

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.base_url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                    "ignore_eos": True, "stream": True}) as response:
                self.status = response.status_code
                self.started.set()
                for _ in response.iter_lines():
                    if self.stop.is_set():
                        break
        finally:
            self.started.set()


def test_busy_server_streams_503_and_stays_healthy(server):
    # 2 running + 2 queued fill the server (--max-running-requests 2 --max-queued-requests 2). The
    # streams are long (a fast CPU decodes 200 tokens of this model in about a second, and then
    # the server is no longer full when the probe comes).
    streams = [_Stream(server, 1000) for _ in range(4)]
    for stream in streams:
        stream.start()
        time.sleep(0.1)
    assert all(stream.started.wait(60) for stream in streams[:2])
    time.sleep(0.5)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}) as response:
        response.read()
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"]
        assert "busy" in response.json()["error"]["message"]
    started = time.monotonic()
    health = [httpx.get(f"{server.base_url}/health_generate", timeout=60) for _ in range(5)]
    assert all(h.status_code == 200 for h in health), [h.status_code for h in health]
    assert time.monotonic() - started < 5  # answered from recent output, no probe queued
    for stream in streams:   # each was admitted (its status is in); their 1,000 tokens are not needed
        stream.stop.set()
    for stream in streams:
        stream.join(120)
    assert [s.status for s in streams] == [200, 200, 200, 200]


def test_rid_in_use_is_a_400(server):
    first_chunk = threading.Event()
    done = threading.Event()   # set: disconnect (the rid's 1,000 tokens are not needed after the check)

    def hold_the_rid() -> None:   # streams long enough that the rid is still running when reused
        with httpx.stream("POST", f"{server.base_url}/generate", timeout=120, json={
                "text": "Once upon a time", "rid": "taken", "stream": True, "sampling_params": {
                    "max_new_tokens": 1000, "ignore_eos": True}}) as reply:
            for _ in reply.iter_lines():
                first_chunk.set()
                if done.is_set():
                    break
        first_chunk.set()

    stream = threading.Thread(target=hold_the_rid, daemon=True)
    stream.start()
    assert first_chunk.wait(60)
    response = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "rid": "taken", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "rid"
    done.set()
    stream.join(120)


def test_too_many_sequences_is_a_400(server):
    response = _complete(server, prompt=["a", "b", "c"], n=3)  # 9 > 8
    assert response.status_code == 400, response.text
    assert "--max-sequences-per-request" in response.json()["error"]["message"]
    native = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": ["a"] * 5, "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert native.status_code == 400, native.text
    assert _complete(server, prompt=["a"], n=2).status_code == 200  # under the cap (and the queue)
