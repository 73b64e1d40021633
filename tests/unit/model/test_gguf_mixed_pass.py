"""Decode streams' results do not depend on a prompt chunk sharing their step: Gemma 3 270M on its
GGUF blocks (bf16 where the CPU has AVX512-BF16, and ``--dtype float32``), greedy streams' logprobs
bit for bit equal alone and with a prompt prefilled in one of their steps (a mixed pass; the forward
batch's ``rows``, gguf/gguf_routes.py):

- 86 tokens: the chunk's rows take the int8 GEMM and the KV projections' dense copy; with 16 streams
  the LM head's 17 rows are above the VNNI kernel's. A layer whose prepared call reaches the pass's
  rows (``RowsCopies``: the rows kernel's byte copy past a few rows, its bit-width copy below) computes
  the stream's row alone again where the pass's copy is not the one that row alone reads.
- 4 tokens with one stream: a 5-row pass, which the flat decode plan could take (its calls reach 8
  prompt rows) but for the copies its rows read (the byte copy from 5 rows): the module path takes it."""

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


@pytest.mark.parametrize(("dtype", "num_streams", "chunk_tokens"), [
    ("auto", 1, 86), ("auto", 1, 4),
    pytest.param("auto", 16, 86, marks=pytest.mark.slow),
    pytest.param("float32", 1, 86, marks=pytest.mark.slow),
    pytest.param("float32", 16, 86, marks=pytest.mark.slow)])
def test_decode_streams_are_the_same_with_a_prompt_in_their_pass(dtype: str, num_streams: int,
                                                                  chunk_tokens: int) -> None:
    engine = LLMEngine(EngineConfig.from_flat(dict(model="gemma3-270m", quantization="gguf", dtype=dtype,
                                                   num_threads=1, max_total_tokens=4096)))
    try:
        if engine.runner.model.lm_head.__dict__.get("gguf_weight") is None:
            pytest.skip("Gemma 3 270M is not served on its GGUF blocks here")
        words = ["The capital of France is", "def quicksort(items):", "Once upon a time", "import numpy as np\n"]
        prompts = [engine.tokenizer.encode(f"{words[index % 4]} {index}") for index in range(num_streams)]
        chunk = engine.tokenizer.encode("Write a long story about a dragon who learns to cook. " * 7)[:chunk_tokens]
        assert len(chunk) == chunk_tokens   # 86: all of it
        alone = decode(engine, prompts, None)
        assert decode(engine, prompts, chunk) == alone
    finally:
        engine.shutdown()


def test_a_prepared_call_computes_a_mixed_pass_generation_rows_as_alone() -> None:
    """A layer whose prepared call reaches a mixed pass's rows but reads another copy for them than
    for its generation rows alone (``RowsCopies``; which copy a row count reads is measured at start):
    those rows come out as a pass of only them gives them, bit for bit; the prompt rows keep the
    pass's copy."""
    import torch

    from servelm.model.gguf.gguf_linear import RowsCopies
    from servelm.model.gguf.gguf_routes import GENERATION_ONLY, PassRows

    engine = LLMEngine(EngineConfig.from_flat(dict(model="gemma3-270m", quantization="gguf", num_threads=1)))
    try:
        found = None
        for module in engine.runner.model.modules():
            decode = module.__dict__.get("gguf_decode_args")
            if not decode or not isinstance(decode[0], RowsCopies):
                continue
            found = next(((module, rows, generation) for generation in (1, 2)
                          for rows in range(generation + 2, decode.prompt_rows + 1)
                          if decode[0].by_rows[rows - 1] is not decode[0].by_rows[generation - 1]), None)
            if found is not None:
                break
        if found is None:
            pytest.skip("no layer here reads another copy of its weight for a mixed pass than for its generation rows")
        layer, rows, count = found
        method = layer.__dict__["linear_method"]
        torch.manual_seed(0)
        x = torch.randn(rows, layer.gguf_weight.shape[1]).to(layer.__dict__["gguf_decode_args"].dtype)
        generation = torch.tensor([0, rows - 1][:count])   # decode rows first and last
        is_generation = [index in generation.tolist() for index in range(rows)]
        out = method.apply(layer, x, None, PassRows.of([1] * rows, is_generation))
        assert torch.equal(out[generation], method.apply(layer, x[generation], None, GENERATION_ONLY))
        prompt = torch.tensor([index for index in range(rows) if not is_generation[index]])
        assert torch.equal(out[prompt], method.apply(layer, x, None, PassRows(rows, False))[prompt])
    finally:
        engine.shutdown()
