"""A live embedding server (all-MiniLM-L6-v2) driven by the openai client."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from .server_process import ServerProcess

MODEL = "all-minilm-l6-v2"
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]


@pytest.fixture(scope="module")
def server():
    with ServerProcess([MODEL, "--dtype", "float32", "--enable-metrics"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_strings_batch_and_meaning(server, client):
    """Parity with transformers is test_embeddings.py's; here: shape, usage and meaning."""
    response = client.embeddings.create(model=MODEL, input=SENTENCES + ["The stock market fell."])
    assert response.model == MODEL and [d.index for d in response.data] == [0, 1, 2]
    vectors = torch.tensor([item.embedding for item in response.data])
    assert vectors.shape == (3, 384)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    similar = float(F.cosine_similarity(vectors[0], vectors[1], dim=0))
    unrelated = float(F.cosine_similarity(vectors[0], vectors[2], dim=0))
    assert similar > 0.5 > unrelated, (similar, unrelated)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 3 * 3
    info = httpx.get(f"{server.base_url}/get_model_info").json()
    assert info["is_generation"] is False and info["pooler"]["pooling_type"] == "mean"
    assert httpx.get(f"{server.base_url}/health_generate").status_code == 200


def test_token_ids_and_base64(client):
    text = client.embeddings.create(model=MODEL, input="hello world").data[0].embedding
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    by_ids = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    assert by_ids == pytest.approx(text, abs=1e-6)
    batch = client.embeddings.create(model=MODEL, input=[ids, ids[:2]])
    assert batch.data[0].embedding == pytest.approx(text, abs=1e-6)
    raw = httpx.post(f"{client.base_url}embeddings",
                     json={"model": MODEL, "input": "hello world", "encoding_format": "base64"}).json()
    decoded = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(text, abs=1e-7)
    # The openai client asks for base64 by default and decodes it itself: same vector.
    assert client.embeddings.create(model=MODEL, input="hello world",
                                    encoding_format="base64").data[0].embedding is not None


def test_errors_in_openai_format(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input="hello", dimensions=128)
    assert "Matryoshka" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input="word " * 300)  # max_seq_length is 256
    assert error.value.body["code"] == "context_length_exceeded"
    long = client.embeddings.create(model=MODEL, input="word " * 300,
                                    extra_body={"truncate_prompt_tokens": 256})
    assert long.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "does not support" in str(error.value)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input="hello")


def test_too_many_inputs_is_a_400(server, client):
    """One input is one engine request: a list longer than --max-sequences-per-request (256 by
    default) is refused before anything is tokenized, on /v1/embeddings and /encode alike."""
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input=["a"] * 257)
    assert error.value.body["param"] == "input"
    assert "--max-sequences-per-request" in error.value.body["message"]
    ids = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                     json={"model": MODEL, "input": [[101, 102]] * 1000})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "input", ids.text
    native = httpx.post(f"{server.base_url}/encode", timeout=60, json={"text": ["a"] * 300})
    assert native.status_code == 400 and native.json()["error"]["param"] == "text", native.text
    assert len(client.embeddings.create(model=MODEL, input=["a"] * 4).data) == 4


def test_metrics_count_embedding_requests(server, client):
    def finished_and_prompt_tokens() -> tuple[float, float]:
        text = httpx.get(f"{server.base_url}/metrics").text
        values = {"finished": 0.0, "prompt": 0.0}
        for line in text.splitlines():
            if line.startswith("servelm:request_finished_total{") and 'finish_reason="stop"' in line:
                values["finished"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("servelm:prompt_tokens_total{"):
                values["prompt"] += float(line.rsplit(" ", 1)[1])
        return values["finished"], values["prompt"]

    finished, prompt = finished_and_prompt_tokens()
    ids = [101, 7592, 2088, 102]
    client.embeddings.create(model=MODEL, input=[ids, ids[:3]])
    assert finished_and_prompt_tokens() == (finished + 2, prompt + 7)
