"""Embedding requests through LLMEngine + Scheduler: whole prompts, one step, blocks freed.

The fake runner pools each sequence to ``[len, sum, first token]`` after checking, like a real
runner must, that it is a whole prompt computed from position 0 in its own blocks.
"""

from __future__ import annotations

import torch

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.model.forward_batch import BatchPlan
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner


class FakePoolingRunner(FakeRunner):
    task = "embed"

    def __init__(self) -> None:
        super().__init__(num_blocks=16, block_size=4)
        self.num_forwards = 0
        self.batch_sizes: list[int] = []

    def pool(self, plan: BatchPlan) -> torch.Tensor:
        self.num_forwards += 1
        self.batch_sizes.append(len(plan.sequences))
        rows = []
        for sequence in plan.sequences:
            assert sequence.is_pooled and sequence.start_position == 0 and sequence.num_logits == 0
            assert len(sequence.block_ids) * self.block_size >= len(sequence.token_ids)
            rows.append([len(sequence.token_ids), sum(sequence.token_ids), sequence.token_ids[0]])
        return torch.tensor(rows, dtype=torch.float32)


def make_engine(radix: bool = True, **scheduler: int) -> tuple[LLMEngine, FakePoolingRunner]:
    runner = FakePoolingRunner()
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler),
                          cache=CacheConfig(disable_radix_cache=not radix))
    return LLMEngine(config, runner=runner, eos_token_ids=[], context_length=40), runner


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[float]]:
    for request_id, prompt in prompts.items():
        assert engine.add_embedding_request(request_id, prompt) is None
    vectors: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.is_finished and output.finish_reason == "stop" and not output.new_token_ids
            assert output.embedding is not None
            vectors[output.request_id] = output.embedding
    return vectors


def test_prompts_are_batched_whole_despite_the_chunk_size() -> None:
    engine, runner = make_engine(chunked_prefill_size=2)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9], "c": [4] * 11}
    vectors = run(engine, prompts)
    assert vectors == {rid: [len(p), sum(p), p[0]] for rid, p in prompts.items()}
    assert runner.batch_sizes == [3]  # one forward for all three
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert engine.model_info["task"] == "embed"


def test_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    engine, runner = make_engine(max_prefill_tokens=8)
    vectors = run(engine, {"a": [1] * 6, "b": [2] * 6, "c": [3] * 2})
    assert runner.batch_sizes == [1, 2] and vectors["b"] == [6, 12, 2]
    too_long = engine.add_embedding_request("d", [1] * 9)
    assert too_long is not None and too_long.error_status == 400 and "at most 8" in (too_long.error or "")


def test_embedding_requests_never_share_or_fill_the_prefix_cache() -> None:
    engine, _ = make_engine()
    prompt = list(range(1, 10))
    run(engine, {"a": prompt})
    run(engine, {"b": prompt})
    assert engine.prefix_cache is not None and engine.prefix_cache.num_blocks == 0
    assert engine.stats()["num_cached_prompt_tokens"] == 0


def test_the_task_decides_which_requests_are_accepted() -> None:
    engine, _ = make_engine()
    refused = engine.add_request("g", [1, 2], SamplingParams(max_tokens=2))
    assert refused is not None and refused.error_status == 400
    assert "does not support generation" in (refused.error or "")
    generator = LLMEngine(EngineConfig(), runner=FakeRunner(), eos_token_ids=[], context_length=40)
    refused = generator.add_embedding_request("e", [1, 2])
    assert refused is not None and "--task embed" in (refused.error or "")
    assert engine.add_embedding_request("empty", []) is not None
    assert engine.add_embedding_request("full", [1] * 40) is None  # the whole context: no output needed
