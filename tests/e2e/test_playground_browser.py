"""The playground in a real browser: Debian's chromium driven by playwright (never `playwright
install`), against a real server on SmolLM2-135M with an API key.

The test types a prompt and sees text stream in, stops a generation, edits a message, gets valid
JSON from JSON mode, hovers a token's probabilities in the completion tab, and writes the
screenshot the README shows (docs/playground.png).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import KEYED_API_KEY as API_KEY
from .server_process import REPO

SCREENSHOT = REPO / "docs" / "playground.png"
STREAM_TIMEOUT_MS = 120_000


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                   "(pip install -e '.[playground-test]')")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium); the playground browser test "
                    "needs it")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable,
                                             args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


def _wait_idle(page) -> None:
    page.wait_for_selector("#send:not([hidden])", timeout=STREAM_TIMEOUT_MS)


def _send(page, text: str) -> None:
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")


def test_playground_in_chromium(browser, server) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.goto(f"{server.base_url}/")

    # The server needs a key: the page's first API call gets 401 and the page asks for it.
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", API_KEY)
    page.click("#key-ok")
    page.wait_for_function("document.getElementById('model-name').textContent === 'smollm2-135m'")
    page.wait_for_function("/running \\d+ · queued \\d+ · KV \\d+% · cache hits \\d+%/"
                           ".test(document.getElementById('server-load').textContent)")

    # A long answer streams in; the Stop button ends it early.
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "400")
    _send(page, "Write a long story about a lighthouse keeper.")
    page.wait_for_function("(() => { const m = document.querySelector('.message.assistant.streaming "
                           ".content'); return m && m.dataset.raw.length > 20; })()",
                           timeout=STREAM_TIMEOUT_MS)
    page.click("#stop")
    _wait_idle(page)
    stopped = page.locator(".message.assistant").last
    assert stopped.locator(".note").text_content() == "stopped"
    assert len(stopped.locator(".content").get_attribute("data-raw")) > 20
    stats = stopped.locator(".stats").text_content()
    assert stats.startswith("TTFT ") and "tok/s" in stats

    # Edit the question: the history after it is replaced by a new answer.
    page.fill("#max-tokens", "24")
    page.locator(".message.user .edit").first.click()
    page.fill(".message.user textarea.editor", "What is the capital of France?")
    page.locator(".message.user .save").click()
    _wait_idle(page)
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .content").text_content() == "What is the capital of France?"
    answer = page.locator(".message.assistant .content").get_attribute("data-raw")
    assert answer and page.locator(".message.assistant .note").count() == 0

    # JSON mode: the reply is valid JSON (a grammar constrains it) and is shown as a code block.
    page.fill("#max-tokens", "128")
    page.select_option("#response-format", "json_object")
    _send(page, "Give me a JSON object describing a cat, with its name and age.")
    _wait_idle(page)
    reply = page.locator(".message.assistant").last
    assert isinstance(json.loads(reply.locator(".content").get_attribute("data-raw")), dict)
    assert reply.locator("pre code.language-json").count() == 1
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))

    # The completion tab: token spans with their probabilities on hover.
    page.click("#tab-completion")
    page.fill("#max-tokens", "8")
    page.click("#complete")
    page.wait_for_selector("#complete:not([hidden])", timeout=STREAM_TIMEOUT_MS)
    tokens = page.locator("#completion-output .tok")
    assert tokens.count() == 8
    tokens.first.hover()
    tooltip = page.locator("#tooltip")
    assert tooltip.is_visible() and "p = " in tooltip.text_content()
    assert page_errors == []
    page.close()
