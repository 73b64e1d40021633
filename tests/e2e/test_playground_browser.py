"""The playground in a real browser: Debian's chromium driven by playwright (never `playwright
install`), against a real server on SmolLM2-135M with an API key.

The test types a prompt and sees text stream in, stops a generation, edits a message, gets valid
JSON from JSON mode, hovers a token's probabilities in the completion tab, and writes the
screenshot the README shows (docs/playground.png). A second one attaches an image on a tiny
vision-language model.
"""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import pytest

from tests.tiny_models import TINY_VLM_IMAGE_TOKENS, make_tiny_vlm_dir, random_image, write_tiny_vlm_tokenizer

from .conftest import KEYED_API_KEY as API_KEY
from .server_process import REPO, ServerProcess

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


def test_playground_sends_an_attached_image_and_shows_it(browser, tmp_path) -> None:
    """Issue 32: on a tiny random vision-language model (tests/tiny_models.py), an image picked with
    the Image button shows in the attachment strip, goes to /v1/chat/completions as an image_url
    content part carrying the file's bytes, is shown in the user's message, and the server answers
    (200, its prompt counting the image tokens); a text-only reply to the same words counts fewer."""
    path = make_tiny_vlm_dir(tmp_path / "vlm")
    write_tiny_vlm_tokenizer(path)
    picture = tmp_path / "picture.png"
    random_image(3).save(picture, format="PNG")
    args = [str(path), "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "2048"]
    with ServerProcess(args) as vlm_server:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        bodies: list[dict] = []
        page.on("request", lambda request: bodies.append(json.loads(request.post_data))
                if request.url.endswith("/v1/chat/completions") else None)
        page.goto(f"{vlm_server.base_url}/")
        page.wait_for_function("document.getElementById('model-name').textContent.length > 0")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "4")
        page.set_input_files("#image-input", str(picture))
        page.wait_for_selector("#attachments:not([hidden]) img")
        with page.expect_response(lambda response: response.url.endswith("/v1/chat/completions")) as answer:
            _send(page, "What is in the picture?")
        assert answer.value.status == 200
        _wait_idle(page)
        shown = page.locator(".message.user img.attached")
        assert shown.count() == 1
        sent = base64.b64encode(picture.read_bytes()).decode()
        assert shown.first.get_attribute("src") == f"data:image/png;base64,{sent}"
        parts = bodies[-1]["messages"][-1]["content"]
        assert [part["type"] for part in parts] == ["image_url", "text"]
        assert parts[0]["image_url"]["url"] == f"data:image/png;base64,{sent}"
        assert page.locator("#attachments").is_hidden()   # sent: the strip is empty again
        usage = httpx.post(f"{vlm_server.base_url}/v1/chat/completions", timeout=60, json={
            **{k: v for k, v in bodies[-1].items() if k not in ("stream", "stream_options")},
            "stream": False}).json()["usage"]
        text_only = httpx.post(f"{vlm_server.base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is in the picture?"}], "max_tokens": 4}).json()["usage"]
        assert usage["prompt_tokens"] >= text_only["prompt_tokens"] + TINY_VLM_IMAGE_TOKENS
        assert page_errors == []
        page.close()
