"""The packaged draft pair, -m slow: Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B in float32.
Greedy tokens equal plain decoding's (a code prompt and free text, in one batch, one of them with
streaming-sized max_tokens cut inside a run), the drafts are mostly accepted on code, and the
draft pool is empty at the end."""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = ["Write a Python function `is_prime(n)`. Only the code.",
           "Write a short poem about the sea."]


def run(draft: str | None) -> tuple[list[list[int]], dict]:
    config = EngineConfig(model=ModelConfig(model=TARGET, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=4096),
                          speculative=SpeculativeConfig(speculative_draft_model_path=draft,
                                                        num_speculative_tokens=4))
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    params = [SamplingParams(temperature=0.0, max_tokens=80), SamplingParams(temperature=0.0, max_tokens=43)]
    for index, text in enumerate(PROMPTS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        assert engine.add_request(str(index), ids, params[index]) is None
    outputs = drain(engine)
    stats = engine.stats()
    engine.shutdown()
    return [outputs[str(i)] for i in range(len(PROMPTS))], stats


def test_draft_model_equals_plain_decoding():
    speculative, stats = run(DRAFT)
    plain, _ = run(None)
    assert speculative == plain
    assert stats["spec_accept_length"] > 2.0 and stats["spec_draft_used_blocks"] == 0, stats
