"""The issue-6 CPU figures -- single-stream decode, 32 streams x 64 tokens, 1,024-token TTFT -- for
servelm (float32 and ``--quantization w8a8_int8``) and transformers' ``generate``, in one run.

Every engine gets the same random-token prompts and is forced to the same output length (greedy,
``ignore_eos`` / ``min_new_tokens``); servelm runs in-process through ``LLMEngine.step()`` (no
HTTP), so these are engine figures. Definitions:

- decode tok/s (1 stream): ``(output_len - 1) / (t(output_len) - t(1))`` -- prefill excluded;
- 32 streams: ``32 * 64 / wall time`` of 32 prompts of 64 tokens submitted together (prefill
  included), as a client would see output throughput;
- TTFT: wall time of one 1,024-token prompt with one output token.

The ratio column divides by transformers measured in the same run. The markdown table goes to
``--output`` (default benchmarks/CPU_TARGETS.md, linked from RESULTS.md) with the load average before and after.

    .venv/bin/python benchmarks/cpu_targets.py [--model gemma3-270m] [--output benchmarks/CPU_TARGETS.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_vs_transformers import servelm_run, transformers_run  # noqa: E402

from servelm.bench_common import random_prompts  # noqa: E402
from servelm.config import EngineConfig, ModelConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.source import resolve_model_source  # noqa: E402


def figures(run: Any, vocab_size: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """``run(prompts, max_tokens, tag) -> seconds`` -> the three figures."""
    first = run(random_prompts(1, args.input_len, vocab_size, seed), 1, "d1")
    full = run(random_prompts(1, args.input_len, vocab_size, seed + 1), args.output_len, "d64")
    decode = (args.output_len - 1) / (full - first)
    streams = run(random_prompts(args.streams, args.input_len, vocab_size, seed + 2), args.output_len, "s32")
    ttft = run(random_prompts(1, args.long_prompt, vocab_size, seed + 3), 1, "ttft")
    return {"decode": decode, "streams": args.streams * args.output_len / streams, "ttft": ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--modes", default="none,w8a8_int8", help="servelm --quantization values")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "CPU_TARGETS.md"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    source = resolve_model_source(ModelConfig(model=args.model))
    results: dict[str, dict[str, float]] = {}
    vocab_size = 50000
    pool_tokens = 2 * args.streams * (args.input_len + args.output_len) + 2 * args.long_prompt + 512
    for mode in args.modes.split(","):
        engine = LLMEngine(EngineConfig.from_flat({
            "model": args.model, "quantization": mode, "max_total_tokens": pool_tokens,
            "max_running_requests": args.streams, "chunked_prefill_size": args.long_prompt,
            "max_prefill_tokens": max(args.long_prompt, args.streams * args.input_len)}))
        vocab_size = min(vocab_size, engine.runner.vocab_size)
        servelm_run(engine, random_prompts(2, 16, vocab_size, 99), 4, "warmup")
        results[f"servelm {mode}"] = figures(
            lambda prompts, n, tag, e=engine: servelm_run(e, prompts, n, tag), vocab_size, args, 0)
        print(f"servelm {mode}: {results[f'servelm {mode}']}", file=sys.stderr, flush=True)
        del engine
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM  # deferred: heavy import
        assert source.gguf_path is not None, "the transformers baseline loads the packaged GGUF"
        gguf = Path(source.gguf_path)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
        pad_id = int(source.eos_token_ids[0]) if source.eos_token_ids else 0
        transformers_run(model, random_prompts(2, 16, vocab_size, 99), 4, pad_id)
        results["transformers fp32 generate"] = figures(
            lambda prompts, n, tag: transformers_run(model, prompts, n, pad_id), vocab_size, args, 0)
        print(f"transformers: {results['transformers fp32 generate']}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    write_table(args, results, load_before, load_after)


def write_table(args: argparse.Namespace, results: dict[str, dict[str, float]],
                load_before: tuple[float, ...], load_after: tuple[float, ...]) -> None:
    base = results.get("transformers fp32 generate")

    def ratio(name: str, key: str, lower_is_better: bool = False) -> str:
        if base is None:
            return ""
        value = base[key] / results[name][key] if lower_is_better else results[name][key] / base[key]
        return f" ({value:.2f}x)"

    lines = [
        f"# CPU figures: {args.model}",
        "",
        f"`{' '.join(sys.argv)}` on {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; load average before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f} (the machine is shared: compare within a run).",
        "",
        f"| engine | 1-stream decode tok/s | {args.streams} streams x {args.output_len} tokens, output tok/s "
        f"| TTFT of a {args.long_prompt}-token prompt, s |",
        "|---|---|---|---|",
    ]
    for name, values in results.items():
        lines.append(f"| {name} | {values['decode']:.1f}{ratio(name, 'decode')} | "
                     f"{values['streams']:.1f}{ratio(name, 'streams')} | "
                     f"{values['ttft']:.2f}{ratio(name, 'ttft', lower_is_better=True)} |")
    lines += ["", "Ratios are against transformers fp32 `generate` in the same run (for TTFT: "
              "transformers' time / ours). Prompts are random tokens; outputs are forced to full length."]
    text = "\n".join(lines) + "\n"
    Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
