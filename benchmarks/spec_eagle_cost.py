"""What an EAGLE / EAGLE-3 head costs next to its model: medians of interleaved timings, in one run,
of a model decode step (1 token), a verify step (k + 1 tokens) and one head step, for random-weight
heads in the published formats (``servelm.model.eagle_checkpoint``; no trained head exists offline,
so no acceptance is measured: the break-even accept length follows from the costs).

    python benchmarks/spec_eagle_cost.py [--model qwen2.5-coder-0.5b] [--k 3] [--reps 12]

Heads: EAGLE-1 scored by the model's whole LM head, EAGLE-1 with a 32k-token --speculative-token-map,
EAGLE-3 with a 32k draft vocabulary. A step of k drafts costs verify + k head steps; speculation pays
once the accept length (tokens per verify pass) exceeds that over a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from servelm.config import EngineConfig
from servelm.engine.eagle import load_token_map
from servelm.engine.engine import LLMEngine
from servelm.model.eagle import EagleHeadRunner
from servelm.model.eagle_checkpoint import write_random_head
from servelm.model.forward_batch import BatchPlan, SequencePlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_flat(dict(model=args.model, num_threads=1, dtype=args.dtype,
                                                   max_total_tokens=4096)))
    runner = engine.runner
    root = Path(tempfile.mkdtemp(prefix="eagle-cost-"))
    torch.save(torch.arange(min(32000, runner.vocab_size)), root / "hot.pt")
    heads: dict[str, EagleHeadRunner] = {}
    for name, algorithm, token_map in [("EAGLE-1, whole LM head", "EAGLE", None),
                                       ("EAGLE-1, 32k token map", "EAGLE", root / "hot.pt"),
                                       ("EAGLE-3, 32k draft vocabulary", "EAGLE3", None)]:
        path = write_random_head(runner.hf_config, algorithm, root / algorithm)
        head = EagleHeadRunner(str(path), algorithm, runner.hf_config, runner.block_size,
                               load_token_map(str(token_map), runner.vocab_size) if token_map else None)
        head.init_kv_cache(64)
        head.attach(runner.model, runner.attention, runner.device, runner.dtype, runner.kv_dtype)
        heads[name] = head
    hidden = runner.hidden_size
    blocks = list(range(40))
    prompt = list(range(1000, 1128))
    runner.execute(BatchPlan([SequencePlan(prompt, 0, blocks)]))
    for head in heads.values():
        width = 3 * hidden if head.is_eagle3 else hidden
        head.forward([SequencePlan(prompt[1:], 0, blocks[:20])], torch.randn(len(prompt) - 1, width), True)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1000

    verify = [5 + i for i in range(args.k + 1)]
    times: dict[str, list[float]] = {"decode step (1 token)": [], f"verify step ({args.k + 1} tokens)": [],
                                     **{name: [] for name in heads}}
    for _ in range(args.reps):
        times["decode step (1 token)"].append(timed(lambda: runner.execute(
            BatchPlan([SequencePlan([5], len(prompt), blocks)]))))
        times[f"verify step ({args.k + 1} tokens)"].append(timed(lambda: runner.execute(
            BatchPlan([SequencePlan(verify, len(prompt), blocks, num_logits=len(verify))]))))
        for name, head in heads.items():
            times[name].append(timed(lambda: head.forward(
                [SequencePlan([5], len(prompt) - 1, blocks[:20])], torch.randn(1, hidden), False)))
    medians = {name: statistics.median(values) for name, values in times.items()}
    decode, verify_ms = medians["decode step (1 token)"], medians[f"verify step ({args.k + 1} tokens)"]
    print(f"{args.model}, {args.dtype}, one thread, k = {args.k}, medians of {args.reps}:")
    for name, value in medians.items():
        line = f"  {name}: {value:.1f} ms ({value / decode:.2f}x a decode step)"
        if name in heads:
            line += f"; break-even accept length {(verify_ms + args.k * value) / decode:.2f}"
        print(line)


if __name__ == "__main__":
    main()
