"""Start `servelm router` (or `serve --run_mode pd_master`) as a real subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .server_process import REPO, free_port


class RouterProcess:
    """A router in a subprocess, healthy (its /health answers) on entry; a context manager."""

    def __init__(self, args: list[str], command: tuple[str, ...] = ("router",),
                 startup_timeout_s: float = 120.0, program: list[str] | None = None) -> None:
        """``program``: the command before ``args`` (default: this python -m servelm COMMAND)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.program = program or [sys.executable, "-m", "servelm", *command]
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"servelm-router-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RouterProcess:
        command = [*self.program, *self.args,
                   "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"router did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def workers(self) -> dict[str, dict]:
        """url -> the router's view of that worker (GET /list_workers)."""
        listing = httpx.get(f"{self.base_url}/list_workers", timeout=10).json()
        return {w["url"]: w for w in listing["workers"]}

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
