"""Real PEFT LoRA adapters made offline on a packaged model, and transformers+peft references.

The adapters have non-trivial random weights (``init_lora_weights=False``, seeded); the reference
is transformers + peft in float32, greedy, one prompt at a time.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from tests.reference import packaged_reference_model

SPECS: dict[str, dict[str, Any]] = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp16": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "mixed4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                   layers_to_transform=list(range(0, 30, 2))),
}
"""Three adapters with different ranks, targets and layers (SmolLM2-135M has 30 layers)."""


def packaged_gguf(name: str) -> Path:
    from servelm.model.packaged import packaged_model_path

    return Path(packaged_model_path(name))


def base_model(model_name: str) -> Any:
    """A fresh float32 copy of the transformers model (peft injects its layers in place)."""
    return copy.deepcopy(packaged_reference_model(model_name))


def make_adapter(model_name: str, folder: Path, seed: int, **lora_kwargs: Any) -> Any:
    """Save a seeded random adapter for ``model_name`` in ``folder``; returns the peft model."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model(model_name),
                                peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(folder)
    return model.eval()


def peft_greedy(model: Any, token_lists: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    results = []
    with torch.no_grad():
        for tokens in token_lists:
            ids = torch.tensor([tokens])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=num_new_tokens, do_sample=False, pad_token_id=0)
            results.append(out[0, len(tokens):].tolist())
    return results


def make_bad_adapters(model_name: str, root: Path, max_rank: int) -> dict[str, tuple[Path, str]]:
    """name -> (folder, a phrase the refusal must contain) for each way an adapter is refused."""
    import peft

    from tests.tiny_models import make_tiny_hf_model

    bad: dict[str, tuple[Path, str]] = {}
    folder = root / "malformed"
    make_adapter(model_name, folder, 1, r=4, target_modules=["q_proj"])
    (folder / "adapter_config.json").write_text("{not json")
    bad["malformed"] = (folder, "not valid JSON")
    folder = root / "rank-over"
    make_adapter(model_name, folder, 2, r=max_rank * 2, target_modules=["q_proj"])
    bad["rank-over"] = (folder, f"exceeds --max-lora-rank {max_rank}")
    folder = root / "embed-target"
    make_adapter(model_name, folder, 3, r=4, target_modules=["q_proj", "embed_tokens"])
    bad["embed-target"] = (folder, "embeddings or LM head")
    folder = root / "other-base"
    torch.manual_seed(4)
    peft.get_peft_model(make_tiny_hf_model("llama"), peft.LoraConfig(
        init_lora_weights=False, r=4, target_modules=["q_proj"])).save_pretrained(folder)
    bad["other-base"] = (folder, "base-model mismatch")
    folder = root / "missing-weights"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    bad["missing-weights"] = (folder, "neither adapter_model.safetensors nor adapter_model.bin")
    return bad
