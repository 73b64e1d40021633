"""transformers as the reference implementation for parity tests."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF load of a Llama-family file does the same pure work more than once:
    gguf-py's GGUFReader parses the file (metadata and vocabulary, in Python) once for the config
    and again for the weights, and ``get_tensor_name_map(arch, layers)`` builds the same name table
    for every module of the model (~400 times for SmolLM2). Within this context both give the
    result of their first call for the same arguments (read-only objects: the reader's memory map
    opened read-only, the name table only looked up), so the load does each once; it is the same
    load with the same values (about 15 s less for SmolLM2-135M on a 2-core box)."""
    try:
        import gguf
    except ImportError:  # transformers says so itself
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_reference_model(path: Path, gguf_file: str | None = None):  # type: ignore[no-untyped-def]
    """A float32 transformers model from an HF directory, or from ``gguf_file`` inside ``path``."""
    from transformers import AutoModelForCausalLM

    with _gguf_parsed_once() if gguf_file else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=gguf_file, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # plain greedy: like ignore_eos, EOS is just a token
    return model


@functools.lru_cache(maxsize=1)
def packaged_reference_model(name: str):  # type: ignore[no-untyped-def]
    """``load_reference_model`` of packaged model ``name``'s GGUF, loaded once per test session:
    transformers dequantizes a GGUF in Python (seconds even for SmolLM2-135M), and the beam search,
    LoRA and GGUF parity tests all compare with SmolLM2. Shared, so never modified: deep-copy it
    first (``tests.lora_adapters.base_model``). Raises PackagedModelError where it is absent."""
    from servelm.model.packaged import packaged_model_path

    gguf = Path(packaged_model_path(name))
    return load_reference_model(gguf.parent, gguf.name)


@functools.lru_cache(maxsize=1)
def packaged_reference_tokenizer(name: str):  # type: ignore[no-untyped-def]
    """transformers' tokenizer of packaged model ``name``'s GGUF, built once per test session
    (transformers rebuilds it from the GGUF's vocabulary: seconds). Shared: never modify it."""
    from transformers import AutoTokenizer

    from servelm.model.packaged import packaged_model_path

    gguf = Path(packaged_model_path(name))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


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


def transformers_beams(model, prompt: list[int], num_beams: int, max_new_tokens: int,  # type: ignore[no-untyped-def]
                       eos_token_ids: list[int], length_penalty: float = 1.0,
                       early_stopping: bool | str = False, **model_inputs) -> list[tuple[list[int], float]]:
    """transformers' beam search (``num_return_sequences=num_beams``): (output tokens, score) per
    beam, best first; a beam ends after its first EOS (the padding after it is cut off).
    ``model_inputs``: more inputs for ``generate`` (a VLM's pixel values)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **model_inputs,
                             num_beams=num_beams, num_return_sequences=num_beams, do_sample=False,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             output_scores=True, return_dict_in_generate=True,
                             eos_token_id=eos_token_ids or None,
                             pad_token_id=eos_token_ids[0] if eos_token_ids else 0)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        tokens = sequence[len(prompt):].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos_token_ids]
        beams.append((tokens[:ends[0] + 1] if ends else tokens, float(score)))
    return beams
