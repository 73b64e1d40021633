"""PEFT adapters made offline on tiny random models: loading, scaling, and each refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from servelm.lora.adapter import BaseShapes, LoRAAdapterError, load_adapter, lora_delta
from tests.tiny_models import make_tiny_config, make_tiny_hf_model

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (arch, LoraConfig kwargs)
    "attn-r4": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "mlp-r8-rs": ("qwen2", dict(r=8, lora_alpha=16, use_rslora=True,
                                target_modules=["gate_proj", "up_proj", "down_proj"])),
    "mixed-layer1": ("llama", dict(r=2, lora_alpha=3, target_modules=["q_proj", "down_proj", "up_proj"],
                                   layers_to_transform=[1], rank_pattern={"down_proj": 6},
                                   alpha_pattern={"up_proj": 5})),
}


def _make_adapter(tmp_path: Path, name: str, safe: bool = True) -> tuple[Path, object]:
    arch, kwargs = ADAPTERS[name]
    torch.manual_seed(1)
    model = peft.get_peft_model(make_tiny_hf_model(arch), peft.LoraConfig(init_lora_weights=False, **kwargs))
    path = tmp_path / name
    model.save_pretrained(path, safe_serialization=safe)
    return path, model


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_loaded_deltas_equal_peft(tmp_path: Path, name: str) -> None:
    path, model = _make_adapter(tmp_path, name)
    arch = ADAPTERS[name][0]
    adapter = load_adapter(name, path, BaseShapes.from_hf_config(make_tiny_config(arch)), max_rank=16)
    expected = {}
    for module_name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            parts = module_name.split(".")
            expected[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    assert set(adapter.weights) == set(expected)
    for key, module in expected.items():
        x = torch.randn(5, module.in_features)
        want = module.lora_B["default"](module.lora_A["default"](x)) * module.scaling["default"]
        torch.testing.assert_close(lora_delta(x, adapter.weights[key]), want, rtol=1e-5, atol=1e-5)
        assert want.abs().max() > 1e-3  # non-trivial weights
    if name == "mixed-layer1":
        assert {layer for layer, _ in adapter.weights} == {1}
        assert adapter.rank == 6 and adapter.weights[(1, "up_proj")].scale == 2.5


def test_bin_format(tmp_path: Path) -> None:
    path, _ = _make_adapter(tmp_path, "attn-r4", safe=False)
    assert (path / "adapter_model.bin").is_file()
    adapter = load_adapter("a", path, BaseShapes.from_hf_config(make_tiny_config("llama")), max_rank=8)
    assert adapter.rank == 4 and len(adapter.weights) == 8


def test_refusals(tmp_path: Path) -> None:
    llama = BaseShapes.from_hf_config(make_tiny_config("llama"))
    path, _ = _make_adapter(tmp_path, "mlp-r8-rs")
    with pytest.raises(LoRAAdapterError, match="rank 8 exceeds --max-lora-rank 4"):
        load_adapter("a", path, BaseShapes.from_hf_config(make_tiny_config("qwen2")), max_rank=4)
    wide = BaseShapes(2, {**llama.features, "gate_proj": (64, 256), "up_proj": (64, 256),
                          "down_proj": (256, 64)})
    with pytest.raises(LoRAAdapterError, match="base-model mismatch"):
        load_adapter("a", path, wide, max_rank=16)
    with pytest.raises(LoRAAdapterError, match="base-model mismatch"):
        load_adapter("a", path, BaseShapes(1, llama.features), max_rank=16)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        load_adapter("a", tmp_path / "missing", llama, max_rank=16)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        load_adapter("a", bad, llama, max_rank=16)
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(LoRAAdapterError, match="neither adapter_model.safetensors"):
        load_adapter("a", bad, llama, max_rank=16)
    dora = tmp_path / "dora"
    shutil.copytree(path, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="DoRA is not supported"):
        load_adapter("a", dora, llama, max_rank=16)


def test_unsupported_target_refused(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = peft.get_peft_model(make_tiny_hf_model("llama"),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "head", safe_serialization=True)
    with pytest.raises(LoRAAdapterError, match="LM head"):
        load_adapter("a", tmp_path / "head", BaseShapes.from_hf_config(make_tiny_config("llama")), max_rank=16)
