"""/v1/embeddings and /encode against a scripted embedding engine, and task checks both ways."""

from __future__ import annotations

import base64
import dataclasses
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_fakes import MODEL_NAME, FakeEngine

from servelm.engine.frontdoor import ModelInfo
from servelm.engine.outputs import RequestOutput

SIZE = 4


def fake_vector(tokens: list[int]) -> list[float]:
    raw = [float(len(tokens)), float(sum(tokens) % 97), 1.0, float(tokens[0])]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


@dataclass
class FakeEmbeddingEngine(FakeEngine):
    """An engine serving task embed: the vector is a function of the token ids."""

    pooler: dict[str, Any] = field(default_factory=lambda: {
        "pooling_type": "mean", "normalize": True, "is_matryoshka": False,
        "matryoshka_dimensions": None})
    encoded: list[list[int]] = field(default_factory=list)

    @property
    def model_info(self) -> ModelInfo:
        return dataclasses.replace(super().model_info, task="embed", embedding_size=SIZE,
                                   pooler=self.pooler, max_embedding_tokens=32)

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        self.encoded.append(list(prompt_token_ids))
        if self.error is not None:
            return RequestOutput(request_id, [], "", finish_reason="error", error=self.error)
        return RequestOutput(request_id, [], "", finish_reason="stop",
                             num_prompt_tokens=len(prompt_token_ids),
                             embedding=fake_vector(prompt_token_ids))


@pytest.fixture
def embedder(tokenizer: Any) -> FakeEmbeddingEngine:
    return FakeEmbeddingEngine(tokenizer)


@pytest.fixture
def eclient(embedder: FakeEmbeddingEngine, make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(embedder)


def post(client: TestClient, body: dict[str, Any], path: str = "/v1/embeddings") -> Any:
    return client.post(path, json=body)


def test_string_list_and_token_inputs(eclient: TestClient, embedder: FakeEmbeddingEngine,
                                      tokenizer: Any) -> None:
    one = post(eclient, {"model": MODEL_NAME, "input": "hello"}).json()
    tokens = list(tokenizer.encode("hello"))
    assert one["object"] == "list" and one["model"] == MODEL_NAME
    assert one["data"] == [{"object": "embedding", "index": 0, "embedding": fake_vector(tokens)}]
    assert one["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
    batch = post(eclient, {"input": ["hello", "a longer input"]}).json()
    assert [d["index"] for d in batch["data"]] == [0, 1]
    assert batch["data"][0]["embedding"] == one["data"][0]["embedding"]
    ids = post(eclient, {"input": tokens}).json()
    assert ids["data"][0]["embedding"] == one["data"][0]["embedding"]
    many = post(eclient, {"input": [[1, 2, 3], [4]]}).json()
    assert [d["embedding"] for d in many["data"]] == [fake_vector([1, 2, 3]), fake_vector([4])]
    assert many["usage"]["prompt_tokens"] == 4


def test_base64_is_little_endian_float32(eclient: TestClient) -> None:
    floats = post(eclient, {"input": [5, 6, 7]}).json()["data"][0]["embedding"]
    encoded = post(eclient, {"input": [5, 6, 7], "encoding_format": "base64"}).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    decoded = struct.unpack(f"<{SIZE}f", raw)
    assert decoded == pytest.approx(floats, abs=1e-7)
    assert post(eclient, {"input": "x", "encoding_format": "int8"}).status_code == 400


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"), ({"input": [300]}, "input"), ({"input": [1] * 33}, "input"),
    ({"input": "x", "dimensions": 2}, "dimensions"),
    ({"input": [1, 2], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [1, 2], "truncate_prompt_tokens": 33}, "truncate_prompt_tokens"),
])
def test_bad_input_is_a_400_in_openai_format(eclient: TestClient, body: dict[str, Any],
                                             param: str) -> None:
    response = post(eclient, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if body.get("dimensions"):
        assert "Matryoshka" in error["message"]


def test_full_dimensions_and_truncation(eclient: TestClient, embedder: FakeEmbeddingEngine) -> None:
    assert post(eclient, {"input": [1, 2], "dimensions": SIZE}).status_code == 200
    long_input = list(range(1, 41))
    response = post(eclient, {"input": long_input, "truncate_prompt_tokens": 8}).json()
    assert embedder.encoded[-1] == long_input[-8:] and response["usage"]["prompt_tokens"] == 8
    post(eclient, {"input": long_input, "truncate_prompt_tokens": -1})
    assert embedder.encoded[-1] == long_input[-32:]


def test_matryoshka_dimensions_when_the_pooler_allows(tokenizer: Any,
                                                      make_client: Callable[..., TestClient]) -> None:
    engine = FakeEmbeddingEngine(tokenizer)
    engine.pooler = {**engine.pooler, "is_matryoshka": True, "matryoshka_dimensions": [2]}
    client = make_client(engine)
    vector = post(client, {"input": [3, 4], "dimensions": 2}).json()["data"][0]["embedding"]
    full = fake_vector([3, 4])[:2]
    norm = math.sqrt(sum(x * x for x in full))
    assert vector == pytest.approx([x / norm for x in full])
    assert post(client, {"input": [3, 4], "dimensions": 3}).status_code == 400


def test_wrong_model_and_engine_error(eclient: TestClient, embedder: FakeEmbeddingEngine) -> None:
    assert post(eclient, {"model": "other", "input": "x"}).status_code == 404
    embedder.error = "forward pass failed: boom"
    response = post(eclient, {"input": "x"})
    assert response.status_code == 500 and "boom" in response.json()["error"]["message"]


def test_generation_routes_refused_on_an_embedding_server(eclient: TestClient) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/generate", {"text": "hi"})):
        response = eclient.post(path, json=body)
        assert response.status_code == 400, path
        assert "does not support" in response.json()["error"]["message"]


def test_embeddings_refused_on_a_generation_server(client: TestClient) -> None:
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})):
        response = client.post(path, json=body)
        assert response.status_code == 400
        assert "--task embed" in response.json()["error"]["message"]


def test_native_encode(eclient: TestClient, tokenizer: Any) -> None:
    single = post(eclient, {"text": "hello"}, "/encode").json()
    assert single["embedding"] == fake_vector(list(tokenizer.encode("hello")))
    assert single["meta_info"]["prompt_tokens"] == len(tokenizer.encode("hello"))
    batch = post(eclient, {"input_ids": [[1, 2], [3]], "rid": ["a", "b"]}, "/encode").json()
    assert [item["meta_info"]["id"] for item in batch] == ["a", "b"]
    assert batch[1]["embedding"] == fake_vector([3])
    assert post(eclient, {}, "/encode").status_code == 400
