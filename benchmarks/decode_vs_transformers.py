"""Decode tokens/s of servelm's LLMEngine against transformers' generate, measured in one run.

Both sides load the same GGUF (dequantized to float32), run the same random-token prompts greedily
for the same number of tokens, and are timed the same way: a run with one new token (prefill plus
the first sample) and a run with ``--output-len`` new tokens; decode tokens/s is
``batch * (output_len - 1) / (t_full - t_first)``. servelm runs in-process (no HTTP, no engine
process) so the number is the engine's own. Prompts in a batch have equal length, so transformers'
left padding is a no-op.

    .venv/bin/python benchmarks/decode_vs_transformers.py [--model qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench import parse_batch_sizes  # noqa: E402
from servelm.bench_common import format_table, random_prompts  # noqa: E402
from servelm.config import EngineConfig, ModelConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.source import resolve_model_source  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402


def servelm_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Wall time to finish every prompt through ``LLMEngine.step()``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start_s = time.perf_counter()
    for index, prompt in enumerate(prompts):
        rejected = engine.add_request(f"{tag}-{index}", prompt, params)
        if rejected is not None:
            raise RuntimeError(f"servelm rejected a request: {rejected.error}")
    lengths: dict[str, int] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"servelm request failed: {output.error}")
            lengths[output.request_id] = output.num_output_tokens
    elapsed_s = time.perf_counter() - start_s
    assert sorted(lengths.values()) == [max_tokens] * len(prompts), lengths
    return elapsed_s


def transformers_run(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """Wall time of one greedy ``model.generate`` over the batch, forced to ``max_tokens``."""
    input_ids = torch.tensor(prompts, dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    start_s = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, use_cache=True, pad_token_id=pad_id)
    elapsed_s = time.perf_counter() - start_s
    assert output.shape[1] == input_ids.shape[1] + max_tokens, output.shape
    return elapsed_s


def decode_tokens_per_s(batch_size: int, output_len: int, first_s: float, full_s: float) -> float:
    decode_s = full_s - first_s
    return batch_size * (output_len - 1) / decode_s if decode_s > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="Packaged name or .gguf path.")
    parser.add_argument("--batch-sizes", type=parse_batch_sizes, default=[1, 8])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = resolve_model_source(ModelConfig(model=args.model))
    if source.gguf_path is None:
        raise SystemExit(f"{args.model} is not a GGUF model; this script compares GGUF loads")
    gguf = Path(source.gguf_path)
    print(f"model: {source.description}; torch threads: {torch.get_num_threads()}")

    start_s = time.perf_counter()
    largest = max(args.batch_sizes)
    pool_tokens = 2 * largest * (args.input_len + args.output_len) + 256
    engine = LLMEngine(EngineConfig.from_flat({
        "model": args.model, "dtype": "float32", "max_total_tokens": pool_tokens,
        "max_running_requests": max(largest, 1)}))
    print(f"servelm load: {time.perf_counter() - start_s:.2f} s")

    from transformers import AutoModelForCausalLM  # deferred: heavy import

    start_s = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    model.eval()
    pad_id = int(source.eos_token_ids[0]) if source.eos_token_ids else 0
    print(f"transformers load: {time.perf_counter() - start_s:.2f} s")

    vocab_size = min(engine.runner.vocab_size, model.config.vocab_size)
    warmup = random_prompts(largest, args.input_len, vocab_size, args.seed - 1)
    servelm_run(engine, warmup, 4, "warmup")
    transformers_run(model, warmup, 4, pad_id)

    rows = []
    for number, batch_size in enumerate(args.batch_sizes):
        seed = args.seed + 2 * number  # fresh prompts per run: no prefix-cache hits for servelm
        first = random_prompts(batch_size, args.input_len, vocab_size, seed)
        full = random_prompts(batch_size, args.input_len, vocab_size, seed + 1)
        ours = decode_tokens_per_s(batch_size, args.output_len,
                                   servelm_run(engine, first, 1, f"first-{batch_size}"),
                                   servelm_run(engine, full, args.output_len, f"full-{batch_size}"))
        theirs = decode_tokens_per_s(batch_size, args.output_len,
                                     transformers_run(model, first, 1, pad_id),
                                     transformers_run(model, full, args.output_len, pad_id))
        rows.append((batch_size, args.input_len, args.output_len, ours, theirs, ours / theirs))
        print(f"batch {batch_size} done", file=sys.stderr, flush=True)
    print(format_table(("batch", "input", "output", "servelm_tok/s", "transformers_tok/s",
                        "ratio"), rows))


if __name__ == "__main__":
    main()
