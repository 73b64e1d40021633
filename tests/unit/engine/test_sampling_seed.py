"""--seed reaches sampling: a request with no seed samples from a generator derived from the
server seed and its arrival order, whatever the batching (issue 11)."""

from __future__ import annotations

from servelm.config import EngineConfig, ModelConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from servelm.sampling.sampler import request_seed
from tests.engine_drive import drain

from .fake_runner import FakeRunner

PROMPTS = [[5, 6, 7], [8, 9], [5, 6, 7], [1, 2, 3, 4]]
# The fake runner's logits are +-10: a high temperature makes every draw close to uniform.
HOT = SamplingParams(temperature=100.0, max_tokens=12, ignore_eos=True)


def make_engine(seed: int) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(seed=seed))
    return LLMEngine(config, runner=FakeRunner(), eos_token_ids=[96], context_length=512)


def sample_together(seed: int, params: SamplingParams = HOT) -> list[list[int]]:
    """All requests added before the first step: they share every batch."""
    engine = make_engine(seed)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(str(i), prompt, params) is None
    drain(engine, tokens)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def sample_one_by_one(seed: int) -> list[list[int]]:
    """The same requests in the same order, each run alone."""
    engine = make_engine(seed)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(str(i), prompt, HOT) is None
        drain(engine, tokens)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def test_same_server_seed_same_samples_whatever_the_batching() -> None:
    together = sample_together(7)
    assert together == sample_together(7)
    assert together == sample_one_by_one(7)
    assert together[0] != together[2], "the same prompt twice must not repeat the same draw"


def test_another_server_seed_other_samples() -> None:
    assert sample_together(7) != sample_together(8)


def test_request_seed_wins_over_the_server_seed() -> None:
    seeded = SamplingParams(temperature=100.0, max_tokens=12, ignore_eos=True, seed=3)
    assert sample_together(7, seeded) == sample_together(8, seeded)


def test_request_seeds_are_distinct_and_stable() -> None:
    seeds = [request_seed(0, i) for i in range(1000)] + [request_seed(1, i) for i in range(1000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert request_seed(7, 3) == request_seed(7, 3)
