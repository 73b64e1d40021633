"""Pre-quantized checkpoints of Qwen2.5-Coder-0.5B on this CPU: quality and speed per format (issue 34).

The float32 weights come from ``--float-dir`` (a Hugging Face directory with the tokenizer; the one
in /work/peers is the packaged Q4_K_M GGUF dequantized by transformers, saved in float32). Each
format is made here from them, by its own library where that runs on this CPU:

- compressed-tensors W4A16 (int4, group 128, asymmetric) and W8A16 (int8 per channel): the
  compressed-tensors library's scheme, min/max scales (its ``calculate_qparams``: llm-compressor's
  round-to-nearest recipe without calibration data) and compressor (tests/prequantized_checkpoints.py
  ``write_ct_with_library``; llm-compressor itself would replace transformers here);
- bitsandbytes int8 (LLM.int8) and nf4 with double quant: transformers + bitsandbytes' CPU backend;
- GPTQ int4 g128 asymmetric and AWQ int4 g128: round-to-nearest, written to their published layouts
  by tests/prequantized_checkpoints.py (GPTQModel and AutoAWQ need CUDA builds); FP8 e4m3 in
  128x128 blocks by the same writers.

Each directory is served by the engine at ``--dtype auto`` (integer codes on the GGUF block routes
where the format has them), against float32 (the reference) and the packaged GGUF on its own blocks:
perplexity of ``quant_quality.TEXT``, greedy agreement with float32 over ``quant_quality.PROMPTS``
(identical outputs, mean agreeing prefix), and 1- and 32-stream decode tok/s.

    PYTHONPATH=. python benchmarks/prequantized.py [--formats float32,gguf,gptq,...] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_quality import PROMPTS, TEXT, decode_tok_s, greedy, perplexity  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.packaged import packaged_model_path  # noqa: E402
from tests.prequantized_checkpoints import (write_awq, write_bitsandbytes, write_ct_with_library,  # noqa: E402
                                            write_fp8, write_gptq)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CT_W4A16 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}
CT_W8A16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}

WRITERS: dict[str, tuple[str, Callable[[Path, Any, Path], Any]]] = {
    "ct-w4a16": ("compressed-tensors W4A16 g128 asym (library)",
                 lambda path, model, _: write_ct_with_library(path, model, CT_W4A16, "pack-quantized")),
    "ct-w8a16": ("compressed-tensors W8A16 per channel (library)",
                 lambda path, model, _: write_ct_with_library(path, model, CT_W8A16, "int-quantized")),
    "bnb-int8": ("bitsandbytes int8 (library)", lambda path, _, source: write_bitsandbytes(path, source, "int8")),
    "bnb-nf4": ("bitsandbytes nf4 + double quant (library)",
                lambda path, _, source: write_bitsandbytes(path, source, "nf4", double_quant=True)),
    "gptq": ("GPTQ int4 g128 asym (RTN, published layout)",
             lambda path, model, _: write_gptq(path, model, 4, 128, sym=False)),
    "awq": ("AWQ int4 g128 (RTN, published layout)", lambda path, model, _: write_awq(path, model, 128)),
    "fp8": ("FP8 e4m3 128x128 blocks (published layout)", lambda path, model, _: write_fp8(path, model)),
}
FORMATS = ("float32", "gguf", *WRITERS)


def checkpoint(name: str, float_dir: Path, work_dir: Path, model: list[Any]) -> tuple[str, str]:
    """(model path, label) of format ``name``; written into ``work_dir`` once (kept for later runs).
    ``model``: the float32 transformers model, loaded on first need."""
    if name == "float32":
        return str(float_dir), "float32 (reference)"
    if name == "gguf":
        return packaged_model_path("qwen2.5-coder-0.5b"), "GGUF Q4_K_M (packaged, own blocks)"
    label, write = WRITERS[name]
    path = work_dir / name
    if not (path / "config.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        if not model:
            from tests.reference import load_reference_model
            model.append(load_reference_model(float_dir))
        write(path, model[0], float_dir)
        for file in TOKENIZER_FILES:
            if (float_dir / file).exists():
                shutil.copy(float_dir / file, path / file)
    return str(path), label


def engine_for(model: str, num_threads: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat({"model": model, "max_total_tokens": 8192, "disable_radix_cache": True,
                                             "num_threads": num_threads}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float-dir", type=Path, default=Path("/work/peers/hf-qwen2.5-coder-0.5b"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/servelm-prequantized-bench"))
    parser.add_argument("--formats", default=",".join(FORMATS), help="the first is the reference")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--decode-tokens", type=int, default=17, help="tokens per timed stream")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    model: list[Any] = []
    paths = {name: checkpoint(name, args.float_dir, args.work_dir, model) for name in args.formats.split(",")}
    model.clear()
    reference: list[list[int]] | None = None
    rows = []
    for name, (path, label) in paths.items():
        engine = engine_for(path, args.num_threads)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        outputs = greedy(engine, prompts, args.max_tokens)
        reference = reference or outputs
        identical = sum(o == r for o, r in zip(outputs, reference)) / len(outputs)
        leading = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outputs, reference)]
        text_ppl = perplexity(engine, engine.tokenizer.encode(TEXT))
        one = decode_tok_s(engine, prompts[0], args.decode_tokens)
        many = decode_tok_s(engine, prompts[0], args.decode_tokens, streams=32)
        rows.append((label, engine.runner.quantization, identical, sum(leading) / len(leading), text_ppl, one, many))
        print(rows[-1], f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        engine.shutdown()
        del engine
    print(f"load average after: {os.getloadavg()}", file=sys.stderr, flush=True)
    print(f"| checkpoint | served as | identical greedy ({len(PROMPTS)} prompts x {args.max_tokens} tokens) "
          "| mean agreeing prefix | perplexity | 1-stream tok/s | 32-stream tok/s |")
    print("|---|---|---|---|---|---|---|")
    for label, served, identical, leading, text_ppl, one, many in rows:
        print(f"| {label} | {served} | {identical:.0%} | {leading:.1f} | {text_ppl:.2f} | {one:.2f} | {many:.1f} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
