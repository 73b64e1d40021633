"""Flags whose effect lives in the model runner do what their help says (issue 31, part 6).

- --enable-fp32-lm-head on a 16-bit model computes the head in float32 (a float32 copy of the
  weight times float32 hidden states), not in bf16 rounded afterwards.
- --enable-torch-compile on a model that --task auto resolves to embeddings is refused (it used to
  start, compile nothing and exit 0).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig
from servelm.model.runner import ModelRunner
from tests.tiny_models import make_tiny_hf_model

from .conftest import BLOCK_SIZE, make_source
from .test_bert import tiny_bert


def runner_with(source: SimpleNamespace, dtype: str, **model: object) -> ModelRunner:
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype=dtype, **model),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=256))
    return ModelRunner(config, source)


def test_fp32_lm_head_computes_the_head_in_float32_on_a_bf16_model() -> None:
    source = make_source(make_tiny_hf_model("llama"))
    plain = runner_with(source, "bfloat16")
    fp32 = runner_with(source, "bfloat16", enable_fp32_lm_head=True)
    head = fp32.model.lm_head
    assert head.fp32_weight is not None and head.fp32_weight.dtype == torch.float32
    assert plain.model.lm_head.fp32_weight is None
    hidden = torch.randn(5, head.weight.shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        logits = fp32.model.compute_logits(hidden)
        rounded = plain.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    expected = F.linear(hidden.float(), head.weight.float())
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(rounded.float(), expected)  # what the flag used to leave: bf16 logits


def test_fp32_lm_head_on_a_float32_model_keeps_no_copy() -> None:
    runner = runner_with(make_source(make_tiny_hf_model("llama")), "float32", enable_fp32_lm_head=True)
    assert runner.model.lm_head.fp32_weight is None


def test_fp32_lm_head_with_a_quantized_head_is_refused() -> None:
    with pytest.raises(ValueError, match="--enable-fp32-lm-head cannot be combined with --quantization"):
        runner_with(make_source(make_tiny_hf_model("llama")), "bfloat16", enable_fp32_lm_head=True,
                    quantization="int8wo")


def test_torch_compile_of_an_auto_embedding_model_is_refused() -> None:
    model = tiny_bert()
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    source = SimpleNamespace(hf_config=model.config, weights=lambda: iter(state.items()),
                             tokenizer_path=None, eos_token_ids=[], context_length=64,
                             description="tiny encoder", model_path="")
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=256),
                          runtime=RuntimeConfig(enable_torch_compile=True))
    with pytest.raises(ValueError, match="--enable-torch-compile compiles decode steps; BertModel"):
        ModelRunner(config, source)
