"""The STANDALONE draft-model proposer on tiny random-weight checkpoints (float32, vocab 320).

Target: tiny qwen2. Drafts: a copy with slightly perturbed weights (agrees often, not always) and
a tiny llama with other random weights (agrees rarely); both share the vocabulary. Greedy output
is identical to plain decoding (chunked prefill, preemption, max_tokens cut inside an accepted
run); sampling keeps the model's distribution (rejection sampling against the draft's q); the
draft's KV pool goes back to empty; a draft with another vocabulary is refused at start-up.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.e2e.test_speculative_tiny import generate, greedy_all, prompts
from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-models")
    target = make_tiny_model_dir(root, "qwen2")
    close = root / "close"
    shutil.copytree(target, close)
    weights = load_file(str(close / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    weights = {name: tensor + 0.003 * torch.randn(tensor.shape, generator=generator)
               for name, tensor in weights.items()}
    save_file(weights, str(close / "model.safetensors"))
    far = make_tiny_model_dir(root, "llama", seed=7)
    return {"target": target, "close": close, "far": far, "root": root}


def make_engine(target, draft=None, max_total_tokens: int = 4096, chunk: int = -1,
                k: int = 4, seed: int = 0) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(target), skip_tokenizer_init=True, dtype="float32", seed=seed),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=2048),
        speculative=SpeculativeConfig(
            speculative_draft_model_path=None if draft is None else str(draft),
            num_speculative_tokens=k),
    )
    return LLMEngine(config)


def test_greedy_identical_with_a_draft_model(models):
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=37)  # not a multiple of k + 1: cut inside a run
    plain = generate(make_engine(models["target"]), params, token_lists)
    for name in ("close", "far"):
        engine = make_engine(models["target"], models[name])
        assert engine.config.speculative.speculative_algorithm == "STANDALONE"
        assert generate(engine, params, token_lists) == plain, name
        stats = engine.stats()
        assert stats["spec_draft_used_blocks"] == 0, stats  # every request released its KV
        if name == "close":
            assert stats["spec_accept_length"] > 2.5 and stats["spec_acceptance_rate"] < 1.0, stats
        else:
            assert stats["spec_acceptance_rate"] < 0.5, stats


def test_greedy_identical_under_chunked_prefill_and_preemption(models):
    token_lists = {str(i): p for i, p in enumerate(prompts(8))}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(models["target"]), params, token_lists)
    squeezed = make_engine(models["target"], models["close"], max_total_tokens=160, chunk=7)
    assert generate(squeezed, params, token_lists) == plain
    assert squeezed.scheduler.num_preemptions > 0
    assert squeezed.stats()["spec_draft_used_blocks"] == 0


NUM_SEEDS = 600
TOP_K = 4


@pytest.mark.parametrize("draft", ["close", "far"])
def test_sampled_tokens_keep_the_model_distribution(models, draft):
    """600 seeded requests (temperature 1, top_k 4), 3 tokens each. The first token is sampled
    at prefill; the second is the first one verified against the draft (rejection sampling with
    the draft's q). Among requests whose first token is the most frequent one, the second token's
    empirical distribution is within total-variation distance 0.1 of the model's exact top-4
    probabilities after that token (expected distance for ~300 draws over 4 tokens: about 0.04;
    keeping every draft the model could sample would shift the mass to the draft's favourite)."""
    from tests.e2e.test_speculative_tiny import second_token_distance

    prompt = prompts(1)[0]
    token_lists = {str(i): prompt for i in range(NUM_SEEDS)}
    params = {str(i): SamplingParams(temperature=1.0, top_k=TOP_K, seed=1000 + i, max_tokens=3,
                                     ignore_eos=True) for i in range(NUM_SEEDS)}
    engine = make_engine(models["target"], models[draft], k=1)
    speculative = generate(engine, params, token_lists)
    stats = engine.stats()
    if draft == "close":
        assert stats["spec_acceptance_rate"] > 0.6, stats
    else:
        assert stats["spec_acceptance_rate"] < 0.5, stats
    distance, exact, num_seconds = second_token_distance(engine, prompt, speculative, TOP_K)
    print(f"{draft}: {num_seconds} draws, TV distance {distance:.3f}, acceptance "
          f"{stats['spec_acceptance_rate']:.2f}")
    assert distance < 0.1, (draft, distance, exact)


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(models["far"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 256
    (other / "config.json").write_text(json.dumps(config))
    weights = load_file(str(other / "model.safetensors"))
    weights = {name: tensor[:256] if tensor.shape[0] == 320 and "embed" in name or "lm_head" in name
               else tensor for name, tensor in weights.items()}
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        make_engine(models["target"], other)


def test_draft_model_is_refused_with_tensor_parallelism(models):
    from servelm.config import ParallelConfig

    config = EngineConfig(
        model=ModelConfig(model=str(models["target"]), skip_tokenizer_init=True, dtype="float32"),
        parallel=ParallelConfig(tensor_parallel_size=2),
        speculative=SpeculativeConfig(speculative_draft_model_path=str(models["close"])))
    with pytest.raises(ValueError, match="--tp-size"):
        LLMEngine(config)


def test_rejected_drafts_never_enter_the_prefix_cache(models):
    """With the far draft (most drafts rejected) and the prefix cache on, every cached block lies
    on the request's real token path, and a later request that leaves that path reuses only the
    real prefix and still decodes exactly."""
    prompt = prompts(1)[0]
    params = greedy_all({"a": prompt}, max_tokens=40)
    engine = make_engine(models["target"], models["far"])
    path = prompt + generate(engine, params, {"a": prompt})["a"]
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 40 and stats["spec_acceptance_rate"] < 0.5, stats
    cache = engine.prefix_cache
    assert cache is not None
    assert cache.num_blocks == cache.match_length(path, None) // 8 == (len(path) - 1) // 8
    follow = path[:30] + [(path[30] + 1) % 320] + path[31:36]
    follow_params = greedy_all({"b": follow}, max_tokens=10)
    plain = generate(make_engine(models["target"]), follow_params, {"b": follow})
    assert generate(engine, follow_params, {"b": follow}) == plain
    assert engine.stats()["spec_draft_used_blocks"] == 0


def test_sampled_logprobs_are_those_of_the_emitted_tokens(models):
    """A sampling request with logprobs under rejection sampling gets one entry per emitted token,
    each the model's log-probability of that token (the verify rows' own distributions)."""
    prompt = prompts(1)[0]
    engine = make_engine(models["target"], models["close"])
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, logprobs=2, ignore_eos=True)
    assert engine.add_request("a", prompt, params) is None
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
            logprobs.extend(output.logprobs or [])
    assert len(tokens) == len(logprobs) == 20
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert [entry.token_id for entry in logprobs] == tokens
    assert all(entry.logprob <= 0.0 for entry in logprobs)
