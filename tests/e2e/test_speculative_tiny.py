"""Speculative decoding with the real model runner on tiny random-weight checkpoints (float32).

Greedy outputs are identical with and without speculation, for the n-gram proposer and for forced
drafts (the plain run's own tokens, partly corrupted: long accepted runs and rejections both
happen), with chunked prefill and preemption. Sampling keeps the model's distribution: the first
sampled token's frequencies over many seeds match the model's probabilities, with a draft that
agrees often and one that rarely does, and each seeded request gives plain decoding's tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from servelm.spec.ngram import NgramProposer
from servelm.spec.proposer import Draft, DraftRequest
from tests.tiny_models import make_tiny_model_dir

ARCHES = ["llama", "gemma3"]  # plain attention; sliding-window layers


@pytest.fixture(scope="module", params=ARCHES)
def tiny_model(request, tmp_path_factory):
    return request.param, make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama-stats"), "llama")


class ReplayProposer:
    """Proposes ``reference[request_id]`` from the current output length on; every ``wrong_every``-th
    proposed position is corrupted (None: never), or ``fixed`` tokens for every request."""

    name = "REPLAY"

    def __init__(self, reference: dict[str, list[int]] | None = None, wrong_every: int | None = None,
                 fixed: list[int] | None = None) -> None:
        self.reference = reference or {}
        self.wrong_every = wrong_every
        self.fixed = fixed
        self.num_proposed = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            if self.fixed is not None:
                drafts.append(Draft(self.fixed[:r.max_draft_tokens]))
                continue
            done = len(r.output_token_ids)
            tokens = list(self.reference[r.request_id][done:done + r.max_draft_tokens])
            for index in range(len(tokens)):
                self.num_proposed += 1
                if self.wrong_every and self.num_proposed % self.wrong_every == 0:
                    tokens[index] = (tokens[index] + 1) % 300
            drafts.append(Draft(tokens))
        return drafts

    def release(self, request_id: str) -> None:
        pass


def make_engine(path, algorithm: str | None = None, proposer=None, max_total_tokens: int = 4096,
                chunk: int = -1, k: int = 5) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=2048),
        speculative=SpeculativeConfig(speculative_algorithm=algorithm, num_speculative_tokens=k,
                                      ngram_prompt_lookup_min=1),
    )
    return LLMEngine(config, proposer=proposer)


def prompts(count: int = 6) -> list[list[int]]:
    """Random prompts that repeat themselves (so n-gram lookups find matches)."""
    rng = random.Random(99)
    result = []
    for _ in range(count):
        piece = [rng.randrange(1, 300) for _ in range(rng.randrange(4, 12))]
        result.append(piece * 3 + piece[:2])
    return result


def generate(engine: LLMEngine, params: dict[str, SamplingParams],
             token_lists: dict[str, list[int]]) -> dict[str, list[int]]:
    for request_id, tokens in token_lists.items():
        assert engine.add_request(request_id, tokens, params[request_id]) is None
    outputs: dict[str, list[int]] = {request_id: [] for request_id in token_lists}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            outputs[output.request_id].extend(output.new_token_ids)
    assert engine.stats()["num_used_blocks"] == 0
    return outputs


def greedy_all(token_lists: dict[str, list[int]], max_tokens: int = 40) -> dict[str, SamplingParams]:
    return {r: SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for r in token_lists}


def test_greedy_identical_with_ngram_and_forced_drafts(tiny_model):
    arch, path = tiny_model
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists)
    plain = generate(make_engine(path), params, token_lists)

    ngram = make_engine(path, "NGRAM")
    assert generate(ngram, params, token_lists) == plain, arch
    assert ngram.stats()["spec_num_draft_tokens"] > 0

    replay = make_engine(path, "NGRAM", ReplayProposer(plain, wrong_every=7))
    assert generate(replay, params, token_lists) == plain, arch
    stats = replay.stats()
    assert stats["spec_accept_length"] > 2.5 and stats["spec_acceptance_rate"] < 1.0, stats


def test_greedy_identical_under_chunked_prefill_and_preemption(tiny_model):
    arch, path = tiny_model
    token_lists = {str(i): p for i, p in enumerate(prompts(8))}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(path), params, token_lists)
    squeezed = make_engine(path, "NGRAM", ReplayProposer(plain, wrong_every=5),
                           max_total_tokens=160, chunk=7)
    assert generate(squeezed, params, token_lists) == plain, arch
    assert squeezed.scheduler.num_preemptions > 0


TOP_K = 6
NUM_SEEDS = 600


@pytest.mark.parametrize("agreement", ["often", "rarely"])
def test_sampled_first_tokens_keep_the_model_distribution(llama_model, agreement):
    """600 seeded requests (temperature 1, top_k 6), 3 tokens each. With speculation every
    request gives the tokens it gives without (the verify rows use plain decoding's seeds), and the
    first token's empirical distribution is within total-variation distance 0.08 of the model's
    exact top-6 probabilities (expected distance for 600 draws over 6 tokens: about 0.035; a
    sampler that kept the draft whenever it was allowed would move ~all mass onto it)."""
    path = llama_model
    prompt = prompts(1)[0]
    probe = make_engine(path)
    logits = probe.runner.execute(_single_plan(prompt, probe))[-1]
    values, ids = logits.topk(TOP_K)
    probs = torch.zeros_like(logits)
    probs[ids] = torch.softmax(values, dim=-1)
    top, least = int(ids[0]), int(ids[-1])
    draft = [top] * 3 if agreement == "often" else [int(logits.argmin())] * 3
    token_lists = {str(i): prompt for i in range(NUM_SEEDS)}
    params = {str(i): SamplingParams(temperature=1.0, top_k=TOP_K, seed=1000 + i, max_tokens=3,
                                     ignore_eos=True) for i in range(NUM_SEEDS)}
    plain = generate(make_engine(path), params, token_lists)
    engine = make_engine(path, "NGRAM", ReplayProposer(fixed=draft), k=3)
    speculative = generate(engine, params, token_lists)
    assert speculative == plain
    stats = engine.stats()
    if agreement == "often":  # the first draft alone is kept with probability p(top)
        assert stats["spec_num_accepted_tokens"] > 0.7 * NUM_SEEDS * float(probs[top]), stats
    else:  # a token outside the top 6 can never be sampled
        assert stats["spec_num_accepted_tokens"] == 0 and stats["spec_num_draft_tokens"] > 0, stats
    counts = torch.zeros_like(probs)
    for tokens in speculative.values():
        counts[tokens[0]] += 1
    distance = 0.5 * float((counts / NUM_SEEDS - probs).abs().sum())
    print(f"TV distance {distance:.4f}, top-6 probabilities {probs[ids].tolist()}")
    assert distance < 0.08, (distance, probs[ids].tolist(), least)


def _single_plan(prompt: list[int], engine: LLMEngine):
    from servelm.model.forward_batch import BatchPlan, SequencePlan

    num_blocks = -(-len(prompt) // engine.runner.block_size)
    return BatchPlan([SequencePlan(prompt, 0, list(range(num_blocks)), num_logits=1)])


def second_token_distance(engine: LLMEngine, prompt: list[int], outputs: dict[str, list[int]],
                          top_k: int) -> tuple[float, dict[int, float], int]:
    """Total-variation distance between the second tokens sampled after the most frequent first
    token and the target's exact top-``top_k`` distribution there; also that distribution and the
    number of draws it compares (the sampling-exactness tests of every proposer)."""
    firsts = [tokens[0] for tokens in outputs.values()]
    first = max(set(firsts), key=firsts.count)
    seconds = [tokens[1] for tokens in outputs.values() if tokens[0] == first]
    logits = engine.runner.execute(_single_plan(prompt + [first], engine))[-1]
    values, ids = logits.topk(top_k)
    exact = dict(zip(ids.tolist(), torch.softmax(values, dim=-1).tolist()))
    distance = 0.5 * sum(abs(seconds.count(t) / len(seconds) - exact.get(t, 0.0))
                         for t in set(seconds) | set(exact))
    return distance, exact, len(seconds)


class RecordingNgram(NgramProposer):
    """The n-gram proposer, keeping the length of every draft it proposes."""

    def __init__(self, length: str) -> None:
        super().__init__(1, 16, length)
        self.lengths: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = super().propose(requests)
        self.lengths.extend(len(d.token_ids) for d in drafts)
        return drafts


@pytest.mark.parametrize("length", ["adaptive", "fixed"])
def test_greedy_identical_with_adaptive_and_fixed_ngram_lengths(tiny_model, length):
    """Both draft-length policies give plain decoding's tokens. Each prompt is followed by its own
    plain output and then itself again, so the model's answer partly copies earlier text: the
    adaptive drafts take several lengths (short after cuts and on weak matches, long on copied
    runs) up to the 16 allowed."""
    arch, path = tiny_model
    first = {str(i): p for i, p in enumerate(prompts())}
    answers = generate(make_engine(path), greedy_all(first, max_tokens=40), first)
    token_lists = {r: first[r] + answers[r] + first[r] for r in first}
    params = greedy_all(token_lists, max_tokens=60)
    plain = generate(make_engine(path), params, token_lists)
    proposer = RecordingNgram(length)
    engine = make_engine(path, "NGRAM", proposer, k=16)
    assert generate(engine, params, token_lists) == plain, (arch, length)
    drafted = [n for n in proposer.lengths if n]
    assert drafted and engine.stats()["spec_num_accepted_tokens"] > 0
    if length == "adaptive":
        assert proposer.num_observed > 0 and len(set(drafted)) >= 3 and max(drafted) > 8, proposer.lengths
        assert not proposer._streams   # every finished request released its state
