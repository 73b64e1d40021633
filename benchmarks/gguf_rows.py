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
- ``--extra`` adds ``int16-core`` (float32 input, no conversions) and ``a8`` (``block_linear``,
  ``--quantization gguf_a8``).

Medians of repeated calls; ``--clock thread`` reads this thread's CPU time (1 thread: unaffected by
other processes on a shared machine; with 2 threads it misses the worker's time, so use wall).

    .venv/bin/python benchmarks/gguf_rows.py --threads 1 --clock thread --rows 1,2,3,4,5,6,8,12,16,24,31,32,64
    .venv/bin/python benchmarks/gguf_rows.py --threads 2 --clock wall --shapes head
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

from servelm.model.layers import gguf_rows  # noqa: E402
from servelm.model.layers.gguf_kernel import load_kernel  # noqa: E402


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
    parser.add_argument("--extra", action="store_true", help="also the int16 kernel alone and the int8 one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernel, rows_kernel = load_kernel(), gguf_rows.load_kernel()
    assert kernel is not None and rows_kernel is not None, "no GGUF block kernels on this CPU"
    print(f"# {args.model}, {args.threads} threads, {args.clock} clock, load {os.getloadavg()[0]:.1f}")
    extra = " int16-core ms | a8 ms |" if args.extra else ""
    print(f"| shape (K x N) | M | gemm ms | rows ms | int16 ms | dense bf16 ms |{extra} gemm / dense | gemm / int16 "
          "| gemm / rows |")
    print("|---|---|---|---|---|---|" + "---|" * (5 if args.extra else 3))
    totals: dict[int, list[float]] = {}
    wanted = args.shapes.split(",")
    for name, k, n in SHAPES[args.model]:
        if name not in wanted:
            continue
        is_head = name == "head"
        calls = max(5, args.calls // 4) if is_head else args.calls
        torch.manual_seed(0)
        weight = random_block_weight(n, k, offsets=False)
        dense = weight.dequantize(dtype=torch.bfloat16)
        codes, scales = weight.codes, weight.scales
        packed_codes, packed_scales, _ = gguf_rows.pack(codes, scales, None, rows_kernel.GEMM_COLS)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            xf = x.float()
            fns = [lambda: rows_kernel.rows_gemm(x, packed_codes, packed_scales, None, 32, not is_head, n),
                   lambda: rows_kernel.rows_linear(x, codes, scales, None, 32, not is_head),
                   lambda: kernel.block_linear_a16(x, codes, scales, None, 32, not is_head),
                   (lambda: F.linear(x, dense).float()) if is_head else (lambda: F.linear(x, dense))]
            if args.extra:
                fns += [lambda: kernel.block_linear_a16(xf, codes, scales, None, 32),
                        lambda: kernel.block_linear(x, codes, scales, None, 32, not is_head)]
            measured = medians_ms(fns, clock, calls)
            gemm, rows, a16, b = measured[:4]
            cells = "".join(f" {value:.3f} |" for value in measured)
            if not is_head:
                sums = totals.setdefault(m, [0.0, 0.0, 0.0, 0.0])
                for index, value in enumerate((gemm, rows, a16, b)):
                    sums[index] += value
            print(f"| {name} {k}x{n} | {m} |{cells} {gemm / b:.2f} | {gemm / a16:.2f} | {gemm / rows:.2f} |",
                  flush=True)
    for m, (gemm, rows, a16, b) in totals.items():
        print(f"| decoder layers (sum) | {m} | {gemm:.3f} | {rows:.3f} | {a16:.3f} | {b:.3f} |"
              f"{' | |' if args.extra else ''} {gemm / b:.2f} | {gemm / a16:.2f} | {gemm / rows:.2f} |")
    print(f"# load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
