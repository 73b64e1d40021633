"""The float32 few-rows kernel (servelm/model/layers/f32_rows.cpp) against oneDNN's linear, in one process.

    python benchmarks/f32_rows.py [--threads 1 2] [--rows 1 2 4 8 16 32]

Shapes: a Qwen3 LM head (151936 x 1024) and the MoE benchmark's expert projections (gate+up
1536 x 1024, down 1024 x 768); the small shapes cycle through copies of their weight over 96 MB, so
neither route reads them from cache (as in serving). Median ms per call, interleaved rounds
(servelm/model/timing.py), and the weight bytes per second of the faster route.
"""

from __future__ import annotations

import argparse

import torch

from servelm.model.layers import f32_rows
from servelm.model.timing import time_candidates

SHAPES = ((151936, 1024), (1536, 1024), (1024, 768))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = parser.parse_args()
    kernel = f32_rows.load_kernel()
    if kernel is None:
        raise SystemExit(f"kernel not built: {f32_rows.kernel_status()}")
    print("| threads | N x K | rows | oneDNN ms | kernel ms | speed-up | kernel GB/s |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            shape = f32_rows.DenseShape(n, k)
            weights = ([torch.randn(n, k)] if n * k * 4 >= f32_rows.MEASURE_MIN_BYTES   # the head: whole
                       else f32_rows.synthetic_weights(shape, f32_rows.MEASURE_MIN_BYTES))
            for rows in args.rows:
                synthetic = f32_rows._Synthetic(shape, rows, weights, kernel)
                times = time_candidates({"kernel": synthetic.run_kernel, "onednn": synthetic.run_onednn},
                                        min_rounds=5, max_rounds=30, budget_s=1.0)
                gbps = n * k * 4 / (times["kernel"] * 1e-6) / 1e9
                print(f"| {threads} | {n} x {k} | {rows} | {times['onednn'] / 1e3:.2f} | {times['kernel'] / 1e3:.2f} "
                      f"| {times['onednn'] / times['kernel']:.2f}x | {gbps:.1f} |", flush=True)


if __name__ == "__main__":
    main()
