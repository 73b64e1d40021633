"""LoRA on mixture-of-experts models (issue 33: the features that exist keep working on MoE): an
adapter on the attention projections of a tiny Qwen3-MoE and Mixtral, served through the engine's
adapter registry beside the base model, gives peft's greedy tokens; the routed experts are left
to the base weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from servelm.engine.engine import LLMEngine
from servelm.model.runner import ModelRunner
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import make_source

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NUM_NEW = 8


def peft_greedy(model: torch.nn.Module) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_attention_adapter_on_a_moe_model_equals_peft(tmp_path: Path, arch: str) -> None:
    base = peft_greedy(make_tiny_hf_model(arch))
    torch.manual_seed(7)
    model = peft.get_peft_model(make_tiny_hf_model(arch), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
    model.save_pretrained(tmp_path / "attn")
    adapted = peft_greedy(model)
    assert adapted != base, "the adapter must change the greedy tokens for the test to mean anything"
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=512),
                          lora=LoRAConfig(lora_paths=[f"attn={tmp_path / 'attn'}"]))
    runner = ModelRunner(config, make_source(make_tiny_hf_model(arch)))
    engine = LLMEngine(config, runner=runner, eos_token_ids=[], context_length=128)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):  # base and adapted requests in the same steps
        assert engine.add_request(f"base{index}", prompt, params) is None
        assert engine.add_request(f"attn{index}", prompt, params, lora_name="attn") is None
    tokens = drain(engine)
    assert [tokens[f"base{i}"] for i in range(len(PROMPTS))] == base
    assert [tokens[f"attn{i}"] for i in range(len(PROMPTS))] == adapted
