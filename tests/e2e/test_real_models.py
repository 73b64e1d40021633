"""Greedy parity on the packaged real models: our engine vs transformers from the same GGUF.

SmolLM2-135M runs in the default suite; the bigger models are marked slow (`pytest -m slow`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import greedy
from tests.reference import load_reference_model, transformers_greedy

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Here is a short poem about the sea:\n",
]
NUM_NEW_TOKENS = 32


def packaged_path(name: str) -> Path:
    from servelm.model.packaged import packaged_model_path

    return Path(packaged_model_path(name))


def check_parity(name: str) -> None:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=name, dtype="float32"),
        cache=CacheConfig(max_total_tokens=4096),
    ))
    token_lists = [engine.tokenizer.encode(prompt) for prompt in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ours = greedy(engine, token_lists, params)
    gguf = packaged_path(name)
    reference = transformers_greedy(load_reference_model(gguf.parent, gguf.name), token_lists,
                                    NUM_NEW_TOKENS)
    for index, expected in enumerate(reference):
        assert ours[index] == expected, (
            f"{name} prompt {index}: {engine.tokenizer.decode(ours[index])!r} != "
            f"{engine.tokenizer.decode(expected)!r}")


def test_smollm2_greedy_matches_transformers():
    check_parity("smollm2-135m")


@pytest.mark.slow
def test_qwen_coder_05b_greedy_matches_transformers():
    check_parity("qwen2.5-coder-0.5b")


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers():
    check_parity("gemma3-270m")
