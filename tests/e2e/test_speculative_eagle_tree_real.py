"""EAGLE trees on the default real model (Qwen2.5-Coder-0.5B, float32), -m slow, with a
random-weight EAGLE head in the published format (no trained head exists offline: mechanics
only): greedy tokens equal plain decoding's for a tree of 8 drafts (topk 4, 3 steps), and seeded
sampling equals plain seeded sampling (a tree's drafts are point masses, each row sampled with
its output position's seeded stream)."""

from __future__ import annotations

import pytest

from servelm.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.model.eagle_checkpoint import main as write_head
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain

from .test_speculative_real import PROMPTS

pytestmark = pytest.mark.slow


def run(head: str | None) -> tuple[list[list[int]], dict]:
    speculative = SpeculativeConfig() if head is None else SpeculativeConfig(
        speculative_algorithm="EAGLE", speculative_draft_model_path=head, speculative_eagle_topk=4,
        speculative_num_steps=3, num_speculative_tokens=7)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=DEFAULT_MODEL, dtype="float32"),
                                    cache=CacheConfig(max_total_tokens=8192), speculative=speculative))
    params = [SamplingParams(temperature=0.0, max_tokens=60),
              SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=30)]
    for index, text in enumerate(PROMPTS + PROMPTS[:1]):
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        assert engine.add_request(str(index), ids, params[index]) is None
    outputs = drain(engine)
    stats = engine.stats()
    engine.shutdown()
    return [outputs[str(i)] for i in range(3)], stats


def test_eagle_tree_equals_plain_decoding_on_the_default_model(tmp_path):
    head = tmp_path / "eagle-head"
    write_head(["--model", DEFAULT_MODEL, "--algorithm", "EAGLE", "--out", str(head)])
    plain, _ = run(None)
    tree, stats = run(str(head))
    assert tree == plain
    assert stats["spec_num_draft_tokens"] > 100 and stats["spec_draft_used_blocks"] == 0, stats
