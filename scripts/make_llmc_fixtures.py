"""Checkpoints written by llm-compressor itself (its ``oneshot``), with the library's own reference.

Runs in a separate virtual environment that holds llm-compressor and the transformers and
compressed-tensors it pins (its wheel would downgrade servelm's), never servelm's own::

    python -m venv /work/llmc-venv
    /work/llmc-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/llmc-venv/bin/pip install llmcompressor==0.14.0.1

Two uses:

- ``--fixtures DIR`` (default tests/fixtures/llmc): the tiny test fixtures. For each scheme in
  ``FIXTURES`` a tiny random bfloat16 Llama or Qwen2 goes through ``oneshot`` with a
  ``QuantizationModifier`` (round-to-nearest from min/max, no calibration data: the preset scheme
  as llm-compressor's examples apply it) or a ``GPTQModifier`` (random-token calibration) and is
  saved compressed by llm-compressor's ``save_pretrained``. Beside each checkpoint,
  ``reference.safetensors`` holds the library's own reference: transformers (with its
  compressed-tensors quantizer) loads the directory back, decompressed (``run_compressed=False``)
  into float32, with the activation quantization of the scheme switched off (servelm keeps
  activations in float: the weight-only part of a W8A8 scheme); its logits at every prompt
  position and its greedy tokens. ``reference.json`` says the prompts and the versions that wrote it.
  Layout: ``DIR/<name>/checkpoint/`` (what llm-compressor saved), ``DIR/<name>/reference.*``.
- ``--model HF_DIR --scheme NAME --out DIR``: one checkpoint of a real model (the quality/speed
  table of benchmarks/prequantized.py), ``--modifier gptq`` with ``--calibration-text FILE``.

Schemes: llm-compressor's presets W8A8 (int8 weights per channel, int8 activations per token,
dynamic), W4A16 (int4, group 128, symmetric; pack-quantized) and FP8_DYNAMIC (e4m3 weights per
channel, e4m3 activations per token, dynamic).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

FIXTURES: dict[str, dict[str, Any]] = {
    "w8a8-int8-llama": {"arch": "llama", "scheme": "W8A8", "hidden": 64, "intermediate": 128, "layers": 2},
    "w4a16-g128-qwen2": {"arch": "qwen2", "scheme": "W4A16", "hidden": 128, "intermediate": 256,
                         "layers": 1},
    "w4a16-gptq-llama": {"arch": "llama", "scheme": "W4A16", "hidden": 128, "intermediate": 256, "layers": 1,
                         "modifier": "gptq"},
    "fp8-dynamic-qwen2": {"arch": "qwen2", "scheme": "FP8_DYNAMIC", "hidden": 64, "intermediate": 128, "layers": 2},
}
"""Fixture name -> its tiny model and recipe. Widths of 128 where the scheme's group is 128 (the
MLP's down projection then has two groups per row); vocabulary 128, bfloat16: a few hundred KB in all."""
VOCAB = 128
PROMPTS = ([5, 77, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [100, 12, 33, 64, 0, 127, 90, 45, 18, 7, 66, 101, 23, 54, 88, 9, 31])
NEW_TOKENS = 12


def tiny_model(arch: str, hidden: int, intermediate: int, layers: int, seed: int = 0) -> Any:
    """A random bfloat16 transformers model: 4 heads, 2 KV heads; Llama with tied embeddings,
    Qwen2 with an untied head and q/k/v biases; norms and biases perturbed (HF inits them at 1/0)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = (transformers.LlamaConfig(**common, tie_word_embeddings=True) if arch == "llama"
              else transformers.Qwen2Config(**common, tie_word_embeddings=False))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.to(torch.bfloat16).eval()


def recipe(scheme: str, modifier: str) -> Any:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if modifier == "gptq":
        return GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    return QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])


def calibration(rows: list[list[int]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]})


def word_tokenizer() -> Any:
    """A tokenizer of VOCAB words (oneshot wants a processor beside a dataset; the calibration rows
    are token ids already, so it never splits text)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                               unk_token="t0")))


def quantize(model: Any, out: Path, scheme: str, modifier: str, rows: list[list[int]] | None,
             tokenizer: Any = None) -> None:
    """llm-compressor's ``oneshot`` on ``model`` (calibrated on ``rows`` of token ids where given)
    and its compressed save into ``out`` (with ``tokenizer``, where given)."""
    from llmcompressor import oneshot

    data = dict(dataset=calibration(rows), num_calibration_samples=len(rows), max_seq_length=max(map(len, rows)),
                processor=tokenizer or word_tokenizer()) if rows else {}
    oneshot(model=model, recipe=recipe(scheme, modifier), **data)
    model.save_pretrained(out, save_compressed=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def library_reference(path: Path, activations: bool = False) -> Any:
    """transformers' loading of ``path`` through compressed-tensors, decompressed, float32; with
    ``activations`` False the scheme's activation quantization is switched off (the weights stay
    the library's dequantized ones)."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    if not activations:
        model.apply(disable_quantization)
    return model.eval()


def reference_outputs(model: Any) -> dict[str, torch.Tensor]:
    """Logits at every position of each prompt (concatenated) and NEW_TOKENS greedy tokens each."""
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])
        # an explicit mask: generate would otherwise take token 0 of a prompt for padding
        greedy = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):] for p in PROMPTS]
    return {"logits": logits.contiguous(), "greedy": torch.stack(greedy).to(torch.int64).contiguous()}


def versions() -> dict[str, str]:
    import compressed_tensors
    import llmcompressor
    import transformers

    return {"llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__}


def write_fixture(root: Path, name: str, spec: dict[str, Any]) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.rmtree(root / name, ignore_errors=True)
    out = root / name / "checkpoint"   # the reference beside it, not in it (a loader reads every safetensors file)
    generator = torch.Generator().manual_seed(1)
    rows = ([torch.randint(0, VOCAB, (32,), generator=generator).tolist() for _ in range(16)]
            if spec.get("modifier") == "gptq" else None)
    with tempfile.TemporaryDirectory() as staging:   # oneshot reads the model's config back from its path
        tiny_model(spec["arch"], spec["hidden"], spec["intermediate"], spec["layers"]).save_pretrained(staging)
        model = AutoModelForCausalLM.from_pretrained(staging, dtype="auto").eval()
        quantize(model, out, spec["scheme"], spec.get("modifier", "rtn"), rows)
    reference = library_reference(out)
    outputs = reference_outputs(reference)
    with_activations = reference_outputs(library_reference(out, activations=True))
    save_file(outputs, str(root / name / "reference.safetensors"))
    (root / name / "reference.json").write_text(json.dumps({
        "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "scheme": spec["scheme"],
        "modifier": spec.get("modifier", "rtn"), "written_by": versions(),
        "reference": "transformers + compressed-tensors, run_compressed=False (decompressed), float32, "
                     "activation quantization disabled",
        "greedy_equal_with_activation_quantization": bool(torch.equal(with_activations["greedy"],
                                                                      outputs["greedy"])),
        "max_logit_change_with_activation_quantization": float((with_activations["logits"]
                                                                - outputs["logits"]).abs().max()),
    }, indent=1) + "\n")
    print(name, sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file()) // 1024, "KiB")

def calibration_rows(tokenizer: Any, text_file: Path, count: int, length: int) -> list[list[int]]:
    ids = tokenizer(text_file.read_text())["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(min(count, len(ids) // length))]


def write_model(model_dir: Path, scheme: str, out: Path, modifier: str, calibration_text: Path | None,
                samples: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
    rows = calibration_rows(tokenizer, calibration_text, samples, 256) if calibration_text else None
    with tempfile.TemporaryDirectory(dir=out.parent) as staging:
        quantize(model, Path(staging) / "model", scheme, modifier, rows, tokenizer)
        for extra in ("chat_template.jinja", "generation_config.json"):
            if (model_dir / extra).exists() and not (Path(staging) / "model" / extra).exists():
                shutil.copy(model_dir / extra, Path(staging) / "model" / extra)
        shutil.rmtree(out, ignore_errors=True)
        (Path(staging) / "model").rename(out)
    (out / "written_by.json").write_text(json.dumps({"scheme": scheme, "modifier": modifier, **versions()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/llmc")
    parser.add_argument("--only", help="comma-separated fixture names")
    parser.add_argument("--model", type=Path, help="a Hugging Face directory to quantize instead of the fixtures")
    parser.add_argument("--scheme", choices=("W8A8", "W4A16", "FP8_DYNAMIC"))
    parser.add_argument("--modifier", choices=("rtn", "gptq"), default="rtn")
    parser.add_argument("--calibration-text", type=Path, help="gptq: text whose tokens calibrate")
    parser.add_argument("--samples", type=int, default=32, help="gptq: calibration rows of 256 tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.model:
        if not (args.scheme and args.out):
            parser.error("--model needs --scheme and --out")
        write_model(args.model, args.scheme, args.out, args.modifier, args.calibration_text, args.samples)
        return
    args.fixtures.mkdir(parents=True, exist_ok=True)
    for name, spec in FIXTURES.items():
        if not args.only or name in args.only.split(","):
            write_fixture(args.fixtures, name, spec)


if __name__ == "__main__":
    main()
