"""Start `servelm serve` as a real subprocess on 127.0.0.1 and wait until it is healthy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A servelm server in a subprocess; use as a context manager."""

    kind = "server"

    def __init__(self, args: list[str], startup_timeout_s: float = 600.0,
                 program: list[str] | None = None, warm_up: bool = False) -> None:
        """``program``: the command before ``args`` (default: this python's ``-m servelm serve``).

        ``warm_up``: keep the start-up warm-up. Off by default: it costs 2-13 s per start on a
        2-core CI box (over 100 starts in the default run) and changes no token; its own tests
        (tests/unit/engine/test_warmup.py, tests/e2e/test_warmup_live.py) ask for it."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        if not warm_up and program is None and "--skip-server-warmup" not in args:
            args = [*args, "--skip-server-warmup"]
        self.args = args
        self.program = program or [sys.executable, "-m", "servelm", "serve"]
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"servelm-{self.kind}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        command = [*self.program, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        # one client for every probe: a top-level httpx.get builds a TLS context (CA bundle) per
        # call, ~20-35 ms of CPU taken from the starting server on a 2-core box
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.kind} exited with {self.process.returncode}:\n{self.log()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.__exit__(None, None, None)
        raise TimeoutError(f"{self.kind} did not become healthy:\n{self.log()}")

    def log(self, tail_chars: int | None = 5000) -> str:
        """The server's output: its last ``tail_chars`` characters (None: all of it)."""
        text = self.log_path.read_text(errors="replace")
        return text if tail_chars is None else text[-tail_chars:]

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()



@contextlib.contextmanager
def running_together(*servers: ServerProcess) -> Iterator[tuple[ServerProcess, ...]]:
    """Start ``servers`` at once and stop them all on the way out (also when one fails to start).
    A start-up is mostly one core's imports and model load, so on a 2-core CI box two starts side
    by side take little longer than one."""
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.__exit__, None, None, None)
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(server.__enter__) for server in servers]
        for future in futures:
            future.result()  # the first start-up error, after every start has ended
        yield servers

def is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stream_and_kill(base_url: str, body: dict[str, Any], pid: int, after_events: int = 3) -> list[dict[str, Any]]:
    """Stream ``body`` from /generate and SIGKILL ``pid`` once ``after_events`` events arrived;
    every event the stream delivered (the last one is the error the kill caused)."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base_url}/generate", timeout=60, json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data:")))
            if len(events) == after_events:
                os.kill(pid, signal.SIGKILL)
    return events


def wait_until_gone(pids: list[int], timeout_s: float = 10) -> bool:
    """Wait until none of ``pids`` runs; False if one still does after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(is_running(pid) for pid in pids)


def check_killed_rank_ends_the_server(model: str, parallel_flags: list[str], message: str,
                                      log_words: str) -> None:
    """The rank-kill test of every multi-process layout on one node (tensor, pipeline): a server
    on ``model`` with ``parallel_flags`` streams from /generate while its rank 1 is SIGKILLed; the
    stream's last event is the error ``message`` (``{pid}`` is rank 1's pid), the server exits
    non-zero with ``log_words`` in its log, and neither the engine nor the rank is left."""
    with ServerProcess([model, *parallel_flags, *KILL_TEST_FLAGS, "--skip-tokenizer-init",
                        "--max-total-tokens", "4096"]) as server:
        check_killing_rank_1_ends(server, message, log_words)


KILL_TEST_FLAGS = ("--num-threads", "1", "--dtype", "float32", "--omp-wait-policy", "passive")
"""What ``check_killing_rank_1_ends`` needs of a server besides its layout (it checks the policy)."""


def check_killing_rank_1_ends(server: ServerProcess, message: str, log_words: str) -> None:
    """``check_killed_rank_ends_the_server`` on a running ``server`` (started with
    ``KILL_TEST_FLAGS``), which this ends."""
    ranks = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["parallel"]["ranks"]
    engine_pid, rank_pid = ranks[0]["pid"], ranks[1]["pid"]
    assert is_running(engine_pid) and is_running(rank_pid)
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")   # the user's export wins
    for pid in (engine_pid, rank_pid):
        environment = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert f"OMP_WAIT_POLICY={wait_policy}" in environment.split("\0")
    events = stream_and_kill(server.base_url, {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, rank_pid)
    assert 3 < len(events) < 400
    assert events[-1]["error"]["message"] == message.format(pid=rank_pid)
    assert server.process is not None
    server.process.wait(timeout=30)
    assert server.process.returncode != 0
    assert wait_until_gone([engine_pid, rank_pid])
    assert log_words in server.log()
