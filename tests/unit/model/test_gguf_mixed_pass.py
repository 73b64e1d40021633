"""Decode streams' results do not depend on a prompt chunk sharing their step: Gemma 3 270M on its
GGUF blocks (bf16 where the CPU has AVX512-BF16, and ``--dtype float32``), greedy streams' logprobs
bit for bit equal alone and with a 70-token prompt prefilled in one of their steps (a mixed pass: the
chunk's rows take the int8 GEMM and the KV projections' dense copy; with 16 streams the LM head's 17
rows are above the VNNI kernel's; the forward batch's ``rows``, gguf/gguf_routes.py)."""

from __future__ import annotations

import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def decode(engine: LLMEngine, prompts: list[list[int]], chunk: list[int] | None
           ) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt's 12 greedy tokens and their logprobs; ``chunk``: a request added after the third
    step, so its prompt is prefilled in the same pass as the streams' decode rows (one token: no
    decode row of its own changes the streams' batch size after that pass)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    results: dict[str, tuple[list[int], list[float]]] = {str(index): ([], []) for index in range(len(prompts))}
    steps = 0
    while engine.has_unfinished():
        if chunk is not None and steps == 3:
            engine.add_request("chunk", chunk, SamplingParams(temperature=0.0, max_tokens=1))
        for output in engine.step():
            if output.request_id != "chunk":
                assert output.logprobs is not None
                results[output.request_id][0].extend(output.new_token_ids)
                results[output.request_id][1].extend(entry.logprob for entry in output.logprobs)
        steps += 1
    return results


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("num_streams", [1, 16])
def test_decode_streams_are_the_same_with_a_prompt_in_their_pass(dtype: str, num_streams: int) -> None:
    engine = LLMEngine(EngineConfig.from_flat(dict(model="gemma3-270m", quantization="gguf", dtype=dtype,
                                                   num_threads=1, max_total_tokens=4096)))
    try:
        if engine.runner.model.lm_head.__dict__.get("gguf_weight") is None:
            pytest.skip("Gemma 3 270M is not served on its GGUF blocks here")
        words = ["The capital of France is", "def quicksort(items):", "Once upon a time", "import numpy as np\n"]
        prompts = [engine.tokenizer.encode(f"{words[index % 4]} {index}") for index in range(num_streams)]
        chunk = engine.tokenizer.encode("Write a long story about a dragon who learns to cook. " * 7)
        assert len(chunk) >= 60
        alone = decode(engine, prompts, None)
        assert decode(engine, prompts, chunk) == alone
    finally:
        engine.shutdown()
