"""EAGLE draft trees (--speculative-eagle-topk > 1) on tiny random-weight models (float32).

No trained head exists offline: the random heads' trees are almost never accepted past the root,
while the copying head (``tests.eagle_heads.make_copying_head``) predicts its one-layer model, so
its trees are accepted deep and sometimes along a branch other than the first child (the K/V of
that path is then moved next to the root: ``Scheduler.pending_slot_copies``). Greedy output equals
plain decoding whatever the tree; sampling keeps the model's distribution.
"""

from __future__ import annotations

import pytest

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.e2e.test_speculative_eagle_tiny import make_engine as make_chain_engine
from tests.e2e.test_speculative_tiny import generate, greedy_all, prompts
from tests.eagle_heads import make_copying_head, make_one_layer_target, make_random_head
from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-tree")
    found = {"root": root}
    for arch in ("qwen2", "gemma3"):
        found[arch] = make_tiny_model_dir(root, arch)
    found["qwen2-EAGLE3"] = make_random_head("qwen2", "EAGLE3", root / "qwen2-EAGLE3")
    found["gemma3-EAGLE"] = make_random_head("gemma3", "EAGLE", root / "gemma3-EAGLE")
    found["one-layer"] = make_one_layer_target(root)
    found["copying"] = make_copying_head(found["one-layer"], root / "copying")
    return found


def make_engine(target, algorithm=None, head=None, topk: int | None = None, steps: int | None = None,
                num_drafts: int = 4, max_total_tokens: int = 4096, chunk: int = -1,
                prefix_cache: bool = True) -> LLMEngine:
    """The chain tests' engine (test_speculative_eagle_tiny) with a tree's topk and depth."""
    return make_chain_engine(target, algorithm, head, max_total_tokens, chunk, num_drafts,
                             prefix_cache=prefix_cache, topk=topk, steps=steps)


def count_slot_copies(engine: LLMEngine) -> list[int]:
    """Spy on the speculation stage: the K/V slot copies each step makes after its update."""
    counts: list[int] = []
    original = engine.speculation.move_accepted_paths

    def move(scheduler, runner):
        counts.append(len(scheduler.kv.pending_slot_copies))
        original(scheduler, runner)
        assert not scheduler.kv.pending_slot_copies

    engine.speculation.move_accepted_paths = move
    return counts


def count_trees(engine: LLMEngine) -> list[int]:
    """Spy on the scheduler: the draft trees each step verifies."""
    counts: list[int] = []
    original = engine.scheduler.schedule

    def schedule():
        output = original()
        counts.append(sum(1 for s in output.scheduled if s.draft_parents is not None))
        return output

    engine.scheduler.schedule = schedule
    return counts


@pytest.mark.parametrize("target, head, algorithm, topk, steps, num_drafts", [
    ("qwen2", "qwen2-EAGLE3", "EAGLE3", 2, 2, 3),
    ("qwen2", "qwen2-EAGLE3", "EAGLE3", 4, 3, 8),
    ("gemma3", "gemma3-EAGLE", "EAGLE", 3, 2, 5),      # sliding-window layers under the tree mask
])
def test_greedy_identical_with_random_head_trees(models, target, head, algorithm, topk, steps,
                                                 num_drafts):
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=29)
    plain = generate(make_engine(models[target]), params, token_lists)
    engine = make_engine(models[target], algorithm, models[head], topk, steps, num_drafts)
    assert generate(engine, params, token_lists) == plain
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 100, stats
    assert stats["spec_draft_used_blocks"] == 0, stats


@pytest.mark.parametrize("topk, steps, num_drafts", [(2, 4, 6), (3, 3, 7), (4, 2, 5)])
def test_copying_head_trees_are_accepted_exactly(models, topk, steps, num_drafts):
    """Deep acceptance, some of it along later branches (slot copies), output still exact, and
    a max_tokens (29) that cuts inside an accepted run."""
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=29)
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    engine = make_engine(models["one-layer"], "EAGLE", models["copying"], topk, steps, num_drafts)
    copies = count_slot_copies(engine)
    assert generate(engine, params, token_lists) == plain
    assert all(len(tokens) == 29 for tokens in plain.values())
    stats = engine.stats()
    print(f"topk {topk} steps {steps} nodes {num_drafts}: accept length "
          f"{stats['spec_accept_length']:.2f}, slot copies {sum(copies)}")
    assert stats["spec_accept_length"] > 2.0, stats
    assert sum(copies) > 0               # some accepted paths took a later branch
    assert stats["spec_draft_used_blocks"] == 0


def test_tree_under_chunked_prefill_preemption_and_prefix_hits(models):
    token_lists = {str(i): p for i, p in enumerate(prompts(8))}
    params = greedy_all(token_lists, max_tokens=30)
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    squeezed = make_engine(models["one-layer"], "EAGLE", models["copying"], 2, 3, 5,
                           max_total_tokens=200, chunk=7)
    assert generate(squeezed, params, token_lists) == plain
    assert squeezed.scheduler.num_preemptions > 0
    again = generate(squeezed, params, token_lists)   # prompts now hit the prefix cache
    assert again == plain and squeezed.stats()["cache_hit_rate"] > 0


def test_rejected_tree_nodes_never_enter_the_prefix_cache(models):
    """Every cached block lies on the real token path (the accepted path's K/V was moved next to
    the root before anything read it), and a request that leaves the path after a shared prefix
    decodes exactly."""
    prompt = prompts(1)[0]
    params = greedy_all({"a": prompt}, max_tokens=40)
    engine = make_engine(models["one-layer"], "EAGLE", models["copying"], 3, 3, 7)
    copies = count_slot_copies(engine)
    path = prompt + generate(engine, params, {"a": prompt})["a"]
    cache = engine.prefix_cache
    assert cache is not None
    assert cache.num_blocks == cache.match_length(path, None) // 8 == (len(path) - 1) // 8
    follow = path[:30] + [(path[30] + 1) % 320] + path[31:36]
    follow_params = greedy_all({"b": follow}, max_tokens=12)
    plain = generate(make_engine(models["one-layer"]), follow_params, {"b": follow})
    assert generate(engine, follow_params, {"b": follow}) == plain
    assert engine.stats()["spec_draft_used_blocks"] == 0
    assert sum(copies) > 0


def test_mixed_batch_trees_chains_and_no_drafts(models):
    """Greedy requests with trees beside ones whose max_tokens leaves room for one draft only
    (a chain) or none, and a seeded sampling request (its tree verified with its own samples,
    seeded per output position): all equal plain decoding."""
    token_lists = {str(i): p for i, p in enumerate(prompts(5))}
    params = {"0": SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
              "1": SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
              "2": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              "3": SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
              "4": SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=15, ignore_eos=True)}
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    first = generate(make_engine(models["one-layer"], "EAGLE", models["copying"], 2, 3, 5),
                     params, token_lists)
    second = generate(make_engine(models["one-layer"], "EAGLE", models["copying"], 2, 3, 5),
                      params, token_lists)
    assert first == second == plain and len(first["4"]) == 15


def test_typical_acceptance_walks_trees(models):
    """--spec-decoding-acceptance-method typical_acceptance_sampler: a sampling request's tree is
    walked with the typical rule (longer accepted runs, not the model's distribution exactly);
    greedy requests beside it still equal plain decoding."""
    token_lists = {str(i): p for i, p in enumerate(prompts(3))}
    params = {"0": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              "1": SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True, logprobs=1),
              "2": SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)}
    plain = generate(make_engine(models["one-layer"]), params, token_lists)
    config = EngineConfig(
        model=ModelConfig(model=str(models["one-layer"]), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=4096, page_size=8),
        speculative=SpeculativeConfig(
            speculative_algorithm="EAGLE", speculative_draft_model_path=str(models["copying"]),
            num_speculative_tokens=5, speculative_eagle_topk=2, speculative_num_steps=3,
            spec_decoding_acceptance_method="typical_acceptance_sampler"))
    engine = LLMEngine(config)
    trees = count_trees(engine)
    typical = generate(engine, params, token_lists)
    assert typical["0"] == plain["0"]
    assert all(len(tokens) == 20 for tokens in typical.values())
    assert sum(trees) > 10 and engine.stats()["spec_accept_length"] > 1.5


NUM_SEEDS = 400
TOP_K = 4


def test_sampled_tokens_keep_the_model_distribution_with_trees(models):
    """400 seeded requests (temperature 1, top_k 4), 5 tokens each, trees of 3 nodes (topk 2,
    2 steps): among those whose first token is the most frequent one, the second token (the root
    row of the first tree, accepted when a child carries the model's sample) is within
    total-variation distance 0.12 of the model's exact top-4 probabilities (expected for 100-200
    draws over 4 tokens: 0.05-0.07). Stronger: a tree's rows are sampled with the seeded stream
    of their output position, so every request's tokens equal plain seeded sampling's."""
    from tests.e2e.test_speculative_tiny import second_token_distance

    prompt = prompts(1)[0]
    token_lists = {str(i): prompt for i in range(NUM_SEEDS)}
    params = {str(i): SamplingParams(temperature=1.0, top_k=TOP_K, seed=1000 + i, max_tokens=5,
                                     ignore_eos=True) for i in range(NUM_SEEDS)}
    engine = make_engine(models["one-layer"], "EAGLE", models["copying"], 2, 2, 3)
    num_trees = count_trees(engine)
    speculative = generate(engine, params, token_lists)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] >= NUM_SEEDS
    distance, exact, num_seconds = second_token_distance(engine, prompt, speculative, TOP_K)
    print(f"trees: {num_seconds} draws, TV distance {distance:.3f}, acceptance "
          f"{stats['spec_acceptance_rate']:.2f}, accept length {stats['spec_accept_length']:.2f}")
    assert distance < 0.12, (distance, exact)
    assert sum(num_trees) >= NUM_SEEDS
    assert speculative == generate(make_engine(models["one-layer"]), params, token_lists)
