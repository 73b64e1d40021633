"""Start `servelm router` (or `serve --run_mode pd_master`) as a real subprocess on 127.0.0.1."""

from __future__ import annotations

import sys

import httpx

from .server_process import ServerProcess


class RouterProcess(ServerProcess):
    """A router in a subprocess, healthy (its /health answers) on entry; a context manager."""

    kind = "router"

    def __init__(self, args: list[str], command: tuple[str, ...] = ("router",),
                 startup_timeout_s: float = 120.0, program: list[str] | None = None) -> None:
        """``program``: the command before ``args`` (default: this python -m servelm COMMAND)."""
        super().__init__(args, startup_timeout_s, program or [sys.executable, "-m", "servelm", *command])

    def workers(self) -> dict[str, dict]:
        """url -> the router's view of that worker (GET /list_workers)."""
        listing = httpx.get(f"{self.base_url}/list_workers", timeout=10).json()
        return {w["url"]: w for w in listing["workers"]}
