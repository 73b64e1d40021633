"""Greedy parity on the packaged real models: our engine vs transformers from the same GGUF.

SmolLM2-135M runs in the default suite; the bigger models are marked slow (`pytest -m slow`).
"""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.engine.engine import LLMEngine
from tests.engine_drive import greedy_logprobs, reference_greedy, reference_logprobs
from tests.reference import packaged_reference_model, transformers_greedy

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Here is a short poem about the sea:\n",
]
NUM_NEW_TOKENS = 32


FLOAT32 = {"dtype": "float32", "max_total_tokens": 4096}
"""The float32 reference engine's flags (engine_drive memoizes its run by them)."""


def float32_greedy(name: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy tokens) of ``name``'s float32 engine on PROMPTS: one engine per run,
    shared by the transformers parity and the GGUF-blocks agreement below (engine_drive memoizes)."""
    return reference_greedy(PROMPTS, NUM_NEW_TOKENS, model=name, **FLOAT32)


def check_parity(name: str) -> None:
    token_lists, ours = float32_greedy(name)
    reference = transformers_greedy(packaged_reference_model(name), token_lists, NUM_NEW_TOKENS)
    for index, expected in enumerate(reference):
        assert ours[index] == expected, f"{name} prompt {index}: {ours[index]} != {expected}"


def test_smollm2_greedy_matches_transformers():
    check_parity("smollm2-135m")


@pytest.mark.slow
def test_qwen_coder_05b_greedy_matches_transformers():
    check_parity("qwen2.5-coder-0.5b")


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers():
    check_parity("gemma3-270m")


GGUF_LOGPROB_TOLERANCE = 0.3
"""How far the GGUF default's logprob of a token may be from the float32 model's (nats): both run the
file's own weights and differ only in summation order and activation rounding (bf16 on a CPU with a
native bf16 GEMM, int8 rows where the measured prompt route is the int8 GEMM). Measured: at most 0.11
over the 3 x 32 tokens (AMD Zen 5, AVX512-BF16)."""


def test_smollm2_gguf_blocks_agree_with_float32():
    """The default for a GGUF file (``--quantization auto`` -> ``gguf``: the file's own Q4_1/Q8_0
    blocks, float activations) against the float32 dequantized model (``--dtype float32``, which is
    transformers' parity above). The two compute with the same weights in another order, so their
    logprobs are close and greedy tokens may part only where the float32 model's top two were close:
    up to each output's first differing token every logprob is within GGUF_LOGPROB_TOLERANCE, and
    at that token the float32 margin between its top two is within twice the tolerance (a choice
    that both logprobs moving by the tolerance can flip). Which tokens are such near-ties depends on
    the CPU's routes: an exact-prefix count held on one CPU and failed on another."""
    token_lists, reference = float32_greedy("smollm2-135m")
    reference_values = reference_logprobs(PROMPTS, NUM_NEW_TOKENS, model="smollm2-135m", **FLOAT32)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="smollm2-135m"),
                                    cache=CacheConfig(max_total_tokens=4096)))
    try:
        assert [engine.tokenizer.encode(p) for p in PROMPTS] == token_lists
        ours, our_values = greedy_logprobs(engine, token_lists, NUM_NEW_TOKENS, num_top=1)
        quantization = engine.runner.quantization
    finally:
        engine.shutdown()
    assert quantization == "gguf"
    for index, (got, expected) in enumerate(zip(ours, reference, strict=True)):
        same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))
        drift = (our_values[index][:same, 0] - reference_values[index][:same, 0]).abs().max().item()
        assert drift <= GGUF_LOGPROB_TOLERANCE, (index, drift)
        if same < len(expected):
            margin = (reference_values[index][same, 1] - reference_values[index][same, 2]).item()
            assert margin <= 2 * GGUF_LOGPROB_TOLERANCE, (index, same, margin, got, expected)
