"""Where each GGUF path should take the rows of a bf16 model: the block kernels and the dense bf16
copy as the served model calls them, per weight shape (the four decoder shapes and the LM head) and
number of rows M.

- ``gemm``: ``gguf_rows.rows_gemm`` on the copy ``gguf_rows.pack`` makes at load (int8 codes in
  VNNI order; the micro-kernel of 8 rows x 32 outputs, scales per block in float32), as the layer
  calls it: bf16 in, bf16 out (float32 out for the head).
- ``rows``: ``gguf_rows.rows_linear`` (AVX512-BF16: codes widened to bf16 once per call, vdpbf16ps
  against every row, scales in float32), bf16 in, bf16 out (float32 out for the head).
- ``int16``: ``block_linear_a16`` (the VNNI kernel, ``--quantization gguf``'s int16 activations) on
  bf16 input, as the layer calls it (bf16 out; float32 for the head).
- ``dense``: ``F.linear`` on bf16 input and the layer's bf16 dequantized copy (oneDNN); the head's
  result then widened to float32, as the layer does.
- ``i8``: ``gguf_i8gemm.i8_gemm`` (activations rounded to int8 per block, vpdpbusd on the codes packed
  at load), bf16 in, bf16 out (float32 out for the head).
- ``--kernels`` picks the columns; besides the above ``int16-core`` (float32 input, no conversions)
  and ``a8`` (``block_linear``, ``--quantization gguf_a8``).

Medians of repeated calls; ``--clock thread`` reads this thread's CPU time (1 thread: unaffected by
other processes on a shared machine; with 2 threads it misses the worker's time, so use wall).

    .venv/bin/python benchmarks/gguf_rows.py --threads 1 --clock thread --rows 1,2,3,4,5,6,8,12,16,24,31,32,64
    .venv/bin/python benchmarks/gguf_rows.py --threads 2 --clock wall --shapes head
    .venv/bin/python benchmarks/gguf_rows.py --kernels i8,gemm,dense --rows 1,8,16,32,128,512
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

from servelm.model.gguf import gguf_i8gemm, gguf_rows  # noqa: E402
from servelm.model.gguf.gguf_kernel import load_kernel  # noqa: E402


KERNELS = ("i8", "gemm", "rows", "int16", "dense", "int16-core", "a8")


def medians_ms(fns: list[Callable[[], object]], clock: Callable[[], float], calls: int) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turn ``calls`` times (interleaved, so a
    noisy neighbour moves all of them alike)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, spent in zip(fns, times):
            start = clock()
            fn()
            spent.append(clock() - start)
    return [1e3 * statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,head")
    parser.add_argument("--rows", default="1,2,4,6,8,16,32,64")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--kernels", default="i8,gemm,rows,int16,dense",
                        help=f"columns, from {','.join(KERNELS)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernel, rows_kernel, i8_kernel = load_kernel(), gguf_rows.load_kernel(), gguf_i8gemm.load_kernel()
    assert kernel is not None and rows_kernel is not None and i8_kernel is not None, "no GGUF block kernels here"
    names = args.kernels.split(",")
    ratios = [(a, b) for a, b in (("i8", "dense"), ("i8", "gemm"), ("gemm", "dense"), ("gemm", "int16"),
                                  ("gemm", "rows")) if a in names and b in names]
    print(f"# {args.model}, {args.threads} threads, {args.clock} clock, load {os.getloadavg()[0]:.1f}")
    print("| shape (K x N) | M |" + "".join(f" {name} ms |" for name in names)
          + "".join(f" {a} / {b} |" for a, b in ratios))
    print("|---|---|" + "---|" * (len(names) + len(ratios)))
    totals: dict[int, dict[str, float]] = {}
    wanted = args.shapes.split(",")
    for shape, k, n in SHAPES[args.model]:
        if shape not in wanted:
            continue
        is_head = shape == "head"
        calls = max(5, args.calls // 4) if is_head else args.calls
        torch.manual_seed(0)
        weight = random_block_weight(n, k, offsets=False)
        dense = weight.dequantize(dtype=torch.bfloat16) if "dense" in names else None
        codes, scales = weight.codes, weight.scales
        packed_codes, packed_scales, _ = gguf_rows.pack(codes, scales, None, rows_kernel.GEMM_COLS)
        i8_codes, i8_scales, _ = gguf_i8gemm.pack(weight)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            xf = x.float()
            fns = {"i8": lambda: i8_kernel.i8_gemm(x, i8_codes, i8_scales, None, 32, not is_head, n),
                   "gemm": lambda: rows_kernel.rows_gemm(x, packed_codes, packed_scales, None, 32, not is_head, n),
                   "rows": lambda: rows_kernel.rows_linear(x, codes, scales, None, 32, not is_head),
                   "int16": lambda: kernel.block_linear_a16(x, codes, scales, None, 32, not is_head),
                   "dense": (lambda: F.linear(x, dense).float()) if is_head else (lambda: F.linear(x, dense)),
                   "int16-core": lambda: kernel.block_linear_a16(xf, codes, scales, None, 32),
                   "a8": lambda: kernel.block_linear(x, codes, scales, None, 32, not is_head)}
            measured = dict(zip(names, medians_ms([fns[name] for name in names], clock, calls)))
            if not is_head:
                sums = totals.setdefault(m, dict.fromkeys(names, 0.0))
                for name, value in measured.items():
                    sums[name] += value
            print(f"| {shape} {k}x{n} | {m} |" + "".join(f" {value:.3f} |" for value in measured.values())
                  + "".join(f" {measured[a] / measured[b]:.2f} |" for a, b in ratios), flush=True)
    for m, sums in totals.items():
        print(f"| decoder layers (sum) | {m} |" + "".join(f" {value:.3f} |" for value in sums.values())
              + "".join(f" {sums[a] / sums[b]:.2f} |" for a, b in ratios))
    print(f"# load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
