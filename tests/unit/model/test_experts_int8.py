"""``--quantization experts_int8`` (vLLM's name): the routed experts of an MoE model, and only they,
quantized at load to int8 weights with one scale per output channel (servelm.model.layers.quantization
``quantize_experts``); a model with no MoE layer is refused at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import EngineConfig, ModelConfig, ParallelConfig
from servelm.model.layers.linear import LinearBase
from servelm.model.layers.moe import FusedMoE
from servelm.model.layers.weight_only import Int8WeightOnlyLinearMethod, quantize_int8_per_channel
from tests.prequantized_checkpoints import expert_weights, make_quant_hf_model, reference_model

from .conftest import prompts_for
from .test_prequantized import logits_and_greedy, make_quant_runner, reference_logits_and_greedy

SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(a tiny Qwen3-MoE directory: layers 0 and 2 sparse, 1 dense; its float32 transformers model)."""
    model = make_quant_hf_model("qwen3_moe", hidden=64, intermediate=128, moe_intermediate_size=64, num_experts=4)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return path, model


def int8_expert_reference(model: Any) -> Any:
    """``model`` with every expert projection replaced by its int8 per-channel dequantization."""
    weights = {}
    for layer in range(model.config.num_hidden_layers):
        for name, weight in expert_weights(model, layer).items():
            quantized, scale = quantize_int8_per_channel(weight)
            weights[name] = quantized.float() * scale[:, None]
    return reference_model(model, weights)


def test_only_the_experts_are_int8(tiny_moe: tuple[Path, Any]) -> None:
    """Every expert's gate_up and down hold int8 weights with a float32 scale per output channel and
    no float stack is left; attention, the dense layer's MLP and the routers keep their float32
    weights. The logits are the int8-dequantized experts' (to the kernel's bf16 activation rounding)
    and differ from the float model's."""
    path, model = tiny_moe
    runner = make_quant_runner(path, quantization="experts_int8")
    moes = [module for module in runner.model.modules() if isinstance(module, FusedMoE)]
    assert len(moes) == 2
    experts = set()
    for moe in moes:
        assert moe.gate_up_proj is None and moe.down_proj is None and moe.expert_layers is not None
        for layers in moe.expert_layers:
            for linear in (layers.gate_up_proj, layers.down_proj):
                assert isinstance(linear.linear_method, Int8WeightOnlyLinearMethod) and linear.weight is None
                assert linear.int8_weight.dtype == torch.int8
                assert linear.int8_scale.shape == (linear.int8_weight.shape[0],)
                experts.add(id(linear))
    others = [module for module in runner.model.modules()
              if isinstance(module, LinearBase) and id(module) not in experts]
    assert others and all(module.weight is not None and module.weight.dtype == torch.float32 for module in others)
    prompts = prompts_for("qwen3_moe", runner.vocab_size)
    logits, _ = logits_and_greedy(runner, prompts)
    expected, _ = reference_logits_and_greedy(int8_expert_reference(model), prompts)
    with torch.no_grad():
        float_logits = torch.cat([model(torch.tensor([prompt])).logits[0] for prompt in prompts])
    error = ((logits - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, error
    assert not torch.allclose(expected, float_logits, atol=1e-4, rtol=1e-4)


def test_a_model_without_experts_is_refused_at_start_up(tmp_path: Path) -> None:
    make_quant_hf_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="experts_int8 quantizes the routed experts of a mixture-of-experts "
                                         "model; LlamaForCausalLM has no MoE layer"):
        make_quant_runner(tmp_path, quantization="experts_int8")


def test_experts_int8_with_eplb_is_refused() -> None:
    with pytest.raises(ValueError, match="experts_int8 cannot be combined with --enable-eplb"):
        EngineConfig(model=ModelConfig(quantization="experts_int8"),
                     parallel=ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, enable_eplb=True))


def test_a_dense_draft_of_an_experts_int8_model_loads_as_it_is() -> None:
    """experts_int8 names the model's experts; the draft model (often dense) is not refused for it."""
    from servelm.config import SpeculativeConfig
    from servelm.engine.draft_model import draft_engine_config

    config = EngineConfig(model=ModelConfig(quantization="experts_int8"),
                          speculative=SpeculativeConfig(speculative_draft_model_path="draft", num_speculative_tokens=4))
    assert draft_engine_config(config).model.quantization == "auto"


@SLOW
def test_expert_parallel_2_holds_the_same_int8_experts(tiny_moe: tuple[Path, Any]) -> None:
    """--ep-size 2 --tp-size 2: each rank quantizes the whole experts it holds, so the experts are the
    one-process int8 ones; the logits equal one process's (to the tensor-parallel reduction order)."""
    from tests.unit.distributed.test_parallel import run_ranks

    from .test_prequantized_moe import expert_parallel_logits

    path, _ = tiny_moe
    prompts = prompts_for("qwen3_moe", 320)
    expected = expert_parallel_logits(path, prompts, None, 1, "experts_int8")
    for got in run_ranks(2, lambda parallel: expert_parallel_logits(path, prompts, parallel, 2, "experts_int8")):
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
