"""Single-stream decode with one core taken by another process, per OpenMP wait policy (issue 16.3).

Users' machines are never idle. This runs each setting (``--omp-wait-policy`` x ``--num-threads`` x
adaptive threads)
in its own python process (OpenMP reads its wait policy once, when torch loads), first on a quiet
machine and then with a competing busy loop pinned to the last CPU, and prints decode tok/s and
the share of the quiet speed each keeps. Settings alternate within a round, so a change in the
machine's background load hits all of them.

    .venv/bin/python benchmarks/busy_core.py [--model gemma3-270m] [--settings default:2,default:2:fixed]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_loop(cpu: int) -> None:
    """The competing process: one core, spinning."""
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def measure(model: str, policy: str, threads: int, adaptive: bool, input_len: int, output_len: int) -> float:
    """Decode tok/s of one fresh process running ``--omp-wait-policy policy`` (after a warm-up long
    enough for adaptive threads to settle: it needs two readings a second apart)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin"):                 # spinN: libgomp spins N iterations, then sleeps
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin")
        policy = "default"
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()   # what servelm exports for its engine process
    code = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
from decode_vs_transformers import servelm_run
from servelm.bench_common import random_prompts
from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
engine = LLMEngine(EngineConfig.from_flat({{"model": {model!r}, "num_threads": {threads},
    "omp_wait_policy": {policy!r}, "disable_adaptive_threads": {not adaptive!r}, "max_total_tokens": 4096}}))
vocab = min(50000, engine.runner.vocab_size)
servelm_run(engine, random_prompts(1, {input_len}, vocab, 1), 96, "warm")
first = servelm_run(engine, random_prompts(1, {input_len}, vocab, 2), 1, "a")
full = servelm_run(engine, random_prompts(1, {input_len}, vocab, 3), {output_len}, "b")
print(json.dumps({{"tok_s": ({output_len} - 1) / (full - first)}}))
"""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True)
    return float(json.loads(result.stdout.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--settings", default="default:2,default:2:fixed,passive:2:fixed,default:1",
                        help="comma-separated POLICY:THREADS[:fixed]; POLICY is an --omp-wait-policy "
                        "value or spinN (GOMP_SPINCOUNT=N with the runtime's default policy); fixed: "
                        "--disable-adaptive-threads")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="runs per setting and condition (median)")
    args = parser.parse_args()
    settings = [(item.split(":")[0], int(item.split(":")[1]), not item.endswith(":fixed"))
                for item in args.settings.split(",")]
    results: dict[tuple[str, int, bool], dict[str, list[float]]] = {
        setting: {"quiet": [], "busy": []} for setting in settings}
    busy_cpu = max(os.sched_getaffinity(0))
    for condition in ("quiet", "busy"):
        competitor = None
        if condition == "busy":
            competitor = multiprocessing.get_context("spawn").Process(target=busy_loop, args=(busy_cpu,),
                                                                     daemon=True)
            competitor.start()
        try:
            for _ in range(args.rounds):
                for policy, threads, adaptive in settings:
                    results[(policy, threads, adaptive)][condition].append(
                        measure(args.model, policy, threads, adaptive, args.input_len, args.output_len))
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.join()
    print(f"{args.model}, decode of {args.output_len} tokens after a {args.input_len}-token prompt; "
          f"busy = a spinning process pinned to CPU {busy_cpu}; load average now "
          f"{os.getloadavg()[0]:.2f}")
    print("| --omp-wait-policy | --num-threads | adaptive threads | quiet tok/s | busy tok/s | busy / quiet |")
    print("|---|---|---|---|---|---|")
    for (policy, threads, adaptive), runs in results.items():
        quiet = sorted(runs["quiet"])[len(runs["quiet"]) // 2]
        busy = sorted(runs["busy"])[len(runs["busy"]) // 2]
        print(f"| {policy} | {threads} | {'on' if adaptive else 'off'} | {quiet:.1f} | {busy:.1f} | "
              f"{busy / quiet:.0%} |")


if __name__ == "__main__":
    main()
