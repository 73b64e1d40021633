"""N-gram speculation on the default real model (Qwen2.5-Coder-0.5B, float32), -m slow: greedy
tokens equal plain decoding's on an edit prompt (long accepted runs) and on free text (few
drafts), in one batch, and sampled tokens with a seed equal too."""

from __future__ import annotations

import pytest

from servelm.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig)
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def spread(values):
    low = min(values)
    high = max(values)
    return high - low
'''
PROMPTS = [f"Rename `values` to `numbers` in this code and return the whole code:\n```python\n{CODE}```",
           "Write a short poem about the sea."]


def run(algorithm: str | None) -> tuple[list[list[int]], dict]:
    config = EngineConfig(model=ModelConfig(model=DEFAULT_MODEL, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=8192),
                          speculative=SpeculativeConfig(speculative_algorithm=algorithm))
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    params = [SamplingParams(temperature=0.0, max_tokens=120),
              SamplingParams(temperature=0.0, max_tokens=60),
              SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=60)]
    for index, text in enumerate(PROMPTS + PROMPTS[:1]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        assert engine.add_request(str(index), ids, params[index]) is None
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [outputs[str(i)] for i in range(3)], engine.stats()


def test_ngram_equals_plain_decoding_on_the_default_model():
    plain, _ = run(None)
    speculative, stats = run("NGRAM")
    assert speculative == plain
    assert stats["spec_accept_length"] > 2.0, stats
