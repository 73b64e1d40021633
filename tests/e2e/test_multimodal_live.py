"""A live server on the tiny random Gemma 3 VLM (SigLIP tower, a real byte-level tokenizer and a
chat template that walks content lists), driven by the openai client with a base64 PNG: greedy
tokens equal transformers' own Gemma3Processor + Gemma3ForConditionalGeneration on the same
messages; streaming equals non-streaming; usage counts the image tokens; the same image again hits
the prefix cache; a truncated PNG is a 400 and the server keeps serving."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")

from tests.tiny_models import (TINY_VLM_IMAGE, TINY_VLM_IMAGE_SIZE, TINY_VLM_IMAGE_TOKENS,  # noqa: E402
                               make_tiny_vlm_dir, random_image, write_tiny_vlm_tokenizer)

from .server_process import ServerProcess  # noqa: E402

MAX_TOKENS = 6


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _messages(png: bytes, text: str) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _reference(path: Path, image: Any, text: str) -> tuple[list[int], str]:
    """transformers' greedy tokens (and prompt length) for the same conversation."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": TINY_VLM_IMAGE_SIZE, "width": TINY_VLM_IMAGE_SIZE}),
        tokenizer=tokenizer, image_seq_length=TINY_VLM_IMAGE_TOKENS)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    model = Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = inputs["input_ids"][0].tolist()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            batch = torch.tensor([ids + out])
            logits = model(input_ids=batch, pixel_values=inputs["pixel_values"],
                           token_type_ids=(batch == TINY_VLM_IMAGE).long()).logits[0, -1]
            out.append(int(logits.argmax()))
    return out, len(ids)


def test_openai_chat_with_a_base64_png_equals_transformers(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    path = make_tiny_vlm_dir(tmp_path)
    write_tiny_vlm_tokenizer(path)
    image, text = random_image(7), "What is in the picture?"
    png = _png(image)
    expected, prompt_len = _reference(path, image, text)
    args = [str(path), "--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "2048", "--enable-cache-report"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        kwargs = dict(model=str(path), messages=_messages(png, text), max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})
        first = client.chat.completions.create(**kwargs)
        text_out = first.choices[0].message.content
        assert first.usage.prompt_tokens == prompt_len     # the 16 image tokens and their frame included
        stream = client.chat.completions.create(**kwargs, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text_out
        again = client.chat.completions.create(**kwargs)
        assert again.choices[0].message.content == text_out
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens > TINY_VLM_IMAGE_TOKENS   # past the image
        assert text_out == _decode(path, expected)

        truncated = png[: len(png) // 2]
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{**kwargs, "messages": _messages(truncated, text)})
        assert "image" in str(error.value)
        assert client.chat.completions.create(**kwargs).choices[0].message.content == text_out


def _decode(path: Path, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).decode(token_ids, skip_special_tokens=True)
