"""Our MPNet encoder against transformers' MPNetModel on a tiny random checkpoint.

Sequences of different lengths share one forward (one of a single token: the decode group's folded
mask path; one of 150 tokens: relative distances past the 128 of the last log bucket), with
shuffled non-contiguous blocks. Mean pooling without normalization returns the mean of the last
hidden state, which is compared to transformers' (atol 1e-5). The relative position buckets are
compared to transformers' own function over every distance in [-300, 300].
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from servelm.model.architectures.mpnet import relative_position_bucket
from servelm.model.registry import get_model_class

from .test_bert import bert_runner, pool_in_one_forward


def tiny_mpnet(seed: int = 0, architecture: str = "MPNetModel") -> Any:
    config = transformers.MPNetConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=200, relative_attention_num_buckets=32)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.MPNetModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "relative_attention_bias" in name:  # off their init values
                param.add_(torch.randn_like(param) * 0.5)
    return model


def test_relative_position_buckets_match_transformers() -> None:
    relative = torch.arange(-300, 301)[None, :]
    expected = MPNetEncoder.relative_position_bucket(relative, num_buckets=32, max_distance=128)
    assert torch.equal(relative_position_bucket(relative, 32, 128), expected)


def test_mpnet_matches_transformers_batched() -> None:
    model = tiny_mpnet()
    runner = bert_runner(model, '{"pooling_type": "mean", "normalize": false}', context_length=198)
    assert runner.task == "embed" and runner.vocab_size == 120
    generator = torch.Generator().manual_seed(1)
    prompts = [[5, 17, 33, 2, 8, 99, 41], [7], torch.randint(3, 120, (150,), generator=generator).tolist(),
               [64, 3], list(range(3, 23))]
    with torch.no_grad():
        for row, prompt in zip(pool_in_one_forward(runner, prompts), prompts, strict=True):
            expected = model(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            torch.testing.assert_close(row, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["MPNetModel", "MPNetForMaskedLM"])
def test_mpnet_checkpoint_names_and_encoder_task(architecture: str) -> None:
    """A masked-LM checkpoint loads its encoder (``mpnet.`` prefix) and skips the LM head."""
    model = tiny_mpnet(architecture=architecture)
    prefix = "mpnet." if architecture == "MPNetForMaskedLM" else ""
    state = {prefix + name: tensor for name, tensor in model.state_dict().items()}
    state["lm_head.dense.weight"] = torch.zeros(32, 32)
    ours = get_model_class(model.config)(model.config)
    loaded = ours.load_weights(state.items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    torch.testing.assert_close(ours.position_bias.weight,
                               model.encoder.relative_attention_bias.weight)
