"""EAGLE and EAGLE-3 heads on tiny random-weight models (float32, vocab 320).

No trained head exists offline: the heads here are random-weight checkpoints in the published
formats (``servelm.model.eagle_checkpoint``), whose drafts are almost never accepted, plus one head
built to predict its model (``tests.eagle_heads.make_copying_head``: a copy of a one-layer
target's layer), whose drafts mostly are. Greedy output equals plain decoding whatever the head
(chunked prefill, preemption, prefix-cache hits, max_tokens inside a run); the head's pool goes
back to empty; bad checkpoints are refused at start-up with the tensor named.
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
from tests.eagle_heads import make_copying_head, make_one_layer_target, make_random_head
from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    found = {"root": root}
    for arch in ("qwen2", "gemma3"):
        found[arch] = make_tiny_model_dir(root, arch)
        for algorithm in ("EAGLE", "EAGLE3"):
            found[f"{arch}-{algorithm}"] = make_random_head(arch, algorithm, root / f"{arch}-{algorithm}")
    found["one-layer"] = make_one_layer_target(root)
    found["copying"] = make_copying_head(found["one-layer"], root / "copying")
    return found


def make_engine(target, algorithm=None, head=None, max_total_tokens: int = 4096, chunk: int = -1,
                k: int = 4, token_map: str | None = None, prefix_cache: bool = True, *,
                topk: int | None = None, steps: int | None = None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(target), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=max_total_tokens, page_size=8,
                          disable_radix_cache=not prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=2048),
        speculative=SpeculativeConfig(
            speculative_algorithm=algorithm,
            speculative_draft_model_path=None if head is None else str(head),
            num_speculative_tokens=k, speculative_token_map=token_map, speculative_eagle_topk=topk,
            speculative_num_steps=steps),
    )
    return LLMEngine(config)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_greedy_identical_with_a_random_head(models, arch, algorithm):
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=37)  # not a multiple of k + 1: cut inside a run
    plain = generate(make_engine(models[arch]), params, token_lists)
    engine = make_engine(models[arch], algorithm, models[f"{arch}-{algorithm}"])
    assert generate(engine, params, token_lists) == plain
    stats = engine.stats()
    assert stats["speculative_algorithm"] == algorithm
    assert stats["spec_num_draft_tokens"] > 100 and "spec_acceptance_rate" in stats, stats
    assert stats["spec_draft_used_blocks"] == 0, stats   # every request released the head's KV


def test_a_head_that_copies_the_model_is_accepted(models):
    """The copying head (see tests/eagle_heads.py) drafts what the model then says most of the
    time: the chain's positions, features and rollback line up; output is still exact."""
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=40)
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    engine = make_engine(models["one-layer"], "EAGLE", models["copying"])
    assert generate(engine, params, token_lists) == plain
    stats = engine.stats()
    print(f"copying head: acceptance {stats['spec_acceptance_rate']:.3f}, "
          f"accept length {stats['spec_accept_length']:.2f}")
    assert stats["spec_acceptance_rate"] > 0.7 and stats["spec_accept_length"] > 3.0, stats
    random_head = make_engine(models["one-layer"], "EAGLE",
                              make_random_head("llama", "EAGLE", models["root"] / "random-1layer"))
    generate(random_head, params, token_lists)
    assert random_head.stats()["spec_acceptance_rate"] < 0.2


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_greedy_identical_under_chunked_prefill_and_preemption(models, algorithm):
    token_lists = {str(i): p for i, p in enumerate(prompts(8))}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(models["gemma3"]), params, token_lists)
    squeezed = make_engine(models["gemma3"], algorithm, models[f"gemma3-{algorithm}"],
                           max_total_tokens=160, chunk=7)
    assert generate(squeezed, params, token_lists) == plain
    assert squeezed.scheduler.num_preemptions > 0
    assert squeezed.stats()["spec_draft_used_blocks"] == 0


def test_copying_head_under_chunked_prefill_preemption_and_prefix_hits(models):
    """Features arrive per chunk (and are written into the head's KV ahead of a propose once more
    than 5 wait), a preempted request restarts its head state, and a prefix-cache hit starts the
    head at the first computed position: outputs stay exact and drafts are still accepted."""
    token_lists = {str(i): p for i, p in enumerate(prompts(8))}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    squeezed = make_engine(models["one-layer"], "EAGLE", models["copying"], max_total_tokens=160,
                           chunk=7)
    squeezed.speculation.proposer.absorb_rows = 5   # long pending features written ahead too
    assert generate(squeezed, params, token_lists) == plain
    assert squeezed.scheduler.num_preemptions > 0
    assert squeezed.stats()["spec_acceptance_rate"] > 0.5
    again = generate(squeezed, params, token_lists)   # prompts now hit the prefix cache
    assert again == plain and squeezed.stats()["cache_hit_rate"] > 0


def test_rejected_drafts_never_enter_the_prefix_cache(models):
    """A random head's drafts are rejected; every cached block lies on the real token path, and a
    request that leaves the path reuses only the real prefix and still decodes exactly."""
    prompt = prompts(1)[0]
    params = greedy_all({"a": prompt}, max_tokens=40)
    engine = make_engine(models["qwen2"], "EAGLE3", models["qwen2-EAGLE3"])
    path = prompt + generate(engine, params, {"a": prompt})["a"]
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 40 and stats["spec_acceptance_rate"] < 0.5, stats
    cache = engine.prefix_cache
    assert cache is not None
    assert cache.num_blocks == cache.match_length(path, None) // 8 == (len(path) - 1) // 8
    follow = path[:30] + [(path[30] + 1) % 320] + path[31:36]
    follow_params = greedy_all({"b": follow}, max_tokens=10)
    plain = generate(make_engine(models["qwen2"]), follow_params, {"b": follow})
    assert generate(engine, follow_params, {"b": follow}) == plain
    assert engine.stats()["spec_draft_used_blocks"] == 0


def test_sampling_with_a_reduced_vocabulary_head(models):
    """EAGLE-3's drafts come from its 160-token draft vocabulary, mapped to model ids; sampled
    drafts go through rejection sampling with the head's distribution over the model's vocabulary
    (zero outside the draft vocabulary). Seeded sampling stays reproducible."""
    prompt = prompts(1)[0]
    params = {str(i): SamplingParams(temperature=1.0, top_k=8, seed=40 + i, max_tokens=12,
                                     ignore_eos=True) for i in range(6)}
    token_lists = {key: prompt for key in params}
    first = generate(make_engine(models["qwen2"], "EAGLE3", models["qwen2-EAGLE3"]), params, token_lists)
    second = generate(make_engine(models["qwen2"], "EAGLE3", models["qwen2-EAGLE3"]), params, token_lists)
    assert first == second and all(len(tokens) == 12 for tokens in first.values())


def test_token_map_restricts_eagle_drafts(models, tmp_path):
    hot = torch.arange(0, 320, 2)
    path = tmp_path / "hot.pt"
    torch.save(hot, path)
    token_lists = {str(i): p for i, p in enumerate(prompts(3))}
    params = greedy_all(token_lists, max_tokens=20)
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    engine = make_engine(models["one-layer"], "EAGLE", models["copying"], token_map=str(path))
    proposer = engine.speculation.proposer
    drafted: list[int] = []
    original = proposer.propose

    def spy(requests):
        drafts = original(requests)
        drafted.extend(t for d in drafts for t in d.token_ids)
        return drafts

    proposer.propose = spy
    assert generate(engine, params, token_lists) == plain
    assert drafted and all(t % 2 == 0 for t in drafted)


def _broken_head(models, tmp_path, edit) -> str:
    head = tmp_path / "broken"
    shutil.copytree(models["qwen2-EAGLE3"], head)
    tensors = load_file(str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(head / "model.safetensors"))
    (head / "config.json").write_text(json.dumps(config))
    return str(head)


@pytest.mark.parametrize("edit, message", [
    (lambda t, c: t.pop("midlayer.hidden_norm.weight"), "lacks 1 tensors.*midlayer.hidden_norm"),
    (lambda t, c: t.update({"fc.weight": t["fc.weight"][:, :128].contiguous()}), "'fc.weight' has shape"),
    (lambda t, c: t.update({"layers.1.extra.weight": torch.zeros(2)}), "not part of the"),
    (lambda t, c: c.update({"architectures": ["LlamaForCausalLMEagle"]}),
     "an EAGLE head: --speculative-algorithm EAGLE"),
    (lambda t, c: c.update({"architectures": ["LlamaForCausalLM"]}), "reads LlamaForCausalLMEagle3"),
    (lambda t, c: t.update({"d2t": t["d2t"] + 400}), "outside the model's"),
    (lambda t, c: c.update({"target_hidden_size": 32}), "hidden states of width 32"),
])
def test_bad_checkpoints_are_refused(models, tmp_path, edit, message):
    head = _broken_head(models, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        make_engine(models["qwen2"], "EAGLE3", head)


def test_eagle_is_refused_with_tensor_parallelism(models):
    from servelm.config import ParallelConfig

    config = EngineConfig(
        model=ModelConfig(model=str(models["qwen2"]), skip_tokenizer_init=True, dtype="float32"),
        parallel=ParallelConfig(tensor_parallel_size=2),
        speculative=SpeculativeConfig(speculative_algorithm="EAGLE",
                                      speculative_draft_model_path=str(models["qwen2-EAGLE"])))
    with pytest.raises(ValueError, match="--tp-size"):
        LLMEngine(config)


NUM_SEEDS = 400
TOP_K = 4


@pytest.mark.parametrize("target, head, algorithm", [("one-layer", "copying", "EAGLE"),
                                                     ("qwen2", "qwen2-EAGLE3", "EAGLE3")])
def test_sampled_tokens_keep_the_model_distribution(models, target, head, algorithm):
    """400 seeded requests (temperature 1, top_k 4), 3 tokens each: among requests whose first
    token is the most frequent one, the second token (the first verified against the head's
    draft by rejection sampling) is within total-variation distance 0.12 of the model's exact
    top-4 probabilities (expected distance for 100-200 draws over 4 tokens: 0.05-0.07). The
    copying head has the model's argmax but a sharper distribution (EAGLE-1 has no final norm,
    so its logits are the model's times the hidden state's RMS): 11% of its sampled drafts are
    accepted; the random EAGLE-3 head drafts from its reduced vocabulary (none accepted)."""
    from tests.e2e.test_speculative_tiny import second_token_distance

    prompt = prompts(1)[0]
    token_lists = {str(i): prompt for i in range(NUM_SEEDS)}
    params = {str(i): SamplingParams(temperature=1.0, top_k=TOP_K, seed=1000 + i, max_tokens=3,
                                     ignore_eos=True) for i in range(NUM_SEEDS)}
    engine = make_engine(models[target], algorithm, models[head], k=1)
    speculative = generate(engine, params, token_lists)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] >= NUM_SEEDS
    distance, exact, num_seconds = second_token_distance(engine, prompt, speculative, TOP_K)
    print(f"{head}: {num_seconds} draws, TV distance {distance:.3f}, acceptance "
          f"{stats['spec_acceptance_rate']:.2f}")
    assert distance < 0.12, (head, distance, exact)


def test_an_eagle1_head_declaring_the_plain_llama_name_loads(models, tmp_path):
    """The EAGLE authors' EAGLE-1 heads declare LlamaForCausalLM: accepted for EAGLE (their
    tensors are checked), while a whole Llama model given as the head is refused by its tensors."""
    head = tmp_path / "plain-name"
    shutil.copytree(models["qwen2-EAGLE"], head)
    config = json.loads((head / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (head / "config.json").write_text(json.dumps(config))
    token_lists = {"0": prompts(1)[0]}
    params = greedy_all(token_lists, max_tokens=8)
    assert generate(make_engine(models["qwen2"], "EAGLE", head), params, token_lists) == \
        generate(make_engine(models["qwen2"]), params, token_lists)
    with pytest.raises(ValueError, match="not part of the"):
        make_engine(models["one-layer"], "EAGLE", models["one-layer"])
