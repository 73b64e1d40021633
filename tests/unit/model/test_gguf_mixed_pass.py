"""A decode stream's results do not depend on a prompt chunk sharing its step: Gemma 3 270M on its
GGUF blocks (bf16 where the CPU has AVX512-BF16, and ``--dtype float32``), one greedy stream's
logprobs bit for bit equal alone and with a 70-token prompt prefilled in one of its steps (a mixed
pass: the chunk's rows take the int8 GEMM, the KV projections' dense copy; gguf_linear.prompt_rows)."""

from __future__ import annotations

import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def decode(engine: LLMEngine, prompt: list[int], chunk: list[int] | None) -> tuple[list[int], list[float]]:
    """Request "a"'s 12 greedy tokens and their logprobs; ``chunk``: a request added after a's third
    step, so its prompt is prefilled in the same pass as one of a's decode rows."""
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    tokens: list[int] = []
    logprobs: list[float] = []
    steps = 0
    while engine.has_unfinished():
        if chunk is not None and steps == 3:
            engine.add_request("b", chunk, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        for output in engine.step():
            if output.request_id == "a":
                assert output.logprobs is not None
                tokens += output.new_token_ids
                logprobs += [entry.logprob for entry in output.logprobs]
        steps += 1
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_decode_stream_is_the_same_with_a_prompt_in_its_pass(dtype: str) -> None:
    engine = LLMEngine(EngineConfig.from_flat(dict(model="gemma3-270m", quantization="gguf", dtype=dtype,
                                                   num_threads=1, max_total_tokens=4096)))
    try:
        runner = engine.runner
        if runner.model.lm_head.__dict__.get("gguf_weight") is None:
            pytest.skip("Gemma 3 270M is not served on its GGUF blocks here")
        prompt = engine.tokenizer.encode("The capital of France is")
        chunk = engine.tokenizer.encode("Write a long story about a dragon who learns to cook. " * 7)
        assert len(chunk) >= 60
        alone = decode(engine, prompt, None)
        assert decode(engine, prompt, chunk) == alone
    finally:
        engine.shutdown()
