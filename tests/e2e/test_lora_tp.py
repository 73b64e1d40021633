"""LoRA with tensor parallelism: with --tp-size 2 (rank 1 a real process, real gloo collectives),
adapters loaded at start-up and at run time give transformers + peft's greedy tokens, in one mixed
batch with the base model, on a GQA model and on one whose single KV head is replicated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain
from tests.tiny_models import make_tiny_hf_model, make_tiny_model_dir

peft = pytest.importorskip("peft")

ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [300, 12, 99]]
NUM_NEW = 8


@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma3_mqa", marks=pytest.mark.slow)])
def test_tp2_adapters_equal_peft(tmp_path: Path, arch: str) -> None:
    expected: dict[str | None, list[list[int]]] = {}
    for seed, (name, kwargs) in enumerate([(None, None), *ADAPTERS.items()]):
        model = make_tiny_hf_model(arch)
        if name is not None:
            torch.manual_seed(seed)
            model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kwargs)).eval()
            model.save_pretrained(tmp_path / name)
        expected[name] = []
        for prompt in PROMPTS:
            with torch.no_grad():
                out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected[name].append(out[0, len(prompt):].tolist())
    config = EngineConfig.from_flat(dict(
        model=str(make_tiny_model_dir(tmp_path, arch)), dtype="float32", device="cpu", num_threads=1,
        tensor_parallel_size=2, skip_tokenizer_init=True, max_total_tokens=1024, page_size=4,
        chunked_prefill_size=8, lora_paths=[f"attn={tmp_path / 'attn'}"]))
    engine = LLMEngine(config)
    try:
        assert engine.load_lora_adapter("mlp", str(tmp_path / "mlp"))["success"]  # at run time
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        for name in [None, *ADAPTERS]:
            for index, prompt in enumerate(PROMPTS):
                assert engine.add_request(f"{name}-{index}", prompt, params, lora_name=name) is None
        outputs = drain(engine)
        for name in [None, *ADAPTERS]:
            for index in range(len(PROMPTS)):
                assert outputs[f"{name}-{index}"] == expected[name][index], (name, index)
        assert engine.unload_lora_adapter("mlp")["success"]
        assert engine.lora is not None and not engine.lora.has_unloaded  # removed on both ranks
    finally:
        engine.shutdown()
