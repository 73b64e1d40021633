"""Images on every API surface, with a fake image processor and the scripted engine: chat
``image_url`` parts, the Responses API's ``input_image``, SGLang's ``image_data``, LightLLM's
``multimodal_params``, /tokenize; limits and refusals are OpenAI-shaped 400s; content lists reach
the chat template; usage counts image tokens."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_fakes import CHATML, MODEL_NAME, FakeEngine, make_config, sse_events

from servelm.config import parse_mm_limits
from servelm.disagg.spec import KVTransfer
from servelm.engine.outputs import RequestOutput
from servelm.multimodal.inputs import ImageItem, ImageSpan, MultimodalInputs
from servelm.sampling.params import SamplingParams
from servelm.server.app import build_app
from servelm.server.chat import message_dicts, resolve_content_format, template_iterates_content
from servelm.server.protocol import ChatMessage
from tests.unit.multimodal.image_samples import (SVG, data_url, image_server, png, png_header_only,
                                                 strip_png, truncated_png)

MARKER = "<image>"
PLACEHOLDER = 290
"""The fake processor's image token (inside FakeEngine's vocabulary of 300)."""
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


class FakeProcessor:
    """Replaces each ``<image>`` (its byte tokens) by (w/4) x (h/4) placeholder tokens; its text
    expansion only records the text (the ids are expanded in ``process``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.marker_ids = list(tokenizer.encode(MARKER, add_special_tokens=False))
        self.calls: list[tuple[list[int], list[ImageItem]]] = []
        self.texts: list[str] = []

    def marker_text(self) -> str:
        return MARKER

    def expand_text(self, text: str, images: list[ImageItem]) -> str:
        self.texts.append(text)
        return text

    def process(self, prompt_token_ids: list[int], images: list[ImageItem]) -> MultimodalInputs:
        self.calls.append((list(prompt_token_ids), list(images)))
        ids: list[int] = []
        spans: list[ImageSpan] = []
        position, found = 0, 0
        width = len(self.marker_ids)
        while position < len(prompt_token_ids):
            if prompt_token_ids[position:position + width] == self.marker_ids:
                if found >= len(images):
                    raise ValueError("more image markers than images")
                image = images[found].image
                length = (image.width // 4) * (image.height // 4)
                spans.append(ImageSpan(len(ids), length, images[found].digest))
                ids += [PLACEHOLDER] * length
                found += 1
                position += width
            else:
                ids.append(prompt_token_ids[position])
                position += 1
        if found != len(images):
            raise ValueError(f"{len(images)} images but {found} image markers")
        return MultimodalInputs(ids, spans)


@dataclass
class ImageEngine(FakeEngine):
    """FakeEngine that records the mm_inputs each request arrives with."""

    mm_inputs: list[MultimodalInputs | None] = field(default_factory=list)

    async def generate(self, request_id: str, prompt_token_ids: list[int],  # type: ignore[override]
                       params: SamplingParams, priority: int = 0, group: str = "",
                       lora_name: str | None = None, kv_transfer: KVTransfer | None = None,
                       mm_inputs: MultimodalInputs | None = None) -> AsyncIterator[RequestOutput]:
        self.mm_inputs.append(mm_inputs)
        async for output in super().generate(request_id, prompt_token_ids, params, priority,
                                             group, lora_name, kv_transfer):
            yield output


@pytest.fixture
def engine(tokenizer: Any) -> ImageEngine:
    return ImageEngine(tokenizer, context_length=2048)


def vlm_client(engine: ImageEngine, processor: Any = "fake", **server: Any) -> TestClient:
    multimodal = server.pop("multimodal", {})
    config = make_config(chat_template=server.pop("chat_template", VLM_TEMPLATE), **server)
    if multimodal:
        import dataclasses

        config = dataclasses.replace(config, multimodal=dataclasses.replace(config.multimodal,
                                                                            **multimodal))
    if processor == "fake":
        processor = FakeProcessor(engine.tokenizer)
    return TestClient(build_app(engine, config, image_processor=processor),
                      raise_server_exceptions=False)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(client: TestClient, *parts: dict[str, Any], text: str = "What is this?", **extra: Any) -> Any:
    content = [{"type": "text", "text": text}, *parts]
    return client.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
        "max_tokens": 16, **extra})


def error_of(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# -- chat ----------------------------------------------------------------------------------------

def test_chat_with_an_image(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    text_only = chat(client).json()["usage"]["prompt_tokens"]
    response = chat(client, image_part(data_url(png(16, 12))))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hi there"
    mm = engine.mm_inputs[-1]
    assert mm is not None and [(s.length) for s in mm.images] == [12]
    prompt = engine.requests[-1][1]
    assert prompt == mm.prompt_token_ids and prompt.count(PLACEHOLDER) == 12
    # the image sits after the text, where the template put it; the 7 marker tokens became 12
    assert response.json()["usage"]["prompt_tokens"] == text_only + 12
    assert prompt.index(PLACEHOLDER) == mm.images[0].offset
    text = engine.tokenizer.decode([t for t in prompt if t != PLACEHOLDER])
    assert "What is this?<|im_end|>" in text


def test_two_images_in_order_and_streaming_equals_non_streaming(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    first, second = data_url(png(8, 8, seed=1)), data_url(png(16, 8, seed=2))
    body = chat(client, image_part(first), {"type": "text", "text": "and"}, image_part(second))
    assert body.status_code == 200, body.text
    spans = engine.mm_inputs[-1].images  # type: ignore[union-attr]
    assert [s.length for s in spans] == [4, 8] and spans[0].digest != spans[1].digest
    streamed = chat(client, image_part(first), {"type": "text", "text": "and"}, image_part(second),
                    stream=True, stream_options={"include_usage": True})
    events = sse_events(streamed)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == body.json()["choices"][0]["message"]["content"]
    assert events[-1]["usage"] == body.json()["usage"]


def test_text_only_model_refuses_images(engine: ImageEngine) -> None:
    client = vlm_client(engine, processor=None, chat_template=CHATML)
    error = error_of(chat(client, image_part("data:image/png;base64,xx")))
    assert error["code"] == "model_not_multimodal" and "text-only" in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert client.get("/props").json()["modalities"] == {"vision": False, "audio": False}
    assert vlm_client(engine).get("/props").json()["modalities"]["vision"] is True
    off = vlm_client(engine, multimodal={"enable_multimodal": False})
    assert "--no-enable-multimodal" in error_of(chat(off, image_part(data_url(png())))).get("message")


def test_enable_multimodal_needs_a_vision_model(engine: ImageEngine) -> None:
    with pytest.raises(ValueError, match="takes no images"):
        vlm_client(engine, processor=None, multimodal={"enable_multimodal": True})
    with pytest.raises(ValueError, match="--mm-processor-kwargs"):
        vlm_client(engine, processor=None, multimodal={"mm_processor_kwargs": '{"a": 1}'})


@pytest.mark.parametrize("payload, code", [
    (lambda: png_header_only(20_000, 20_000), "image_too_large"),
    (lambda: strip_png(100_000), "invalid_image"),
    (truncated_png, "invalid_image"),
    (lambda: SVG, "unsupported_image_format"),
    (lambda: b"\x00\x01 not an image", "unsupported_image_format"),
], ids=["bomb", "strip", "truncated", "svg", "non-image"])
def test_hostile_images_are_400(engine: ImageEngine, payload: Any, code: str) -> None:
    error = error_of(chat(vlm_client(engine), image_part(data_url(payload()))))
    assert error["code"] == code and error["param"] == "messages[0].content[1]", error
    assert not engine.requests


def test_too_many_images(engine: ImageEngine) -> None:
    for limit in ('{"image": 1}', "image=1"):
        client = vlm_client(engine, multimodal={"limit_mm_per_prompt": limit})
        url = data_url(png(4, 4))
        assert chat(client, image_part(url)).status_code == 200
        error = error_of(chat(client, image_part(url), image_part(url)))
        assert error["code"] == "too_many_images" and "--limit-mm-per-prompt" in error["message"]
        assert error["param"] == "messages[0].content[2]"


def test_sources_outside_what_the_server_allows(engine: ImageEngine, tmp_path: Any) -> None:
    (tmp_path / "secret.png").write_bytes(png())
    allowed = tmp_path / "media"
    allowed.mkdir()
    client = vlm_client(engine, multimodal={"allowed_local_media_path": str(allowed)})
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png",
                "http://images.example.com/cat.png"):
        assert error_of(chat(client, image_part(url)))["code"] == "image_source_not_allowed", url
    (allowed / "ok.png").write_bytes(png())
    assert chat(client, image_part(f"file://{allowed}/ok.png")).status_code == 200


def test_http_image_from_an_allowed_domain(engine: ImageEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with image_server({"/cat.png": (200, {"Content-Type": "image/png"}, png(8, 12))}) as base:
        client = vlm_client(engine, multimodal={"allowed_media_domains": ["127.0.0.1"]})
        assert chat(client, image_part(f"{base}/cat.png")).status_code == 200
        assert engine.mm_inputs[-1].images[0].length == 6  # type: ignore[union-attr]
        error = error_of(chat(client, image_part(f"{base}/missing.png")))
        assert error["code"] == "image_fetch_failed" and "404" in error["message"]
        closed = vlm_client(engine)  # the default: no URL is fetched
        assert error_of(chat(closed, image_part(f"{base}/cat.png")))["code"] == "image_source_not_allowed"


def test_images_only_in_user_messages_and_other_media_refused(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [image_part(data_url(png()))]}]}
    assert "user messages only" in error_of(client.post("/v1/chat/completions", json=body))["message"]
    audio = {"type": "input_audio", "input_audio": {"data": "xx", "format": "wav"}}
    assert "text and images" in error_of(chat(client, audio))["message"]
    assert "image_url.url" in error_of(chat(client, {"type": "image_url"}))["message"]


def test_prompt_with_images_is_never_truncated(engine: ImageEngine) -> None:
    engine.context_length = 200
    client = vlm_client(engine, allow_auto_truncate=True)
    error = error_of(chat(client, image_part(data_url(png(64, 64))), max_tokens=4))
    assert error["code"] == "context_length_exceeded"


# -- content lists reach the template ------------------------------------------------------------

def _messages() -> list[ChatMessage]:
    return [ChatMessage(role="user", content=[{"type": "text", "text": "look"},
                                              image_part("data:x"), {"type": "text", "text": "!"}]),
            ChatMessage(role="assistant", content="ok")]


def test_content_lists_reach_the_template() -> None:
    dicts, images = message_dicts(_messages(), content_format="openai")
    assert dicts[0]["content"] == [{"type": "text", "text": "look"}, {"type": "image"},
                                   {"type": "text", "text": "!"}]
    assert dicts[1]["content"] == [{"type": "text", "text": "ok"}]
    assert [ref.param for ref in images] == ["messages[0].content[1]"]
    dicts, _ = message_dicts(_messages(), content_format="string", image_marker="<img>")
    assert dicts[0]["content"] == "look\n<img>\n!" and dicts[1]["content"] == "ok"


def test_auto_content_format_follows_the_template() -> None:
    assert template_iterates_content(VLM_TEMPLATE) and not template_iterates_content(CHATML)
    assert resolve_content_format("auto", VLM_TEMPLATE, True) == "openai"
    assert resolve_content_format("auto", VLM_TEMPLATE, False) == "string"  # text as before
    assert resolve_content_format("auto", CHATML, True) == "string"
    assert resolve_content_format("openai", CHATML, False) == "openai"


def test_string_format_puts_the_marker_in_a_plain_template(engine: ImageEngine) -> None:
    client = vlm_client(engine, chat_template=CHATML)
    assert chat(client, image_part(data_url(png(8, 8)))).status_code == 200
    assert engine.requests[-1][1].count(PLACEHOLDER) == 4


# -- other APIs ------------------------------------------------------------------------------------

def test_responses_input_image(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    body = {"model": MODEL_NAME, "max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "describe"},
        {"type": "input_image", "image_url": data_url(png(8, 8)), "detail": "auto"}]}]}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert engine.mm_inputs[-1] is not None and response.json()["usage"]["input_tokens"] == \
        len(engine.requests[-1][1])
    bad = {**body, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(SVG)}]}]}
    assert error_of(client.post("/v1/responses", json=bad))["param"] == "input[0].content[0]"
    text_only = vlm_client(engine, processor=None)
    error = error_of(text_only.post("/v1/responses", json=body))
    assert error["code"] == "model_not_multimodal" and error["param"] == "input[0].content[1]"


def test_sglang_generate_image_data(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    raw = base64.b64encode(png(8, 8)).decode()
    response = client.post("/generate", json={"text": f"see {MARKER} now", "image_data": raw,
                                               "sampling_params": {"max_new_tokens": 3}})
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["prompt_tokens"] == len("see  now") + 4
    batch = client.post("/generate", json={
        "text": [f"a {MARKER}", "plain", f"{MARKER}{MARKER}"],
        "image_data": [data_url(png(8, 8)), None, [raw, {"url": data_url(png(4, 8))}]],
        "sampling_params": {"max_new_tokens": 2}})
    assert batch.status_code == 200, batch.text
    spans = [None if mm is None else [s.length for s in mm.images] for mm in engine.mm_inputs[-3:]]
    assert sorted(spans, key=str) == sorted([[4], None, [4, 2]], key=str)
    mismatch = client.post("/generate", json={"text": "no marker", "image_data": raw})
    assert "image markers" in error_of(mismatch)["message"]


def test_lightllm_multimodal_params(engine: ImageEngine) -> None:
    client = vlm_client(engine, use_tgi_api=True)
    raw = base64.b64encode(png(8, 8)).decode()
    body = {"inputs": f"{MARKER} what?", "parameters": {"max_new_tokens": 3},
            "multimodal_params": {"images": [{"type": "base64", "data": raw}]}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert engine.mm_inputs[-1] is not None and engine.requests[-1][1].count(PLACEHOLDER) == 4
    audio = {**body, "multimodal_params": {"audios": [{"type": "base64", "data": raw}]}}
    assert error_of(client.post("/generate", json=audio))["param"] == "multimodal_params.audios"


def test_tokenize_counts_image_tokens(engine: ImageEngine) -> None:
    client = vlm_client(engine)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             image_part(data_url(png(8, 8)))]}]
    with_image = client.post("/tokenize", json={"messages": messages}).json()
    assert with_image["tokens"].count(PLACEHOLDER) == 4


def test_body_limit_takes_a_photo_sized_image(engine: ImageEngine) -> None:
    """The default body limit (32 MiB) holds a 12 MB image as base64 (16 MB)."""
    client = vlm_client(engine)
    padding = "A" * (16 * 1024 * 1024)
    response = client.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "max_tokens": 2, "padding": padding,
        "messages": [{"role": "user", "content": [image_part(data_url(png(8, 8)))]}]})
    assert response.status_code == 200, response.text


# -- flags ---------------------------------------------------------------------------------------

def test_limit_mm_per_prompt_syntax() -> None:
    assert parse_mm_limits('{"image": 2}') == {"image": 2} == parse_mm_limits("image=2")
    assert parse_mm_limits("image=3,video=0") == {"image": 3, "video": 0}
    for bad, words in (("video=1", "images only"), ("image=-1", "count"), ("pictures=1", "modality"),
                       ('{"image": 1.5}', "count"), ("image", "MODALITY=N")):
        with pytest.raises(ValueError, match=words):
            parse_mm_limits(bad)
