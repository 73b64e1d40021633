"""--enable-deterministic-inference on a tiny Llama in bfloat16: a request's tokens and logprobs
are bit-identical alone, batched beside other requests, and after a prefix-cache hit; in float32
its greedy tokens are the normal engine's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.executor import token_passes
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir

BLOCK = 16
rng = random.Random(7)
PROMPT = [rng.randrange(1, 300) for _ in range(21)]
OTHERS = [[rng.randrange(1, 300) for _ in range(n)] for n in (5, 12, 26)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("deterministic"), "llama")


def make(model_dir: Path, dtype: str, deterministic: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype),
        cache=CacheConfig(max_total_tokens=2048, page_size=BLOCK),
        scheduler=SchedulerConfig(chunked_prefill_size=8),
        runtime=RuntimeConfig(num_threads=2, enable_deterministic_inference=deterministic)))


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[tuple]]]:
    for request_id, prompt in prompts.items():
        assert engine.add_request(request_id, prompt, PARAMS) is None
    got: dict[str, tuple[list[int], list[tuple]]] = {r: ([], []) for r in prompts}
    while engine.has_unfinished():
        for output in engine.step():
            tokens, logprobs = got[output.request_id]
            tokens += output.new_token_ids
            logprobs += [(e.logprob, tuple(e.top)) for e in output.logprobs or []]
    return got


def scenarios(model_dir: Path, dtype: str, deterministic: bool) -> list[tuple[list[int], list[tuple]]]:
    """PROMPT's result: alone; beside three others (prompts chunked by 8); after a cache hit on
    its first 16 tokens (one block, computed by an earlier request sharing them)."""
    results = []
    engine = make(model_dir, dtype, deterministic)
    try:
        results.append(run(engine, {"p": PROMPT})["p"])
        engine.flush_cache()
        results.append(run(engine, {"a": OTHERS[0], "p": PROMPT, "b": OTHERS[1], "c": OTHERS[2]})["p"])
        engine.flush_cache()
        run(engine, {"warm": PROMPT[:16] + [5, 6, 7]})
        hits_before = engine.scheduler.num_cached_prompt_tokens
        results.append(run(engine, {"p": PROMPT})["p"])
        assert engine.scheduler.num_cached_prompt_tokens - hits_before == 16
    finally:
        engine.shutdown()
    return results


def test_bf16_outputs_identical_alone_batched_and_after_cache_hit(model_dir: Path) -> None:
    """Without the mode the batched run differs in the logprobs' last bits (measured on this model
    with a 45-token prompt: -4.0179415 alone, -4.0178924 beside three others)."""
    alone, batched, cached = scenarios(model_dir, "bfloat16", deterministic=True)
    assert batched == alone and cached == alone  # tokens and every logprob, bit for bit


def test_float32_greedy_tokens_match_the_normal_engine(model_dir: Path) -> None:
    normal = make(model_dir, "float32", deterministic=False)
    try:
        expected = run(normal, {"p": PROMPT, "q": OTHERS[1]})
    finally:
        normal.shutdown()
    engine = make(model_dir, "float32", deterministic=True)
    try:
        got = run(engine, {"p": PROMPT, "q": OTHERS[1]})
    finally:
        engine.shutdown()
    assert [got[r][0] for r in "pq"] == [expected[r][0] for r in "pq"]
    for r in "pq":
        assert [lp for lp, _ in got[r][1]] == pytest.approx([lp for lp, _ in expected[r][1]], abs=1e-4)


def test_token_passes_keep_rows_and_copies() -> None:
    plan = BatchPlan([SequencePlan([1, 2, 3], 4, [0, 1], num_logits=2, lora_slot=1),
                      SequencePlan([9], 7, [2])], block_copies=[(0, 3)], argmax_rows=[2])
    passes = token_passes(plan)
    assert [(p.sequences[0].token_ids, p.sequences[0].start_position, p.sequences[0].num_logits)
            for p in passes] == [([1], 4, 0), ([2], 5, 1), ([3], 6, 1), ([9], 7, 1)]
    assert [p.argmax_rows for p in passes] == [[], [], [], [0]]  # row 2 of the plan: the 4th pass
    assert passes[0].block_copies == [(0, 3)] and not passes[1].block_copies
    assert {p.sequences[0].lora_slot for p in passes[:3]} == {1}
