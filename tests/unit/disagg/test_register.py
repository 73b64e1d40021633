"""LightLLM's --pd_master_ip/--pd_master_port: a prefill or decode server POSTs /register to the
master with its URL, mode and bootstrap port (the router's receiving end expects exactly this
shape); an unreachable master is a clear start-up error after the retries."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from servelm.config import DisaggregationConfig, EngineConfig, ServerConfig
from servelm.server import disagg
from tests.e2e.server_process import free_port


def config(master_port: int) -> EngineConfig:
    return EngineConfig(server=ServerConfig(host="127.0.0.1", port=30001),
                        disaggregation=DisaggregationConfig(
                            disaggregation_mode="decode", pd_master_ip="127.0.0.1",
                            pd_master_port=master_port))


def test_register_posts_url_mode_and_bootstrap_port() -> None:
    received: list[tuple[str, dict]] = []

    class Master(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Master)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        asyncio.run(disagg.register_with_master(config(server.server_address[1])))
    finally:
        server.shutdown()
    assert received == [("/register", {"url": "http://127.0.0.1:30001", "mode": "decode",
                                       "bootstrap_port": 8998})]


def test_unreachable_master_fails_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disagg, "REGISTER_RETRY_S", 0.5)
    port = free_port()
    with pytest.raises(RuntimeError, match=f"cannot register with the PD master at "
                                           f"http://127.0.0.1:{port}/register"):
        asyncio.run(disagg.register_with_master(config(port)))
