"""The STANDALONE draft's first catch-up keeps the chunked-prefill budget (tiny random-weight
models of test_speculative_draft_tiny, float32): a 300-token prompt with --chunked-prefill-size 16
gives the same greedy tokens as plain decoding, no draft forward computes more than 16 tokens of
one request (nor more than --max-prefill-tokens in all), and the request starts drafting once
its draft has caught up."""

from __future__ import annotations

import random

import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.spec.draft_model import DraftSequence
from tests.e2e.test_speculative_draft_tiny import models  # noqa: F401  (the module's fixture)
from tests.e2e.test_speculative_tiny import generate, greedy_all, prompts

CHUNK = 16
MAX_PREFILL = 40


class RecordingRunner:
    """The draft's runner, recording the sequences of every forward (then running it)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.forwards: list[list[int]] = []

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def forward_last(self, sequences: list[DraftSequence]) -> torch.Tensor:
        self.forwards.append([len(s.token_ids) for s in sequences])
        return self.runner.forward_last(sequences)


def make_engine(target, draft=None, chunk: int = -1) -> LLMEngine:
    speculative = SpeculativeConfig() if draft is None else SpeculativeConfig(
        speculative_draft_model_path=str(draft), num_speculative_tokens=3)
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(target), skip_tokenizer_init=True, dtype="float32", seed=0),
        cache=CacheConfig(max_total_tokens=4096, page_size=8),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=MAX_PREFILL),
        speculative=speculative))


def test_long_prompt_catch_up_is_chunked_and_output_unchanged(models):  # noqa: F811
    rng = random.Random(3)
    long_prompt = prompts(1)[0] * 4 + [rng.randrange(1, 300) for _ in range(150)]
    assert len(long_prompt) > 10 * CHUNK
    token_lists = {"long": long_prompt, **{str(i): p for i, p in enumerate(prompts(3))}}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(models["target"], chunk=CHUNK), params, token_lists)
    engine = make_engine(models["target"], models["close"], chunk=CHUNK)
    proposer = engine._draft_proposer
    recording = RecordingRunner(proposer.runner)
    proposer.runner = recording
    assert generate(engine, params, token_lists) == plain
    assert max(max(forward) for forward in recording.forwards) == CHUNK
    assert max(sum(forward) for forward in recording.forwards) <= MAX_PREFILL
    assert engine.stats()["spec_draft_used_blocks"] == 0

    alone = make_engine(models["target"], models["close"], chunk=CHUNK)
    recording = RecordingRunner(alone._draft_proposer.runner)
    alone._draft_proposer.runner = recording
    assert generate(alone, params, {"long": long_prompt})["long"] == plain["long"]
    # The prompt caught up 16 tokens a step, then the request drafted (accepted runs).
    catch_up = [forward for forward in recording.forwards if forward[0] > 1]
    assert len(catch_up) >= len(long_prompt) // CHUNK and max(max(f) for f in catch_up) == CHUNK
    stats = alone.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_accept_length"] > 1.5, stats
