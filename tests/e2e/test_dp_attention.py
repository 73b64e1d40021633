"""--enable-dp-attention on two ranks on loopback: each rank runs the attention (and dense layers)
of its own requests over its own KV pool, the MoE layers expert-parallel over both; greedy tokens
equal one process's in float32, with a prefix-cache hit, chunked prefill, and passes where one
rank has no request (it still joins every MoE layer's all-to-all)."""

from __future__ import annotations

from typing import Any

import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from tests.e2e.test_engine_moe import shared_prefix_prompts
from tests.e2e.test_prefix_cache_tiny import run
from tests.tiny_models import TINY_VOCAB_SIZE, make_tiny_model_dir

NUM_NEW_TOKENS = 12


def generate(flags: dict[str, Any], token_lists: list[list[int]]) -> tuple[list[list[int]], int, Any]:
    """A first request alone (one rank idle in its passes, and it fills the prefix cache), then the
    rest together from its prefix; (their tokens, cached prompt tokens, rank 0's runner's
    assignment or None)."""
    engine = LLMEngine(EngineConfig.from_flat(flags))
    try:
        first, _ = run(engine, token_lists[:1], NUM_NEW_TOKENS)
        rest, cached = run(engine, token_lists[1:], NUM_NEW_TOKENS)
        runner = getattr(engine.runner, "runner", engine.runner)
        return first + rest, cached, runner.attention_ranks
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch, dp_lm_head", [("deepseek_v3", False), ("deepseek_v2", True), ("qwen3_moe", False)])
def test_dp_attention_matches_one_process(tmp_path, arch: str, dp_lm_head: bool) -> None:
    model = str(make_tiny_model_dir(tmp_path, arch))
    flags = dict(model=model, dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True,
                 max_total_tokens=1024, page_size=4, chunked_prefill_size=8)
    token_lists = shared_prefix_prompts(TINY_VOCAB_SIZE) + [[300, 12, 99], list(range(7, 30))]
    expected, _, _ = generate(flags, token_lists)
    got, cached, ranks = generate(dict(flags, tensor_parallel_size=2, enable_dp_attention=True,
                                       enable_dp_lm_head=dp_lm_head), token_lists)
    assert got == expected, arch
    assert cached > 0, "no prefix-cache hit"
    assert sorted(set(ranks.rank_of_first_block.values())) == [0, 1], "both ranks ran requests"


@pytest.mark.slow
def test_a_model_without_experts_is_refused(tmp_path) -> None:
    model = str(make_tiny_model_dir(tmp_path, "llama"))
    flags = dict(model=model, dtype="float32", device="cpu", num_threads=1, skip_tokenizer_init=True,
                 max_total_tokens=256, tensor_parallel_size=2, enable_dp_attention=True)
    with pytest.raises(Exception, match="has no mixture-of-experts layer"):
        LLMEngine(EngineConfig.from_flat(flags))
