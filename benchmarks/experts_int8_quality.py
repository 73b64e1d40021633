"""``--quantization experts_int8`` against float32 on a tiny random MoE model: relative logits error
and greedy agreement (tests/unit/model/test_experts_int8.py holds the same model's experts to their
int8 dequantization; this prints how far that is from float32).

    PYTHONPATH=. python benchmarks/experts_int8_quality.py [--arch qwen3_moe|mixtral] [--tokens N]

Prints, for ``experts_int8`` and for ``int8wo`` (every linear int8), the relative logits error of the
prompts against the float32 engine's and the share of greedy tokens equal to float32's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from tests.prequantized_checkpoints import make_quant_hf_model
from tests.unit.model import test_prequantized
from tests.unit.model.conftest import prompts_for
from tests.unit.model.test_prequantized import logits_and_greedy, make_quant_runner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args()
    test_prequantized.NUM_NEW_TOKENS = args.tokens
    experts = {"num_local_experts": 8} if args.arch == "mixtral" else {"num_experts": 8, "moe_intermediate_size": 128}
    model = make_quant_hf_model(args.arch, hidden=128, intermediate=128, **experts)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        model.save_pretrained(path)
        prompts = prompts_for(args.arch, model.config.vocab_size)
        runs = {mode: logits_and_greedy(make_quant_runner(path, quantization=mode), prompts)
                for mode in ("none", "experts_int8", "int8wo")}
    float_logits, float_greedy = runs["none"]
    total = sum(len(tokens) for tokens in float_greedy)
    print(f"{args.arch}, hidden 128, 8 experts top-2, {len(prompts)} prompts x {args.tokens} greedy tokens")
    print("mode          rel_logits_err  greedy_equal  identical_prefix")
    for mode in ("experts_int8", "int8wo"):
        logits, greedy = runs[mode]
        error = ((logits - float_logits).norm() / float_logits.norm()).item()
        equal = sum(a == b for got, want in zip(greedy, float_greedy) for a, b in zip(got, want))
        prefix = sum(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
                     for got, want in zip(greedy, float_greedy))
        print(f"{mode:12s}  {error:14.2e}  {equal / total:11.0%}  {prefix / total:15.0%}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
