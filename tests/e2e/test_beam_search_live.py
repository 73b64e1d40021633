"""Beam search over HTTP: /v1/completions with vLLM's use_beam_search on a real server.

The n choices are the n best beams of transformers' beam search on the same weights, best first;
what beam search cannot honour (streaming, sampling, best_of < n) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OPS_MODEL
from tests.reference import packaged_reference_model, packaged_reference_tokenizer, transformers_beams

MODEL = OPS_MODEL  # beams come from the shared operations server (float32)
PROMPT = "The best way to learn a language is"


@pytest.fixture(scope="module")
def server(ops_server: Any) -> Any:
    """The shared operations server: beam search needs no flag of its own, so no server of its own."""
    return ops_server


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model of the same GGUF (shared by the session's tests)."""
    from servelm.model.packaged import PackagedModelError

    try:
        return packaged_reference_tokenizer(MODEL), packaged_reference_model(MODEL)
    except PackagedModelError as error:
        pytest.skip(str(error))


def test_completions_with_use_beam_search_match_transformers(server: Any,
                                                            reference: tuple[Any, Any]) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "n": 2, "best_of": 3,
            "use_beam_search": True, "length_penalty": 0.8}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2

    tokenizer, model = reference
    prompt = tokenizer.encode(PROMPT)
    eos = [model.config.eos_token_id] if isinstance(model.config.eos_token_id, int) else list(
        model.config.eos_token_id or [])
    beams = transformers_beams(model, prompt, 3, 10, eos, length_penalty=0.8)[:2]
    assert [c["text"] for c in choices] == [tokenizer.decode(tokens, skip_special_tokens=True)
                                           for tokens, _ in beams]
    assert response.json()["usage"]["completion_tokens"] == sum(len(t) for t, _ in beams)


@pytest.mark.parametrize("extra,field", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.8}, "temperature"),
    ({"n": 3, "best_of": 2}, "n"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_a_400(server: Any, extra: dict[str, Any], field: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_chat_and_stop_strings_with_beams(server: Any) -> None:
    """Chat completions take use_beam_search too; a stop string ends a beam (and is cut off)."""
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        "n": 2, "use_beam_search": True})
    assert chat.status_code == 200, chat.text
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "n": 2, "use_beam_search": True}
    plain = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300).json()
    best = plain["choices"][0]["text"]
    word = best.split()[1]
    stopped = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stop": [word]},
                         timeout=300).json()["choices"]
    assert all(word not in c["text"] for c in stopped)
    assert stopped[0]["finish_reason"] == "stop" and stopped[0]["stop_reason"] == word
