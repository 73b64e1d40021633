"""Random-weight EAGLE / EAGLE-3 heads in the published checkpoint format, for a given model.

No trained head exists offline for the models servelm ships, so this writes one with random
weights: a ``config.json`` (``architectures`` LlamaForCausalLMEagle or LlamaForCausalLMEagle3, the
sizes of the model it drafts for) and ``model.safetensors`` with the tensor names and shapes of the
published heads (EAGLE-1: ``fc`` over [embedding, feature] and ``layers.N``; EAGLE-3: ``fc`` over
three features, ``midlayer`` with q/k/v over 2 x hidden, ``norm``, ``lm_head`` over a reduced
vocabulary, ``d2t`` / ``t2d``). Such a head loads and runs exactly like a trained one, so it tests
the loading and the chain mechanics, but its drafts are rarely accepted: it does not speed anything
up. Tests and ``python -m servelm.model.eagle_checkpoint`` use it:

    python -m servelm.model.eagle_checkpoint --model qwen2.5-coder-0.5b --algorithm EAGLE3 --out /tmp/head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from servelm.model.architectures.common import head_dim_of
from servelm.model.eagle import EAGLE_ARCHITECTURES
from servelm.model.layers.rotary import rope_parameters

DEFAULT_DRAFT_VOCAB = 32000
"""EAGLE-3's reduced vocabulary when not given (the published Llama heads keep 32k tokens), at
most half the model's so the d2t mapping is always exercised."""


def head_config(target_config: Any, algorithm: str, draft_vocab_size: int | None = None,
                num_layers: int = 1) -> dict[str, Any]:
    """config.json of a head for ``target_config`` (a transformers config)."""
    text = target_config.get_text_config()
    heads = text.num_attention_heads
    rope = dict(rope_parameters(text, "full_attention"))
    theta = rope.pop("rope_theta", 10000.0)
    config: dict[str, Any] = {
        "architectures": [EAGLE_ARCHITECTURES[algorithm]],
        "model_type": "llama",
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim_of(text),
        "num_hidden_layers": 1 if algorithm == "EAGLE3" else num_layers,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "vocab_size": text.vocab_size,
        "max_position_embeddings": getattr(text, "max_position_embeddings", 4096),
        "rope_theta": theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    if algorithm == "EAGLE3":
        config["draft_vocab_size"] = draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, text.vocab_size // 2)
        config["target_hidden_size"] = text.hidden_size
    return config


def _layer_tensors(prefix: str, config: dict[str, Any], input_size: int, has_input_norm: bool,
                   has_hidden_norm: bool, std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = {
        f"{prefix}.self_attn.q_proj.weight": normal(q_size, input_size),
        f"{prefix}.self_attn.k_proj.weight": normal(kv_size, input_size),
        f"{prefix}.self_attn.v_proj.weight": normal(kv_size, input_size),
        f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_size),
        f"{prefix}.mlp.gate_proj.weight": normal(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": normal(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": normal(hidden, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + normal(hidden),
    }
    if has_input_norm:
        tensors[f"{prefix}.input_layernorm.weight"] = 1 + normal(hidden)
    if has_hidden_norm:
        tensors[f"{prefix}.hidden_norm.weight"] = 1 + normal(hidden)
    return tensors


def random_head_tensors(config: dict[str, Any], seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random float32 tensors for ``config`` (``head_config``), named as the published heads."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    if EAGLE_ARCHITECTURES["EAGLE3"] in config["architectures"]:
        vocab, draft_vocab = config["vocab_size"], config["draft_vocab_size"]
        tensors = {"fc.weight": torch.randn(hidden, 3 * config["target_hidden_size"],
                                            generator=generator) * std}
        tensors.update(_layer_tensors("midlayer", config, 2 * hidden, True, True, std, generator))
        tensors["norm.weight"] = 1 + torch.randn(hidden, generator=generator) * std
        tensors["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=generator) * std
        kept = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d
        return tensors
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * std}
    for index in range(config["num_hidden_layers"]):
        tensors.update(_layer_tensors(f"layers.{index}", config, hidden, index > 0, False, std,
                                      generator))
    return tensors


def save_head(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
              str(path / "model.safetensors"))
    return path


def write_random_head(target_config: Any, algorithm: str, out_dir: str | Path, seed: int = 0,
                      draft_vocab_size: int | None = None) -> Path:
    """A random-weight head for the model of ``target_config`` in ``out_dir``."""
    config = head_config(target_config, algorithm, draft_vocab_size)
    return save_head(out_dir, config, random_head_tensors(config, seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model it drafts for (as --model takes)")
    parser.add_argument("--algorithm", choices=sorted(EAGLE_ARCHITECTURES), default="EAGLE3")
    parser.add_argument("--out", required=True, help="directory to write the head into")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="EAGLE3: reduced vocabulary size (default min(32000, vocab / 2))")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from servelm.config import ModelConfig
    from servelm.model.source import resolve_model_source

    source = resolve_model_source(ModelConfig(model=args.model))
    path = write_random_head(source.hf_config, args.algorithm, args.out, args.seed, args.draft_vocab_size)
    print(f"wrote a random-weight {args.algorithm} head for {args.model} to {path}")


if __name__ == "__main__":
    main()
