"""EAGLE heads for tests: random ones (``servelm.model.eagle_checkpoint``) and one built to predict
its model well.

``make_copying_head(target_dir, out_dir)``: for a one-layer Llama target whose final norm weight
is all ones (``make_one_layer_target``), an EAGLE-1 head with two layers: ``fc`` passes the token
embedding through and ignores the feature, layer 0 is the identity (its ``o_proj`` and
``down_proj`` are zero), layer 1 is a copy of the target's only layer. Entry p then computes the
target's layer over the embeddings of tokens 1..p+1 (rope only sees relative positions, so the
shift by one changes nothing) and the target's LM head scores it: the target's own prediction for
position p + 2, except that token 0 is missing from the context (and the final norm, all ones
here, is a positive scale that leaves the argmax alone). Its drafts are accepted most of the time,
which shows the chain, the positions and the rollback line up.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from servelm.model.eagle_checkpoint import head_config, save_head, write_random_head
from tests.tiny_models import make_tiny_config, make_tiny_hf_model


def make_one_layer_target(root: Path) -> Path:
    """A tiny one-layer Llama (vocab 320) with an all-ones final norm."""
    model = make_tiny_hf_model("llama")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    path = root / "tiny-llama-1layer"
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_copying_head(target_dir: Path, out_dir: Path) -> Path:
    """The EAGLE-1 head described in the module docstring."""
    config_dict = json.loads((target_dir / "config.json").read_text())
    target_config = make_tiny_config("llama")
    target_config.num_hidden_layers = 1
    assert config_dict["num_hidden_layers"] == 1
    config = head_config(target_config, "EAGLE", num_layers=2)
    weights = load_file(str(target_dir / "model.safetensors"))
    hidden = config["hidden_size"]
    tensors: dict[str, torch.Tensor] = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)}
    for name, tensor in weights.items():
        if name.startswith("model.layers.0."):
            tensors["layers.1." + name.removeprefix("model.layers.0.")] = tensor
            if "input_layernorm" not in name:
                zero = name.endswith(("o_proj.weight", "down_proj.weight"))
                tensors["layers.0." + name.removeprefix("model.layers.0.")] = (
                    torch.zeros_like(tensor) if zero else tensor.clone())
    return save_head(out_dir, config, tensors)


def make_random_head(target_arch: str, algorithm: str, out_dir: Path, seed: int = 0,
                     draft_vocab_size: int | None = None) -> Path:
    return write_random_head(make_tiny_config(target_arch), algorithm, out_dir, seed, draft_vocab_size)
