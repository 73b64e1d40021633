"""Start-up cost of serving a GGUF file in its own blocks: wall time and peak memory of the load.

Two ways to get the same model, each in a fresh subprocess (peak RSS is per process):
- ``float-then-blocks``: the old path: the whole model loaded as dequantized float weights, then the
  blocks read from the file again and checked against them (``load_model`` + ``apply_gguf_blocks``);
- ``blocks-first``: ``load_gguf_model`` (the runner's path): blocks put in place first, then only the
  remaining tensors (norms, biases) read and dequantized.

The kernel is loaded (from its cache) before the clock starts in both. Peak RSS is
``ru_maxrss`` of the child minus its RSS before the load (imports, torch, the kernel).

    .venv/bin/python benchmarks/gguf_load.py [--models qwen2.5-coder-0.5b,gemma3-270m] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(model: str, dtype_name: str, way: str) -> dict[str, float]:
    import torch

    from servelm.model.gguf.gguf_file import GGUFFile
    from servelm.model.gguf.gguf_weights import apply_gguf_blocks, load_gguf_model
    from servelm.model.gguf.gguf_kernel import load_kernel
    from servelm.model.loader import DTYPES, load_model
    from servelm.model.packaged import packaged_model_path

    torch.set_num_threads(1)
    path = packaged_model_path(model)
    config = GGUFFile.open(path).hf_config()
    load_kernel()
    before_kib = _rss_kib()
    dtype, cpu = DTYPES[dtype_name], torch.device("cpu")
    start = time.perf_counter()
    if way == "float-then-blocks":
        network = load_model(config, lambda: GGUFFile.open(path).tensors(), dtype, cpu)
        apply_gguf_blocks(network, path)
    else:
        network = load_gguf_model(config, path, dtype, cpu)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"s": seconds, "peak_mib": (peak_kib - before_kib) / 1024, "after_mib": (_rss_kib() - before_kib) / 1024}


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,gemma3-270m")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    print("| model | dtype | load | wall s | peak MiB above start | resident after MiB |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for way in ("float-then-blocks", "blocks-first"):
                result = subprocess.run([sys.executable, __file__, "--child", model, dtype, way],
                                        check=True, capture_output=True, text=True)
                row = json.loads(result.stdout.strip().splitlines()[-1])
                print(f"| {model} | {dtype} | {way} | {row['s']:.1f} | {row['peak_mib']:.0f} | "
                      f"{row['after_mib']:.0f} |", flush=True)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
