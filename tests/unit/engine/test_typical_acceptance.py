"""Typical acceptance (--spec-decoding-acceptance-method typical_acceptance_sampler) through
LLMEngine with the fake runner: greedy requests stay token for token plain decoding whatever the
drafts; a draft the model gives probability 0 is never kept (top_k 1 sampling equals greedy
even under random drafts); on flat distributions it keeps far more drafts than exact
verification; streamed output equals the one-shot output."""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner
from .test_engine_core import EOS, PROMPTS, CharTokenizer, greedy, run_all
from .test_speculative import K, OracleProposer, RandomProposer, collect_logprobs


def make(proposer: str | None, typical: bool = True, tokenizer=None, **scheduler: int) -> LLMEngine:
    runner = FakeRunner(num_blocks=64, block_size=4)
    speculative = SpeculativeConfig(
        speculative_algorithm=None if proposer is None else "NGRAM", num_speculative_tokens=K,
        spec_decoding_acceptance_method="typical_acceptance_sampler" if typical and proposer
        else "rejection_sampler")
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler), speculative=speculative,
                          cache=CacheConfig(disable_radix_cache=True))
    chosen = {None: None, "oracle": OracleProposer(runner), "random": RandomProposer(runner.vocab_size),
              "perfect": OracleProposer(runner, corrupt=False)}[proposer]
    return LLMEngine(config, runner=runner, tokenizer=tokenizer, eos_token_ids=[EOS],
                     context_length=512, proposer=chosen)


@pytest.mark.parametrize("proposer", ["oracle", "random", "perfect"])
def test_greedy_tokens_equal_plain_decoding(proposer: str) -> None:
    requests = {str(i): (prompt, greedy(25)) for i, prompt in enumerate(PROMPTS)}
    plain = run_all(make(None), requests)
    engine = make(proposer)
    assert engine.executor.verification.typical is not None
    assert run_all(engine, requests)[0] == plain[0]
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert engine.block_pool.num_free_blocks == 64
    with_drafts = collect_logprobs(make(proposer), PROMPTS[4], greedy(17, logprobs=3))
    assert len(with_drafts) == 17
    assert with_drafts == collect_logprobs(make(None), PROMPTS[4], greedy(17, logprobs=3))


def test_zero_probability_drafts_are_never_kept() -> None:
    """temperature 1 with top_k 1: the model's distribution is a point mass, so every other token
    has probability 0. Random drafts (almost never the argmax) and corrupted oracle drafts must
    then give exactly the greedy tokens: a kept zero-probability draft would change them."""
    sampling = SamplingParams(temperature=1.0, top_k=1, max_tokens=25, ignore_eos=True)
    requests = {str(i): (prompt, sampling) for i, prompt in enumerate(PROMPTS)}
    plain, _, _ = run_all(make(None), {key: (prompt, greedy(25)) for key, (prompt, _) in requests.items()})
    for proposer in ("random", "oracle"):
        engine = make(proposer)
        tokens, _, _ = run_all(engine, requests)
        assert tokens == plain, proposer
        stats = engine.stats()
        if proposer == "oracle":
            assert 0.3 < stats["spec_acceptance_rate"] < 1.0, stats


def test_flat_distributions_keep_more_drafts_than_exact_verification() -> None:
    """temperature 10 flattens the fake model's rows (argmax p 0.07, every other token 0.0097,
    entropy 4.5 nats): exact verification keeps a random draft about 1% of the time, typical
    acceptance keeps any token above 0.3 x exp(-4.5) = 0.0033, i.e. nearly all."""
    sampling = SamplingParams(temperature=10.0, max_tokens=20, ignore_eos=True, seed=1)
    requests = {str(i): (prompt, sampling) for i, prompt in enumerate(PROMPTS)}
    rates = {}
    for typical in (False, True):
        engine = make("random", typical=typical)
        run_all(engine, requests)
        rates[typical] = engine.stats()["spec_acceptance_rate"]
    assert rates[False] < 0.05 and rates[True] > 0.9, rates


@pytest.mark.parametrize("proposer", ["oracle", "random"])
def test_streamed_output_equals_the_one_shot_output(proposer: str) -> None:
    """Seeded sampling under typical acceptance: deltas streamed every token add up to the
    output of a request answered once at the end (same tokens, same text)."""
    requests = {str(i): (prompt, SamplingParams(temperature=1.5, max_tokens=30, seed=i, ignore_eos=True))
                for i, prompt in enumerate(PROMPTS[:4])}
    streamed = run_all(make(proposer, tokenizer=CharTokenizer(), stream_interval=1), requests)
    one_shot = run_all(make(proposer, tokenizer=CharTokenizer(), stream_interval=1000), requests)
    assert streamed[0] == one_shot[0] and streamed[1] == one_shot[1]
    assert all(len(tokens) == 30 for tokens in streamed[0].values())
