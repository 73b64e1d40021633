"""NEXTN: a tiny DeepSeek-V3's own multi-token-prediction layer drafts (float32, vocab 320).

The MTP tensors are written into the tiny checkpoint in the published naming (``tests/mtp_layers.py``).
The layer's logits and output feature equal a reference built from transformers' DeepSeek-V3
decoder layer; greedy output equals plain decoding token for token (a mixed batch, chunked prefill,
prefix-cache hits), whether the drafts are rejected (a random MTP layer) or accepted (a copying one
over a target whose next token depends on the current token only); a model without an MTP layer is
refused at start-up with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.spec.draft_model import DraftSequence
from tests.e2e.test_speculative_tiny import generate, greedy_all, prompts
from tests.mtp_layers import ARCH, MTP_SEED, make_bigram_with_copying_mtp, write_random_mtp_layer
from tests.tiny_models import make_tiny_hf_model, make_tiny_model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nextn")
    return {"random": write_random_mtp_layer(root), "bigram": make_bigram_with_copying_mtp(root),
            "root": root}


def make_engine(path, algorithm: str | None = None, steps: int = 3, topk: int | None = None,
                load_format: str = "auto", disable_mla: bool = False) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32",
                          load_format=load_format, disable_mla=disable_mla),
        cache=CacheConfig(max_total_tokens=4096, page_size=8),
        scheduler=SchedulerConfig(chunked_prefill_size=16, max_prefill_tokens=256),
        speculative=SpeculativeConfig(speculative_algorithm=algorithm,
                                      speculative_num_steps=steps if algorithm else None,
                                      speculative_eagle_topk=topk))
    return LLMEngine(config)


@pytest.fixture(scope="module")
def random_nextn(models):
    return make_engine(models["random"], "NEXTN")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceMtp:
    """DeepSeek-V3's MTP module from transformers' parts and the checkpoint's MTP norms and
    ``eh_proj``: entry p (position p) reads ``tokens[p]`` and ``features[p]``; ``__call__`` returns
    every entry's logits and output hidden state."""

    def __init__(self, path: Path) -> None:
        self.target = make_tiny_hf_model(ARCH)
        self.layer = make_tiny_hf_model(ARCH, seed=MTP_SEED).model.layers[2]   # the MTP layer's source
        prefix = f"model.layers.{self.target.config.num_hidden_layers}."
        self.mtp = {name.removeprefix(prefix): t for name, t in load_file(str(path / "model.safetensors")).items()
                    if name.startswith(prefix)}

    def __call__(self, tokens: list[int], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target, mtp, eps = self.target, self.mtp, self.target.config.rms_norm_eps
        with torch.no_grad():
            ids = torch.tensor(tokens)
            x = torch.cat((_rms(target.model.embed_tokens(ids), mtp["enorm.weight"], eps),
                           _rms(features, mtp["hnorm.weight"], eps)), dim=-1) @ mtp["eh_proj.weight"].T
            positions = torch.arange(len(tokens))[None]
            mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
            hidden = self.layer(x[None], attention_mask=mask, position_ids=positions,
                                position_embeddings=target.model.rotary_emb(x[None], positions))
            hidden = (hidden[0] if isinstance(hidden, tuple) else hidden)[0]
            return target.lm_head(_rms(hidden, mtp["shared_head.norm.weight"], eps)), hidden


def test_mtp_layer_matches_a_transformers_reference(models, random_nextn):
    """Catch-up entries of three prompts in one batch (the model's last hidden states as features),
    then a chained entry that reads the layer's own output: logits and features equal the reference."""
    head = random_nextn.speculation.proposer.runner
    reference_mtp = ReferenceMtp(models["random"])
    target = reference_mtp.target
    sequences, features, expected = [], [], []
    for index, prompt in enumerate(prompts(3)):
        with torch.no_grad():
            hidden = target.model(torch.tensor([prompt])).last_hidden_state[0]   # after the final norm
        blocks = list(range(8 * index, 8 * index + 8))
        sequences.append(DraftSequence(prompt[1:], 0, blocks))
        features.append(hidden[:-1])
        expected.append((prompt[1:], hidden[:-1]))
    logits, feature = head.forward(sequences, torch.cat(features), True)
    chained_logits, _ = head.forward([DraftSequence([7], len(s.token_ids), s.block_ids) for s in sequences],
                                     feature, False)
    for row, (tokens, hidden) in enumerate(expected):
        reference_logits, reference_hidden = reference_mtp(tokens, hidden)
        torch.testing.assert_close(logits[row], reference_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feature[row], reference_hidden[-1], atol=1e-4, rtol=1e-4)
        chained, _ = reference_mtp(tokens + [7], torch.cat((hidden, reference_hidden[-1:])))
        torch.testing.assert_close(chained_logits[row], chained[-1], atol=1e-4, rtol=1e-4)


def test_greedy_identical_with_a_random_mtp_layer(models, random_nextn):
    """Six prompts of mixed lengths in one batch, chunked, then again from the prefix cache: the
    random layer's drafts are verified (counted) and the tokens are plain decoding's."""
    token_lists = {str(i): p for i, p in enumerate(prompts())}
    params = greedy_all(token_lists, max_tokens=22)
    plain = generate(make_engine(models["random"]), params, token_lists)
    assert generate(random_nextn, params, token_lists) == plain
    assert generate(random_nextn, params, token_lists) == plain
    stats = random_nextn.stats()
    assert stats["speculative_algorithm"] == "NEXTN" and stats["cache_hit_rate"] > 0, stats
    assert stats["spec_num_draft_tokens"] > 100 and "spec_acceptance_rate" in stats, stats
    assert stats["spec_draft_used_blocks"] == 0, stats


@pytest.mark.parametrize("topk", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_a_copying_mtp_layer_is_accepted(models, topk):
    """The copying layer (tests/mtp_layers.py) drafts the bigram model's own next tokens: its
    chains of --speculative-num-steps 3 are accepted whole (a tree of topk 2 too), and the output
    is still plain decoding's."""
    token_lists = {str(i): p for i, p in enumerate(prompts(4))}
    params = greedy_all(token_lists, max_tokens=24)
    plain = generate(make_engine(models["bigram"]), params, token_lists)
    engine = make_engine(models["bigram"], "NEXTN", topk=topk)
    assert generate(engine, params, token_lists) == plain
    stats = engine.stats()
    print(f"copying MTP layer (topk {topk}): acceptance {stats['spec_acceptance_rate']:.3f}, "
          f"accept length {stats['spec_accept_length']:.2f}")
    least = 3.5 if topk is None else 2.5   # a chain of 3: up to 4 tokens a pass; a tree's rate is lower
    assert stats["spec_accept_length"] > least, stats


@pytest.mark.slow
def test_mtp_layer_over_expanded_kv(models):
    """--disable-mla: the MTP layer's pool holds per-head K/V as the model's does; same tokens."""
    token_lists = {str(i): p for i, p in enumerate(prompts(3))}
    params = greedy_all(token_lists, max_tokens=16)
    engine = make_engine(models["bigram"], "NEXTN", disable_mla=True)
    assert generate(engine, params, token_lists) == generate(make_engine(models["bigram"]), params, token_lists)
    assert engine.speculation.proposer.runner.kv_cache.v_caches, "per-head V in the MTP layer's pool"
    assert engine.stats()["spec_accept_length"] > 3.5


def _without_mtp_tensors(models) -> Path:
    path = models["root"] / "no-mtp-tensors"
    shutil.copytree(models["random"], path)
    config = json.loads((path / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    tensors = {n: t for n, t in load_file(str(path / "model.safetensors")).items() if not n.startswith(prefix)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_a_model_without_an_mtp_layer_is_refused(models):
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        make_engine(make_tiny_model_dir(models["root"], "llama"), "NEXTN")
    with pytest.raises(ValueError, match="--load-format dummy has no checkpoint"):
        make_engine(models["random"], "NEXTN", load_format="dummy")
    with pytest.raises(ValueError, match=r"has no model\.layers\.3\.\* tensors.*left the MTP weights out"):
        make_engine(_without_mtp_tensors(models), "NEXTN")
