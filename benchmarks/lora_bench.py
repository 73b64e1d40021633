"""Multi-LoRA throughput: N streams spread over A adapters against the same N streams on the base
model, in one run, through LLMEngine in-process (no HTTP), plus each adapter's load time.

The adapters are PEFT-format directories with random weights (rank R on every attention and MLP
projection of every layer: the most work an adapter can ask for), written by this script. The
streams are random token prompts decoded greedily with ignore_eos, so both phases do identical
work apart from the LoRA deltas; stream i of the LoRA phase uses adapter i % A. A short warm-up
runs both paths first.

    .venv/bin/python benchmarks/lora_bench.py                          # smollm2-135m, 32 streams, 4 x rank 16
    .venv/bin/python benchmarks/lora_bench.py --model qwen2.5-coder-0.5b --num-threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from servelm.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, RuntimeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, hf_config: object, rank: int, seed: int) -> None:
    """A PEFT LoRA directory with small random weights on every projection of every layer."""
    from servelm.lora.adapter import BaseShapes

    shapes = BaseShapes.from_hf_config(hf_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, block in TARGETS.items():
            in_features, out_features = shapes.features[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none"}))


def run(engine: LLMEngine, prompts: list[list[int]], output_tokens: int,
        adapters: list[str | None]) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    start_s = time.perf_counter()
    for index, prompt in enumerate(prompts):
        name = adapters[index % len(adapters)]
        assert engine.add_request(f"r{time.monotonic_ns()}-{index}", prompt, params, lora_name=name) is None
    num_output = 0
    first_token_s = None
    while engine.has_unfinished():
        for output in engine.step():
            num_output += len(output.new_token_ids)
            if first_token_s is None and output.new_token_ids:
                first_token_s = time.perf_counter() - start_s
    elapsed_s = time.perf_counter() - start_s
    return {"elapsed_s": round(elapsed_s, 2), "output_tokens": num_output,
            "output_tok_s": round(num_output / elapsed_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(max_total_tokens=args.streams * (args.input_len + args.output_len) * 2),
        runtime=RuntimeConfig(num_threads=args.num_threads),
        lora=LoRAConfig(enable_lora=True, max_lora_rank=args.rank, max_loras_per_batch=args.adapters))
    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(args.streams)]
    from servelm.model.source import resolve_model_source

    hf_config = resolve_model_source(config.model).hf_config
    names = [f"lora{i}" for i in range(args.adapters)]
    load_times = []
    with tempfile.TemporaryDirectory() as root:
        for seed, name in enumerate(names):
            write_adapter(Path(root) / name, hf_config, args.rank, seed)
            result = engine.load_lora_adapter(name, str(Path(root) / name))
            assert result["success"], result
            load_times.append(result["load_time_s"])
    warm = prompts[:len(names)]
    run(engine, warm, 4, [None])
    run(engine, warm, 4, list(names))
    engine.flush_cache()
    base = run(engine, prompts, args.output_len, [None])
    engine.flush_cache()
    lora = run(engine, prompts, args.output_len, list(names))
    report = {
        "model": args.model, "dtype": str(engine.runner.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
        "num_threads": args.num_threads, "streams": args.streams, "adapters": args.adapters,
        "rank": args.rank, "input_len": args.input_len, "output_len": args.output_len,
        "adapter_load_s": [round(t, 4) for t in load_times],
        "base": base, "lora": lora,
        "lora_over_base": round(lora["output_tok_s"] / base["output_tok_s"], 3),
    }
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
