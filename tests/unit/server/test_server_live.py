"""run_server end to end on 127.0.0.1 with the fake engine: uvicorn, lifespan, openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests_dir!r})
    from pathlib import Path
    from server_fakes import CHATML, FakeEngine, build_tokenizer, make_config
    from servelm.engine import async_engine
    from servelm.server.app import run_server

    marker = Path({marker!r})

    class LiveFake(FakeEngine):
        def hang_after_for(self, prompt_token_ids):  # the prompt "hang" never finishes
            return 2 if self.tokenizer.decode(prompt_token_ids) == "hang" else None

        async def shutdown(self):
            marker.write_text("aborted=" + ",".join(self.aborted))

    async def start(cls, config, launch=None):
        marker.write_text("started")
        return LiveFake(build_tokenizer(Path({tok_dir!r}), CHATML), )

    async_engine.AsyncEngine.start = classmethod(start)
    async_engine.AsyncEngine.check_model = staticmethod(lambda config: None)  # no model on disk
    run_server(make_config(port={port}, log_level="warning"))
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    port, marker = _free_port(), tmp_path / "marker"
    code = _CHILD.format(tests_dir=str(Path(__file__).parent), marker=str(marker),
                         tok_dir=str(tmp_path / "tok"), port=port)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base, marker
        except httpx.HTTPError:
            pass
        assert process.poll() is None, "server exited during start-up"
        time.sleep(0.2)
    process.kill()
    raise AssertionError("server did not become healthy")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0


def test_live_server(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    process, base, marker = _start(tmp_path)
    try:
        assert marker.read_text() == "started"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["tiny-model"]
        completion = client.completions.create(model="tiny-model", prompt="x", max_tokens=30)
        assert completion.choices[0].text == "Hi there"
        stream = client.completions.create(model="tiny-model", prompt="x", max_tokens=30, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == "Hi there"
        chat = client.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "x"}])
        assert chat.choices[0].message.content == "Hi there" and chat.usage.completion_tokens == 9
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-model", prompt="x", temperature=-1)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x")
        # A client that leaves mid-stream, and one that times out waiting, are both aborted.
        with httpx.stream("POST", f"{base}/v1/completions",
                          json={"prompt": "hang", "stream": True, "max_tokens": 20}, timeout=10) as response:
            assert next(response.iter_lines()).startswith("data: ")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json={"prompt": "hang", "max_tokens": 20}, timeout=0.5)
        time.sleep(0.5)
    finally:
        _stop(process)
    aborted = marker.read_text().removeprefix("aborted=").split(",")
    assert len(aborted) == 2 and all(rid.startswith("cmpl-") for rid in aborted)
