"""Start `servelm serve` as a real subprocess on 127.0.0.1 and wait until it is healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A servelm server in a subprocess; use as a context manager."""

    def __init__(self, args: list[str], startup_timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"servelm-test-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        command = [sys.executable, "-m", "servelm", "serve", *self.args,
                   "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server did not become healthy:\n{self.log()}")

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
