"""Engine RSS growth and speed under shape churn for several --onednn-primitive-cache-capacity values.

oneDNN caches one primitive per linear shape (batch size, chunk length); its default keeps 1024,
and a varied load grows the engine's memory until the cache is full (issue 19). Each capacity runs
in its own process (oneDNN reads the setting once, at its first primitive), the trials
interleaved (A B C A B C) so a noisy machine slows all of them alike. Per trial:

- warm-up, then anonymous RSS (RssAnon) after an idle ``malloc_trim`` (what the engine does when idle);
- ``--rounds`` rounds of requests with random prompt lengths, output lengths and arrival waves
  (a new batch shape nearly every step), RSS after each (again trimmed), and the round's time;
- decode tok/s of 8 streams: ``8 * (n - 1) / (t(n) - t(1))``, best of three.

Part 2 (``--shapes``, no model): the cost of a cache too small for the shapes in use. A "step"
is SmolLM2-135M's four bf16 linear shapes at one batch size; cycling through 2 batch sizes needs 8
primitives, through 16 needs 64. Each capacity in its own process, 3 s per cell, interleaved.

    .venv/bin/python benchmarks/onednn_cache.py [--model smollm2-135m] [--capacities default,8,64]
    .venv/bin/python benchmarks/onednn_cache.py --shapes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.engine.heap import release_free_memory  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402


def _rss_mib() -> float:
    """Anonymous resident memory (RssAnon): the heap and the caches, without the file pages of
    the memory-mapped weights, which the kernel drops and reads back under memory pressure."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon")


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def _churn_round(engine: LLMEngine, rng: random.Random, num_requests: int, vocab: int, tag: str) -> float:
    """Requests arriving in waves of 1-8, random prompt (4-300) and output (1-24) lengths."""
    started = time.perf_counter()
    added = 0
    while added < num_requests:
        for _ in range(min(rng.randint(1, 8), num_requests - added)):
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(4, 300))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
            assert engine.add_request(f"{tag}-{added}", prompt, params) is None
            added += 1
        for _ in range(rng.randint(1, 6)):
            if engine.has_unfinished():
                engine.step()
    _drain(engine)
    return time.perf_counter() - started


def _decode_tok_s(engine: LLMEngine, rng: random.Random, vocab: int, tag: str, output_len: int = 48) -> float:
    def run(max_tokens: int, name: str) -> float:
        prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            assert engine.add_request(f"{tag}-{name}-{index}", prompt, params) is None
        _drain(engine)
        return time.perf_counter() - started
    return 8 * (output_len - 1) / max(1e-9, run(output_len, "full") - run(1, "first"))


def trial(model: str, capacity: int | None, rounds: int, num_requests: int, seed: int) -> dict:
    engine = LLMEngine(EngineConfig.from_flat({
        "model": model, "num_threads": 1, "max_total_tokens": 16384, "context_length": 1024,
        "onednn_primitive_cache_capacity": capacity}))
    vocab = engine.runner.vocab_size
    rng = random.Random(seed)
    _churn_round(engine, random.Random(seed - 1), 4, vocab, "warm")
    _decode_tok_s(engine, rng, vocab, "warm")
    release_free_memory()
    rss = [_rss_mib()]
    round_s = []
    for number in range(rounds):
        round_s.append(_churn_round(engine, rng, num_requests, vocab, f"r{number}"))
        release_free_memory()
        rss.append(_rss_mib())
    tok_s = max(_decode_tok_s(engine, rng, vocab, f"d{i}") for i in range(3))
    engine.shutdown()
    return {"capacity": capacity, "rss_mib": rss, "round_s": round_s, "decode_tok_s": tok_s}


LINEARS = ((576, 960), (576, 576), (576, 3072), (1536, 576))
"""SmolLM2-135M's linear shapes (in, out): qkv, o, gate_up, down."""


def shapes_trial(batch_sizes: list[int], seconds: float = 3.0) -> float:
    """Microseconds per step (the four linears at one batch size), cycling through ``batch_sizes``."""
    import torch

    torch.set_num_threads(1)
    weights = [torch.randn(out, inp, dtype=torch.bfloat16) for inp, out in LINEARS]
    inputs = {(m, inp): torch.randn(m, inp, dtype=torch.bfloat16) for m in batch_sizes for inp, _ in LINEARS}

    def step(m: int) -> None:
        for weight in weights:
            torch.nn.functional.linear(inputs[(m, weight.shape[1])], weight)

    for m in batch_sizes:
        step(m)
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        for m in batch_sizes:
            step(m)
            count += 1
    return (time.perf_counter() - started) / count * 1e6


def main_shapes(capacities: list[str], repeats: int) -> None:
    cycles = {"2 batch sizes (8 primitives)": "8,9",
              "16 batch sizes (64 primitives)": ",".join(str(m) for m in range(8, 24))}
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for cycle in cycles.values():
            for name in capacities:
                env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
                if name != "default":
                    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = name
                done = subprocess.run([sys.executable, __file__, "--shapes-trial", cycle], env=env,
                                      capture_output=True, text=True, check=True)
                results.setdefault((cycle, name), []).append(float(done.stdout.split()[-1]))
    print("| cycle | " + " | ".join(f"capacity {name}" for name in capacities) + " |")
    print("|---|" + "---|" * len(capacities))
    for label, cycle in cycles.items():
        base = statistics.median(results[(cycle, capacities[0])])
        cells = [f"{statistics.median(results[(cycle, n)]):.0f} us ({statistics.median(results[(cycle, n)]) / base:.2f}x)"
                 for n in capacities]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--capacities", default="default,8,64",
                        help="comma-separated; 'default' leaves oneDNN's own (1024)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", action="store_true", help="part 2: the thrash cost, no model")
    parser.add_argument("--shapes-trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shapes_trial is not None:
        print(shapes_trial([int(m) for m in args.shapes_trial.split(",")]))
        return
    if args.shapes:
        main_shapes(args.capacities.split(","), args.repeats)
        return
    if args.trial is not None:
        capacity = None if args.trial == "default" else int(args.trial)
        os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
        print(json.dumps(trial(args.model, capacity, args.rounds, args.requests, args.seed)))
        return
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for name in args.capacities.split(","):
            command = [sys.executable, __file__, "--trial", name, "--model", args.model,
                       "--rounds", str(args.rounds), "--requests", str(args.requests),
                       "--seed", str(args.seed)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat} capacity {name} done", file=sys.stderr, flush=True)
    print(f"model {args.model}, 1 thread, {args.rounds} churn rounds x {args.requests} requests, "
          f"{args.repeats} interleaved repeats; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    base = results[args.capacities.split(",")[0]]
    base_tok_s = statistics.median(r["decode_tok_s"] for r in base)
    base_round_s = statistics.median(sum(r["round_s"]) for r in base)
    print("| capacity | RssAnon idle -> after each round (MiB), per repeat | growth MiB | churn s | "
          "churn vs first | decode tok/s | decode vs first |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        rss = "; ".join(" -> ".join(f"{v:.0f}" for v in r["rss_mib"]) for r in runs)
        growth = statistics.median(r["rss_mib"][-1] - r["rss_mib"][0] for r in runs)
        churn = statistics.median(sum(r["round_s"]) for r in runs)
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        print(f"| {name} | {rss} | {growth:+.0f} | {churn:.1f} | {churn / base_round_s:.2f} | "
              f"{tok_s:.1f} | {tok_s / base_tok_s:.2f} |")


if __name__ == "__main__":
    main()
