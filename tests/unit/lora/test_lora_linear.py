"""The LoRA hook of our linear layers: fused QKV / gate_up deltas per adapter group equal peft's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.lora.adapter import FUSED_TARGETS, BaseShapes, load_adapter
from servelm.model.layers.linear import (LoRAGroup, MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear)
from tests.tiny_models import make_tiny_config, make_tiny_hf_model

peft = pytest.importorskip("peft")


def test_mixed_batch_matches_peft_per_row(tmp_path: Path) -> None:
    """Rows of base, adapter 1 and adapter 2 interleaved in one input: each row equals peft's."""
    hf = make_tiny_hf_model("llama")
    base_layer = hf.model.layers[1]
    configs = {1: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "o_proj"]),
               2: dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "gate_proj", "up_proj"])}
    shapes = BaseShapes.from_hf_config(make_tiny_config("llama"))
    qkv = QKVParallelLinear(64, 16, 4, 2)
    gate_up = MergedColumnParallelLinear(64, [128, 128])
    o_proj = RowParallelLinear(64, 64)
    for shard, name in zip("qkv", ("q_proj", "k_proj", "v_proj")):
        qkv.weight_loader(qkv.weight, getattr(base_layer.self_attn, name).weight.data, shard)
    gate_up.weight_loader(gate_up.weight, base_layer.mlp.gate_proj.weight.data, 0)
    gate_up.weight_loader(gate_up.weight, base_layer.mlp.up_proj.weight.data, 1)
    o_proj.weight_loader(o_proj.weight, base_layer.self_attn.o_proj.weight.data)
    layers = {"qkv_proj": qkv, "gate_up_proj": gate_up, "o_proj": o_proj}
    peft_layers = {}
    for slot, kwargs in configs.items():
        torch.manual_seed(slot)
        model = peft.get_peft_model(make_tiny_hf_model("llama"), peft.LoraConfig(init_lora_weights=False, **kwargs))
        model.save_pretrained(tmp_path / str(slot))
        peft_layers[slot] = model.base_model.model.model.layers[1]
        adapter = load_adapter(str(slot), tmp_path / str(slot), shapes, max_rank=8)
        for (layer, module), weights in adapter.weights.items():
            if layer == 1:
                attr, shard = FUSED_TARGETS[module]
                layers[attr].set_lora(slot, weights.a, weights.b, weights.scale, shard)
    x = torch.randn(7, 64)
    groups = [LoRAGroup(1, torch.tensor([1, 4])), LoRAGroup(2, torch.tensor([2, 5, 6]))]
    qkv_out, gate_up_out, o_out = qkv(x, groups), gate_up(x, groups), o_proj(x, groups)
    for row, slot in enumerate([0, 1, 2, 0, 1, 2, 2]):
        layer = base_layer if slot == 0 else peft_layers[slot]
        attn, mlp = layer.self_attn, layer.mlp
        want_qkv = torch.cat([attn.q_proj(x[row:row + 1]), attn.k_proj(x[row:row + 1]), attn.v_proj(x[row:row + 1])], -1)
        want_gate_up = torch.cat([mlp.gate_proj(x[row:row + 1]), mlp.up_proj(x[row:row + 1])], -1)
        torch.testing.assert_close(qkv_out[row:row + 1], want_qkv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gate_up_out[row:row + 1], want_gate_up, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o_out[row:row + 1], attn.o_proj(x[row:row + 1]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(qkv_out[1], qkv(x)[1])  # the adapter changed its rows
    torch.testing.assert_close(qkv_out[[0, 3]], qkv(x)[[0, 3]], rtol=0, atol=0)  # base rows untouched


def test_set_lora_refuses_wrong_shapes() -> None:
    gate_up = MergedColumnParallelLinear(64, [128, 128])
    with pytest.raises(ValueError, match="do not fit"):
        gate_up.set_lora(1, torch.zeros(4, 64), torch.zeros(256, 4), 1.0, 0)
    with pytest.raises(ValueError, match="not fused"):
        RowParallelLinear(64, 64).set_lora(1, torch.zeros(4, 64), torch.zeros(64, 4), 1.0, 0)
