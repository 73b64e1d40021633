"""Served throughput of a GGUF model's default (its own blocks) against ``--quantization none``.

For each mode in ``--modes`` (servelm flags, ``;``-separated; the first is the baseline of the
ratios) it starts ``servelm serve MODEL --num-threads N <flags>`` alone, waits for it, and runs
``servelm bench serving`` twice on random 128-token prompts with 64 output tokens: 3 prompts at
concurrency 1 and 32 prompts at concurrency 32, the commands of benchmarks/RESULTS.md "GGUF
weights in their own blocks". Servers run one after another and are killed before the next starts
(server logs and bench JSON under ``--log-dir``). Noisy on a shared machine: compare within a run.

    .venv/bin/python benchmarks/gguf_serving.py [--model qwen2.5-coder-0.5b] [--num-threads 2] \\
        [--modes "--quantization auto;--quantization none"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_peers import stop_group, wait_ready  # noqa: E402

RUNS = (("1 stream", 3, 1), ("32 streams", 32, 32))
"""(label, --num-prompts, --max-concurrency)"""


def serve_and_bench(args: argparse.Namespace, flags: str, log_dir: Path, index: int) -> dict[str, dict]:
    base_url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "servelm", "serve", args.model, "--host", "127.0.0.1",
               "--port", str(args.port), *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
               *flags.split()]
    print(f"$ {' '.join(command[1:])}", file=sys.stderr, flush=True)
    with (log_dir / f"server{index}.log").open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(base_url, server, 900)
            results = {}
            for label, prompts, concurrency in RUNS:
                out = log_dir / f"bench{index}_{concurrency}.json"
                bench = [sys.executable, "-m", "servelm", "bench", "serving", "--base-url", base_url,
                         "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                         "--random-input-len", "128", "--random-output-len", "64", "--disable-tqdm",
                         "--output-file", str(out)]
                print(f"$ {' '.join(bench[1:])}", file=sys.stderr, flush=True)
                subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
                results[label] = json.loads(out.read_text())
            return results
        finally:
            stop_group(server, 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--modes", default="--quantization auto;--quantization none")
    parser.add_argument("--num-threads", type=int, default=None, help="server threads (default: its own)")
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--log-dir", default="/tmp/gguf_serving")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    rows = []
    for index, flags in enumerate(args.modes.split(";")):
        rows.append((flags.strip(), serve_and_bench(args, flags, log_dir, index)))
    print(f"load average after: {os.getloadavg()}", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(f"| {args.model} flags | 1 stream, output tok/s | 32 streams, output tok/s | 32 streams, ITL p50 ms |")
    print("|---|---|---|---|")
    for flags, results in rows:
        one, many = results["1 stream"], results["32 streams"]
        ratio = (("", "") if results is base else
                 (f" ({one['output_tokens_per_s'] / base['1 stream']['output_tokens_per_s']:.2f}x)",
                  f" ({many['output_tokens_per_s'] / base['32 streams']['output_tokens_per_s']:.2f}x)"))
        print(f"| `{flags}` | {one['output_tokens_per_s']:.1f}{ratio[0]} | {many['output_tokens_per_s']:.1f}"
              f"{ratio[1]} | {many['itl_ms']['median']:.0f} |")


if __name__ == "__main__":
    main()
