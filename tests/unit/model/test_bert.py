"""Our BERT encoder against transformers' BertModel on a tiny random checkpoint.

Sequences of different lengths (one of a single token) share one forward, with shuffled
non-contiguous blocks; cls pooling without normalization returns the exact first-token state and
mean pooling the mean over the sequence, so both compare to transformers' last_hidden_state.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model.forward_batch import BatchPlan
from servelm.model.runner import ModelRunner

from .conftest import BLOCK_SIZE, BlockAllocator


def tiny_bert(seed: int = 0) -> Any:
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, type_vocab_size=2)
    config.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:  # move the norms off their identity init
                param.add_(torch.randn_like(param) * 0.1)
    return model


def bert_runner(model: Any, pooler: str, context_length: int = 64) -> ModelRunner:
    """A runner on a tiny transformers encoder's weights (BERT, or MPNet in test_mpnet.py)."""
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    source = SimpleNamespace(hf_config=model.config, weights=lambda: iter(state.items()),
                             tokenizer_path=None, eos_token_ids=[], context_length=context_length,
                             description="tiny encoder", model_path="")
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32",
                                            override_pooler_config=pooler),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=1024))
    return ModelRunner(config, source)


def pool_in_one_forward(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt in one forward, on shuffled non-contiguous blocks."""
    allocator = BlockAllocator(runner.num_blocks, seed=3)
    plan = BatchPlan([allocator.plan(index, prompt, num_logits=0) for index, prompt in enumerate(prompts)])
    for sequence in plan.sequences:
        sequence.is_pooled = True
    return list(runner.pool(plan))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_bert_matches_transformers_batched(pooling: str) -> None:
    model = tiny_bert()
    runner = bert_runner(model, f'{{"pooling_type": "{pooling}", "normalize": false}}')
    assert runner.task == "embed" and runner.vocab_size == 120
    prompts = [[5, 17, 33, 2, 8, 99, 41], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [64, 3]]
    with torch.no_grad():
        for row, prompt in zip(pool_in_one_forward(runner, prompts), prompts, strict=True):
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            expected = hidden[0] if pooling == "cls" else hidden.mean(0)
            torch.testing.assert_close(row, expected, atol=1e-5, rtol=1e-5)


def test_bert_default_pooling_is_mean_normalized_and_cannot_generate() -> None:
    runner = bert_runner(tiny_bert(), None)  # type: ignore[arg-type]
    assert runner.pooler is not None and runner.pooler.pooling_type == "mean" and runner.pooler.normalize
    with pytest.raises(AssertionError, match="no logits"):
        runner.execute(BatchPlan())
