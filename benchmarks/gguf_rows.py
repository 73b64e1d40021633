"""Where the GGUF block kernel should hand over to the dense bf16 copy: both paths as the served
bf16 model calls them, per decoder weight shape and number of rows M.

- ``kernel``: ``block_linear_a16`` (``--quantization gguf``'s int16 activations) on bf16 input,
  with the conversions the layer does around it (to float32 and contiguous, back to bf16).
- ``kernel-core``: the kernel alone on float32 input (what the conversions cost is the gap).
- ``kernel-a8``: ``block_linear`` (``--quantization gguf_a8``'s int8 activations), conversions included.
- ``dense``: ``F.linear`` on bf16 input and the layer's bf16 dequantized copy (oneDNN).

Medians of repeated calls; ``--clock thread`` reads this thread's CPU time (1 thread: unaffected by
other processes on a shared machine; with 2 threads it misses the worker's time, so use wall).

    .venv/bin/python benchmarks/gguf_rows.py --threads 1 --clock thread --rows 1,2,4,8,16,24,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_kernels import random_block_weight  # noqa: E402
from linear_kernels import SHAPES  # noqa: E402

from servelm.model.layers.gguf_kernel import load_kernel  # noqa: E402


def median_ms(fn: Callable[[], object], clock: Callable[[], float], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernel = load_kernel()
    assert kernel is not None, "no GGUF block kernel on this CPU"
    print(f"# {args.model}, {args.threads} threads, {args.clock} clock, load {os.getloadavg()[0]:.1f}")
    print("| shape (K x N) | M | kernel ms | kernel-core ms | kernel-a8 ms | dense bf16 ms | kernel / dense |")
    print("|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for name, k, n in SHAPES[args.model]:
        if name == "head":
            continue   # the LM head is another engineer's (lmhead)
        torch.manual_seed(0)
        weight = random_block_weight(n, k, offsets=False)
        dense = weight.dequantize(dtype=torch.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            xf = x.float()
            a = median_ms(lambda: kernel.block_linear_a16(x.float().contiguous(), weight.codes,
                                                          weight.scales, None, 32).to(torch.bfloat16),
                          clock, args.calls)
            core = median_ms(lambda: kernel.block_linear_a16(xf, weight.codes, weight.scales, None, 32),
                             clock, args.calls)
            a8 = median_ms(lambda: kernel.block_linear(x.float().contiguous(), weight.codes,
                                                       weight.scales, None, 32).to(torch.bfloat16),
                           clock, args.calls)
            b = median_ms(lambda: F.linear(x, dense), clock, args.calls)
            sums = totals.setdefault(rows, [0.0, 0.0, 0.0])
            sums[0] += a
            sums[1] += b
            sums[2] += a8
            print(f"| {name} {k}x{n} | {rows} | {a:.3f} | {core:.3f} | {a8:.3f} | {b:.3f} | {a / b:.2f} |",
                  flush=True)
    for rows, (a, b, a8) in totals.items():
        print(f"| all four | {rows} | {a:.3f} | | {a8:.3f} | {b:.3f} | {a / b:.2f} |")
    print(f"# load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
