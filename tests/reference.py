"""transformers as the reference implementation for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch


def load_reference_model(path: Path, gguf_file: str | None = None):  # type: ignore[no-untyped-def]
    """A float32 transformers model from an HF directory, or from ``gguf_file`` inside ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=gguf_file, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # plain greedy: like ignore_eos, EOS is just a token
    return model


def transformers_greedy(model, token_lists: list[list[int]], num_new_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy continuation of each prompt, one at a time (no padding)."""
    results = []
    with torch.no_grad():
        for tokens in token_lists:
            ids = torch.tensor([tokens])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new_tokens,
                                 do_sample=False, pad_token_id=0)
            results.append(out[0, len(tokens):].tolist())
    return results
