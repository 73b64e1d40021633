"""Pre-quantized GPTQ checkpoint of Qwen2.5-Coder-0.5B on this CPU: quality and single-stream speed.

The packaged GGUF (Q4_K_M) is dequantized by transformers into a float32 model (the reference), then
quantized round-to-nearest (min/max, no calibration: GPTQModel needs CUDA here) to GPTQ int4,
group 128, asymmetric, written in the GPTQ v1 layout (tests/prequantized_checkpoints.py). servelm
loads that directory twice: --dtype float32 (exactly dequantized) and --dtype auto (the integer codes
on the GGUF block routes); and the GGUF file itself for comparison. Reported: logits error against
the float32 reference on a prompt, greedy agreement over 32 tokens, and 1-stream decode tok/s.

    PYTHONPATH=. python benchmarks/prequantized.py [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.packaged import packaged_model_path
from servelm.model.runner import ModelRunner
from servelm.model.source import resolve_model_source
from tests.prequantized_checkpoints import write_gptq
from tests.reference import load_reference_model

PAGE = 16


def runner_for(model: str, dtype: str, quantization: str = "auto") -> ModelRunner:
    model_config = ModelConfig(model=model, device="cpu", dtype=dtype, quantization=quantization)
    config = EngineConfig(model=model_config, cache=CacheConfig(page_size=PAGE, max_total_tokens=2048))
    return ModelRunner(config, resolve_model_source(model_config))


def run(runner: ModelRunner, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int], float]:
    blocks = list(range(64))
    logits = runner.execute(BatchPlan([SequencePlan(prompt, 0, blocks, num_logits=len(prompt))]))
    tokens = [int(logits[-1].argmax())]
    started = time.perf_counter()
    for step in range(new_tokens - 1):
        out = runner.execute(BatchPlan([SequencePlan(tokens[-1:], len(prompt) + step, blocks, num_logits=1)]))
        tokens.append(int(out[-1].argmax()))
    return logits, tokens, (new_tokens - 1) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = Path(packaged_model_path("qwen2.5-coder-0.5b"))
    reference = load_reference_model(gguf.parent, gguf.name)
    prompt = list(range(1000, 1064))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
        greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gptq"
        write_gptq(path, reference, bits=4, group=128, sym=False)
        for label, model, dtype, quantization in (
                ("GPTQ int4 g128, dequantized float32", str(path), "float32", "auto"),
                ("GPTQ int4 g128, block routes", str(path), "auto", "auto"),
                ("GGUF Q4_K_M, block routes", str(gguf), "auto", "auto")):
            runner = runner_for(model, dtype, quantization)
            logits, tokens, speed = run(runner, prompt, args.new_tokens)
            error = float((logits - expected).norm() / expected.norm())
            agree = sum(a == b for a, b in zip(tokens, greedy))
            print(f"{label:40s} rel. logits error vs float32 {error:.4f}  greedy = float32 ref for "
                  f"{agree}/{args.new_tokens}  decode 1 stream {speed:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
