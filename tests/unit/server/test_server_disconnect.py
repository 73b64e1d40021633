"""A client that goes away gets its engine requests aborted, streaming or not."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from server_fakes import FakeEngine, make_config

from servelm.server.app import build_app


class AsgiCall:
    """Drive the ASGI app directly so the test decides when the client disconnects."""

    def __init__(self, app: Any, path: str, body: dict[str, Any], spec_version: str) -> None:
        self.disconnect = asyncio.Event()
        self.chunks: list[bytes] = []
        self.status: int | None = None
        self._is_body_sent = False
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
                 "client": ("127.0.0.1", 5000), "server": ("test", 80), "state": {}}
        self.task = asyncio.create_task(app(scope, self._receive, self._send))
        self._body = json.dumps(body).encode()

    async def _receive(self) -> dict[str, Any]:
        if not self._is_body_sent:
            self._is_body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"])


async def _until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.anyio
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("n", [1, 2])  # one choice is read by the consumer's own task (no pump)
async def test_streaming_disconnect_aborts(tokenizer: Any, spec_version: str, n: int) -> None:
    engine = FakeEngine(tokenizer, hang_after=2)
    app = build_app(engine, make_config())
    call = AsgiCall(app, "/v1/completions", {"prompt": "x", "n": n, "stream": True, "max_tokens": 20},
                    spec_version)
    await _until(lambda: len(call.chunks) >= 2 * n)
    assert call.status == 200 and engine.aborted == []
    call.disconnect.set()
    await asyncio.wait_for(call.task, 5)
    await _until(lambda: len(engine.aborted) == n)
    assert sorted(engine.aborted) == sorted(r[0] for r in engine.requests)


@pytest.mark.anyio
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/generate", {"text": "x"}),
])
async def test_non_streaming_disconnect_aborts(tokenizer: Any, path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine(tokenizer, hang_after=1)
    app = build_app(engine, make_config())
    call = AsgiCall(app, path, body, "2.4")
    await _until(lambda: len(engine.requests) == 1)
    await asyncio.sleep(0.05)
    assert not call.task.done()
    call.disconnect.set()
    await asyncio.wait_for(call.task, 5)
    await _until(lambda: engine.aborted == [engine.requests[0][0]])


@pytest.mark.anyio
async def test_one_bad_request_does_not_disturb_another(tokenizer: Any) -> None:
    import httpx

    engine = FakeEngine(tokenizer)
    transport = httpx.ASGITransport(app=build_app(engine, make_config()))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        good = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30})
        bad = client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        good_response, bad_response = await asyncio.gather(good, bad)
    assert bad_response.status_code == 400
    assert good_response.json()["choices"][0]["text"] == "Hi there"
    assert engine.aborted == [] and len(engine.finished) == 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
