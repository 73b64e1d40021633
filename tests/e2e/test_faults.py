"""Faults on a live SmolLM2 server: the engine process dies or hangs, or the server is told to stop.

- Engine killed mid-run: in-flight requests get an error promptly, /health fails, the HTTP server
  exits with an error instead of hanging, and --crash-dump-folder holds the in-flight requests.
- --watchdog-timeout: a step slower than the timeout kills the engine loudly (same outcome).
- SIGTERM mid-run: in-flight requests finish, the server exits 0, and no child process is left.
- SIGKILL on the front end mid-run (no cleanup runs): the engine process dies with it.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from .server_process import ServerProcess

MODEL = "smollm2-135m"
ARGS = [MODEL, "--context-length", "512", "--max-total-tokens", "8192"]


def engine_process(server: ServerProcess) -> psutil.Process:
    children = psutil.Process(server.process.pid).children()
    return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))


class Stream(threading.Thread):
    """One streaming completion in a thread: its text, finish reason, error, and end time."""

    def __init__(self, server: ServerProcess, max_tokens: int, prompt: str = "Once upon a time") -> None:
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.url = f"{server.base_url}/v1/completions"
        self.first_chunk = threading.Event()
        self.num_chunks = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ended_s: float | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]["message"]
                        continue
                    self.num_chunks += 1
                    self.first_chunk.set()
                    self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.ended_s = time.monotonic()
            self.first_chunk.set()


def health_status(server: ServerProcess) -> int | None:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None  # the server has stopped listening


def test_engine_killed_mid_run(tmp_path):
    dump_folder = tmp_path / "crash"
    with ServerProcess([*ARGS, "--crash-dump-folder", str(dump_folder)]) as server:
        streams = [Stream(server, 400) for _ in range(3)]
        for stream in streams:
            stream.start()
        assert all(stream.first_chunk.wait(120) for stream in streams)
        killed_s = time.monotonic()
        engine_process(server).kill()
        for stream in streams:
            stream.join(30)
            assert not stream.is_alive(), "an in-flight request hung after the engine died"
            assert stream.error is not None and stream.finish_reason != "length"
            assert stream.ended_s - killed_s < 10, "in-flight requests were not failed promptly"
        assert health_status(server) in (503, None)
        assert server.process.wait(timeout=30) != 0  # exits, with an error status
        assert "engine process exited" in server.log()
    # --crash-dump-folder: the three in-flight requests, with their prompts, are in the dump.
    (dump,) = dump_folder.glob("crash_dump_*.json")
    body = json.loads(dump.read_text())
    assert "engine process exited" in body["reason"]
    in_flight = [r for r in body["requests"] if r["finish_reason"] is None]
    assert len(in_flight) == 3
    assert all(r["prompt_token_ids"] and r["sampling_params"]["max_tokens"] == 400 for r in in_flight)


def test_watchdog_kills_a_hung_step():
    # 1 ms is shorter than any real step: the first step trips the watchdog.
    with ServerProcess([*ARGS, "--watchdog-timeout", "0.001"]) as server:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 8})
        assert response.status_code == 500
        assert "engine" in response.json()["error"]["message"]
        assert server.process.wait(timeout=30) != 0
        log = server.log(tail_chars=None)  # the stack dump (one per thread) can be long
        assert "watchdog" in log and "exit code 70" in log


def test_sigterm_drains_in_flight_requests():
    # A long drain allowance: on a busy shared CPU, 3 x 16 tokens can take a while.
    with ServerProcess([*ARGS, "--shutdown-timeout-s", "300"]) as server:
        descendants = psutil.Process(server.process.pid).children(recursive=True)
        assert descendants, "the engine runs in a child process"
        streams = [Stream(server, 16, prompt) for prompt in ("Once upon a time", "def f(x):", "1, 2,")]
        for stream in streams:
            stream.start()
        assert all(stream.first_chunk.wait(120) for stream in streams)
        term_s = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it caught once it has shut down: -SIGTERM is a clean exit.
        assert server.process.wait(timeout=300) in (0, -signal.SIGTERM)
        drain_s = time.monotonic() - term_s
        for stream in streams:
            stream.join(5)
            assert stream.error is None and stream.finish_reason == "length"
            assert stream.num_chunks >= 16 - 1  # every token arrived (deltas may merge tokens)
        time.sleep(1.0)
        left = [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"child processes left after SIGTERM: {left}"
        print(f"SIGTERM drain time: {drain_s:.2f} s")


def test_sigkill_on_the_front_end_takes_the_engine_down():
    with ServerProcess(ARGS) as server:
        engine = engine_process(server)
        stream = Stream(server, 400)
        stream.start()
        assert stream.first_chunk.wait(120)
        server.process.kill()  # SIGKILL: no lifespan, no shutdown message, no atexit
        server.process.wait(timeout=10)
        killed_s = time.monotonic()
        try:
            engine.wait(timeout=10)
        except psutil.TimeoutExpired:
            engine.kill()
            pytest.fail("the engine process outlived its SIGKILLed front end by 10 s")
        print(f"engine gone {time.monotonic() - killed_s:.2f} s after the front end")
        stream.join(30)
