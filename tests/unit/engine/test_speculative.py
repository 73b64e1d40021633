"""Speculative decoding through LLMEngine with the fake runner (which checks the KV contract: a
rolled-back slot read before it is rewritten, or a wrong block, changes its output).

Drafts are forced through the proposer interface: an oracle that proposes the model's own
continuation (corrupted at a varying position, so every accept length occurs) and a proposer of
random tokens. Whatever the drafts, outputs must be token for token those of plain decoding.
"""

from __future__ import annotations

import random

import pytest

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from servelm.spec.proposer import Draft, DraftRequest

from .fake_runner import FakeRunner
from .test_engine_core import EOS, PROMPTS, CharTokenizer, greedy, run_all

K = 4


class OracleProposer:
    """Proposes the fake model's continuation; with ``corrupt``, one draft in each is wrong, at a
    position that cycles with the output length (0..K: K means all right)."""

    name = "ORACLE"

    def __init__(self, runner: FakeRunner, corrupt: bool = True) -> None:
        self.runner = runner
        self.corrupt = corrupt
        self.num_calls = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.num_calls += 1
        drafts = []
        for r in requests:
            tokens = self.runner.reference(r.prompt_token_ids + r.output_token_ids, r.max_draft_tokens)
            wrong_at = len(r.output_token_ids) % (K + 1)
            if self.corrupt and wrong_at < len(tokens):
                tokens[wrong_at] = (tokens[wrong_at] + 1) % self.runner.vocab_size
            drafts.append(Draft(tokens))
        return drafts

    def release(self, request_id: str) -> None:
        pass


class RandomProposer:
    name = "RANDOM"

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([self.rng.randrange(self.vocab_size) for _ in range(r.max_draft_tokens)])
                for r in requests]

    def release(self, request_id: str) -> None:
        pass


def make(proposer: str | None, num_blocks: int = 64, tokenizer=None, cache: bool = False,
         disable_by_batch_size: int | None = None, **scheduler: int):
    runner = FakeRunner(num_blocks=num_blocks, block_size=4)
    speculative = SpeculativeConfig(speculative_algorithm=None if proposer is None else "NGRAM",
                                    num_speculative_tokens=K,
                                    speculative_disable_by_batch_size=disable_by_batch_size)
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler), speculative=speculative,
                          cache=CacheConfig(disable_radix_cache=not cache))
    chosen = {None: None, "ngram": None, "oracle": OracleProposer(runner),
              "perfect": OracleProposer(runner, corrupt=False),
              "random": RandomProposer(runner.vocab_size)}[proposer]
    engine = LLMEngine(config, runner=runner, tokenizer=tokenizer, eos_token_ids=[EOS],
                       context_length=512, proposer=chosen)
    return engine, runner


def spec_stats(engine: LLMEngine) -> dict:
    return engine.stats()


@pytest.mark.parametrize("proposer", ["oracle", "perfect", "random", "ngram"])
def test_greedy_tokens_equal_plain_decoding_for_any_drafts(proposer):
    requests = {str(i): (prompt, greedy(25)) for i, prompt in enumerate(PROMPTS)}
    plain, _, _ = run_all(make(None)[0], requests)
    engine, runner = make(proposer)
    tokens, _, finished = run_all(engine, requests)
    assert tokens == plain
    assert all(f.finish_reason == "length" for f in finished.values())
    assert engine.stats()["num_used_blocks"] == 0 and engine.block_pool.num_free_blocks == 64
    stats = spec_stats(engine)
    if proposer == "perfect":
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_accept_length"] > 4.0
    if proposer == "oracle":
        assert 0.3 < stats["spec_acceptance_rate"] < 1.0
    if proposer != "ngram":
        assert stats["spec_num_draft_tokens"] > 0


def test_accepted_runs_save_model_steps():
    requests = {"a": (PROMPTS[3], greedy(40))}
    plain_engine, _ = make(None)
    run_all(plain_engine, requests)
    engine, _ = make("perfect")
    run_all(engine, requests)
    # K drafts + the model's token per step: 40 tokens in 8 decode steps, not 40.
    assert engine.num_steps <= plain_engine.num_steps // 4


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 11])
def test_max_tokens_cuts_inside_an_accepted_run(max_tokens):
    requests = {str(i): (prompt, greedy(max_tokens)) for i, prompt in enumerate(PROMPTS[:3])}
    plain, _, _ = run_all(make(None)[0], requests)
    engine, _ = make("perfect")
    tokens, _, finished = run_all(engine, requests)
    assert tokens == plain and all(len(t) == max_tokens for t in tokens.values())
    assert all(f.finish_reason == "length" for f in finished.values())


def test_stop_token_inside_an_accepted_run():
    engine, runner = make("perfect")
    expected = runner.reference(PROMPTS[2], 30)
    stop_id = expected[6]
    cut = expected.index(stop_id) + 1
    tokens, _, finished = run_all(engine, {"a": (PROMPTS[2], greedy(30, stop_token_ids=[stop_id]))})
    assert tokens["a"] == expected[:cut]
    assert finished["a"].finish_reason == "stop" and finished["a"].stop_reason == stop_id
    assert engine.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_stop_string_inside_an_accepted_run_cuts_tokens_and_text(stream_interval):
    plain_engine, runner = make(None, tokenizer=CharTokenizer(), stream_interval=stream_interval)
    expected = runner.reference(PROMPTS[0], 30)
    text = CharTokenizer().decode(expected)
    stop = text[9:11]
    cut = text.index(stop)
    requests = {"a": (PROMPTS[0], greedy(30, stop=[stop])),
                "b": (PROMPTS[0], greedy(30, stop=[stop], include_stop_str_in_output=True,
                                         logprobs=2))}
    plain = run_all(plain_engine, requests)
    engine, _ = make("perfect", tokenizer=CharTokenizer(), stream_interval=stream_interval)
    tokens, texts, finished = run_all(engine, requests)
    assert spec_stats(engine)["spec_accept_length"] > 2
    assert tokens == plain[0]
    assert tokens["a"] == expected[:cut + len(stop)]            # not the rest of the accepted run
    assert texts["a"] == text[:cut] and texts["b"] == text[:cut + len(stop)]
    assert finished["a"].stop_reason == stop and finished["a"].num_output_tokens == cut + len(stop)


def collect_logprobs(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    assert engine.add_request("lp", prompt, params) is None
    entries = []
    while engine.has_unfinished():
        for output in engine.step():
            entries.extend(output.logprobs or [])
    return entries


def test_logprobs_equal_plain_decoding():
    params = greedy(17, logprobs=3)
    plain = collect_logprobs(make(None)[0], PROMPTS[4], params)
    with_drafts = collect_logprobs(make("oracle")[0], PROMPTS[4], params)
    assert len(plain) == 17 and with_drafts == plain


def test_seeded_sampling_equals_plain_decoding():
    """Row i is sampled with the seed stream of output position len(output) + i, so seeded
    sampling gives plain decoding's tokens whatever the drafts."""
    requests = {str(i): (prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=i,
                                                ignore_eos=True, repetition_penalty=1.3))
                for i, prompt in enumerate(PROMPTS)}
    plain, _, _ = run_all(make(None)[0], requests)
    for proposer in ("oracle", "random"):
        tokens, _, _ = run_all(make(proposer)[0], requests)
        assert tokens == plain, proposer


@pytest.mark.parametrize("proposer", ["oracle", "random"])
def test_preemption_and_chunked_prefill_keep_outputs(proposer):
    requests = {str(i): (prompt, greedy(30)) for i, prompt in enumerate(PROMPTS)}
    plain, _, _ = run_all(make(None)[0], requests)
    engine, _ = make(proposer, num_blocks=24, chunked_prefill_size=5, max_prefill_tokens=24)
    tokens, _, _ = run_all(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert tokens == plain
    assert engine.block_pool.num_free_blocks == 24


def test_rejected_drafts_never_enter_the_prefix_cache():
    """Every cached block lies on a finished request's real token path: a rejected draft's block
    would be a branch off it. A later request that continues with the rejected tokens reuses only
    the real prefix and still decodes exactly."""
    engine, runner = make("random", cache=True)
    prompt = PROMPTS[5]
    tokens, _, _ = run_all(engine, {"a": (prompt, greedy(40))})
    stats = spec_stats(engine)
    assert stats["spec_num_draft_tokens"] > 100 and stats["spec_acceptance_rate"] < 0.2
    path = prompt + tokens["a"]
    cache = engine.prefix_cache
    assert cache is not None
    assert cache.num_blocks == cache.match_length(path, None) // 4 == (len(path) - 1) // 4
    # Continue from the middle of the output with a wrong token: only the true prefix matches.
    follow = path[:30] + [(path[30] + 1) % runner.vocab_size] + path[31:36]
    plain_tokens, _, _ = run_all(make(None)[0], {"b": (follow, greedy(10))})
    again, _, finished = run_all(engine, {"b": (follow, greedy(10))})
    assert again == plain_tokens
    assert finished["b"].num_cached_tokens == 28


def test_disable_by_batch_size():
    requests = {str(i): (prompt, greedy(12)) for i, prompt in enumerate(PROMPTS[:4])}
    engine, _ = make("perfect", disable_by_batch_size=2)
    tokens, _, _ = run_all(engine, requests)
    assert spec_stats(engine)["spec_num_draft_tokens"] == 0   # 4 requests run together throughout
    engine, _ = make("perfect", disable_by_batch_size=5)
    assert run_all(engine, requests)[0] == tokens
    assert spec_stats(engine)["spec_num_draft_tokens"] > 0


def test_rejected_drafts_blocks_are_freed_after_each_step():
    """After every step a request holds exactly the blocks its computed tokens need, as in plain
    decoding: the blocks only rejected drafts reached went back to the pool."""
    engine, _ = make("random")
    for i, prompt in enumerate(PROMPTS[:4]):
        assert engine.add_request(str(i), prompt, greedy(30)) is None
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            assert len(request.block_ids) == -(-request.num_computed_tokens // 4)
            assert request.drafts is None
