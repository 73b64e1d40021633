"""Tiny DeepSeek-V3 checkpoints with a multi-token-prediction layer, for NEXTN tests.

transformers does not build DeepSeek-V3's MTP module, so its tensors are written here into the
saved tiny checkpoint in the published naming (``model.layers.{L}.enorm.weight``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, copies of the embedding and LM head as ``embed_tokens`` and
``shared_head.head``, and a decoder layer's ``self_attn.*`` / ``mlp.*`` / norms; L =
num_hidden_layers) and config.json gets ``num_nextn_predict_layers: 1``.

``write_random_mtp_layer``: the decoder layer is the MoE layer of another random tiny V3 (a
different seed, so it is not the model's own), enorm/hnorm/shared_head.norm perturbed around 1 and
eh_proj random: its drafts are rarely accepted.

``make_bigram_with_copying_mtp``: a target whose layers add nothing (every ``o_proj`` and
``down_proj`` is zero: each layer passes its input through), so its next token is a function of
the current token alone, ``argmax(lm_head(norm(embed(t))))``, and an MTP layer that computes the
same function of the token it reads (``eh_proj`` keeps the embedding half, the layer adds nothing,
``shared_head.norm`` is the model's final norm: RMS-normalising twice equals once up to eps). Its
entry p reads token p + 1, so its draft is the model's own next token after that one: accepted
unless the MTP reads the wrong token. Exact output is still checked against plain decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import make_tiny_hf_model, make_tiny_model_dir

ARCH = "deepseek_v3"
MTP_SEED = 7
"""The seed of the random tiny V3 whose layer 2 ``write_random_mtp_layer`` writes as the MTP layer."""


def _save_with_mtp(path: Path, mtp: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> Path:
    config = json.loads((path / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    tensors = {**weights, **{prefix + name: tensor.contiguous() for name, tensor in mtp.items()},
               prefix + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
               prefix + "shared_head.head.weight": weights["lm_head.weight"].clone()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path


def _moe_layer_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer 2 (an MoE layer) of a tiny V3's ``weights``, named relative to the layer, its experts
    one by one as the published checkpoints (and transformers' saved files) store them, also where
    ``weights`` is a transformers module's state dict, which stacks them."""
    found = {name.removeprefix("model.layers.2."): tensor.detach().clone()
             for name, tensor in weights.items() if name.startswith("model.layers.2.")}
    if "mlp.experts.gate_up_proj" not in found:
        return found
    gate_up, down = found.pop("mlp.experts.gate_up_proj"), found.pop("mlp.experts.down_proj")  # [E, 2I, H], [E, H, I]
    gates, ups = gate_up.chunk(2, dim=1)   # the gate rows, then the up rows
    for expert in range(gate_up.shape[0]):
        found[f"mlp.experts.{expert}.gate_proj.weight"] = gates[expert]
        found[f"mlp.experts.{expert}.up_proj.weight"] = ups[expert]
        found[f"mlp.experts.{expert}.down_proj.weight"] = down[expert]
    return found


def write_random_mtp_layer(root: Path, seed: int = MTP_SEED) -> Path:
    """The tiny V3 with a random MTP layer (see the module docstring)."""
    path = make_tiny_model_dir(root, ARCH)
    weights = load_file(str(path / "model.safetensors"))
    hidden = weights["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed)
    mtp = _moe_layer_tensors(make_tiny_hf_model(ARCH, seed=seed).state_dict())
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[name] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    mtp["eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    return _save_with_mtp(path, mtp, weights)


def _zero_layer_outputs(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):   # stacked experts too
            tensors[name] = torch.zeros_like(tensor)


def make_bigram_with_copying_mtp(root: Path) -> Path:
    """The bigram target and its copying MTP layer (see the module docstring)."""
    path = make_tiny_model_dir(root / "bigram", ARCH)
    weights = load_file(str(path / "model.safetensors"))
    _zero_layer_outputs(weights)
    hidden = weights["model.norm.weight"].shape[0]
    mtp = _moe_layer_tensors(weights)
    _zero_layer_outputs(mtp)
    mtp["enorm.weight"] = torch.ones(hidden)
    mtp["hnorm.weight"] = torch.ones(hidden)
    mtp["eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    mtp["shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    return _save_with_mtp(path, mtp, weights)
