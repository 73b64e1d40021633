"""n copies of one prompt compute it once (engine/prompt_sharing.py), on a tiny real model in
float32: the copies' tokens and prompt logprobs equal n=1 runs of each copy, and the prefill
counter shows the prompt computed once plus one last token per further copy."""

from __future__ import annotations

import random

import pytest
from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir

PROMPT_LEN = 45  # not a multiple of the page size: the copies' partial block is copied on write
NUM_COPIES = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def make_engine(path, cache: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=4096, page_size=8, disable_radix_cache=not cache),
        scheduler=SchedulerConfig(chunked_prefill_size=16, max_prefill_tokens=256)))


def the_prompt(vocab_size: int) -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(1, vocab_size) for _ in range(PROMPT_LEN)]


def params(seed: int | None, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=10, ignore_eos=True,
                          logprobs=2, prompt_logprobs=3)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, str]],
        abort_after_step: str | None = None) -> dict[str, tuple[list[int], list]]:
    for request_id, tokens, request_params, group in requests:
        assert engine.add_request(request_id, tokens, request_params, group=group) is None
    tokens_of: dict[str, list[int]] = {request_id: [] for request_id, *_ in requests}
    prompt_logprobs: dict[str, list] = {}
    first = True
    while engine.has_unfinished():
        for output in engine.step():
            tokens_of[output.request_id].extend(output.new_token_ids)
            if output.prompt_logprobs is not None:
                prompt_logprobs[output.request_id] = output.prompt_logprobs
            if output.is_finished:
                assert output.finish_reason in ("length", "abort"), output.error
        if first and abort_after_step is not None:
            engine.abort_request(abort_after_step)
        first = False
    assert engine.stats()["num_used_blocks"] == 0
    return {rid: (tokens_of[rid], prompt_logprobs.get(rid)) for rid in tokens_of}


def same_logprobs(a: list, b: list) -> bool:
    assert len(a) == len(b) == PROMPT_LEN
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if x.token_id != y.token_id or abs(x.logprob - y.logprob) > 1e-5:
            return False
        if [t for t, _ in x.top] != [t for t, _ in y.top]:
            return False
    return True


@pytest.mark.parametrize("cache", [True, False], ids=["radix-cache", "no-cache"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_n_copies_compute_the_prompt_once_and_equal_n1_runs(tiny_path, cache, temperature):
    engine = make_engine(tiny_path, cache)
    prompt = the_prompt(engine.runner.vocab_size)
    alone = {}
    for index in range(NUM_COPIES):
        before = engine.stats()["num_prefill_tokens"]
        result = run(engine, [(f"one-{index}", prompt, params(100 + index, temperature), "")])
        alone[index] = result[f"one-{index}"]
        # prompt logprobs need every prompt position: an n=1 request never takes a cache hit
        assert engine.stats()["num_prefill_tokens"] - before == PROMPT_LEN
    before = engine.stats()["num_prefill_tokens"]
    shared_before = engine.stats()["num_shared_prompts"]
    copies = run(engine, [(f"n-{index}", prompt, params(100 + index, temperature), "group")
                          for index in range(NUM_COPIES)])
    # the prompt once, then each further copy its last prompt token only (forked K/V)
    assert engine.stats()["num_prefill_tokens"] - before == PROMPT_LEN + NUM_COPIES - 1
    assert engine.stats()["num_shared_prompts"] - shared_before == NUM_COPIES - 1
    for index in range(NUM_COPIES):
        tokens, logprobs = copies[f"n-{index}"]
        assert tokens == alone[index][0], index
        assert same_logprobs(logprobs, alone[index][1]), index
    if temperature > 0:
        assert len({tuple(copies[f"n-{i}"][0]) for i in range(NUM_COPIES)}) > 1  # seeds differ


def test_the_lead_passes_on_when_the_first_copy_is_aborted(tiny_path):
    engine = make_engine(tiny_path, cache=True)
    prompt = the_prompt(engine.runner.vocab_size)
    alone = run(engine, [("one", prompt, params(7, 0.8), "")])["one"]
    copies = run(engine, [(f"n-{index}", prompt, params(7 if index else 1, 0.8), "group")
                          for index in range(3)], abort_after_step="n-0")
    assert copies["n-0"][0] == []
    for index in (1, 2):
        tokens, logprobs = copies[f"n-{index}"]
        assert tokens == alone[0]
        assert same_logprobs(logprobs, alone[1])


def test_different_prompts_of_one_group_are_not_shared(tiny_path):
    engine = make_engine(tiny_path, cache=False)
    prompt = the_prompt(engine.runner.vocab_size)
    other = prompt[:-1] + [(prompt[-1] % 300) + 1]
    before = engine.stats()["num_prefill_tokens"]
    run(engine, [("a", prompt, params(1, 0.0), "group"), ("b", other, params(1, 0.0), "group")])
    assert engine.stats()["num_prefill_tokens"] - before == 2 * PROMPT_LEN
