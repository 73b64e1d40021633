"""One decode row (and a few) through the GGUF block kernel this CPU builds, against the dense float32
F.linear a CPU without a native bf16 GEMM would run on the dequantized weight (issue 30 section 4).

Qwen2.5-Coder-0.5B's shapes (Q4_K/Q6_K-like blocks of random codes); each case is timed in
interleaved rounds (every route once per round) and the median per call is printed, in ms, for each
thread count. The machine may be shared: read the ratios, not the absolute times.

    python benchmarks/gguf_avx2.py --threads 1 2 --rows 1 4 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from servelm.model.layers import gguf_kernel  # noqa: E402
from servelm.model.layers.gguf_blocks import BlockWeight  # noqa: E402

SHAPES = {"qkv 1152x896": (1152, 896, 32), "o 896x896": (896, 896, 32), "gate_up 9728x896": (9728, 896, 32),
          "down 896x4864 (Q6_K)": (896, 4864, 16), "head 151936x896": (151936, 896, 32)}


def weight(n: int, k: int, block: int) -> BlockWeight:
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    return BlockWeight(codes, torch.rand(n, k // block, generator=g) * 1e-2, None, block, "bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    kernel = gguf_kernel.load_kernel()
    print(f"kernel: {gguf_kernel.kernel_status()}")
    for name in args.shapes:
        n, k, block = SHAPES[name]
        w = weight(n, k, block)
        dense = w.dequantize()
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, k)
                routes = {"dense f32": lambda: F.linear(x, dense)}
                if kernel is not None:
                    for fn in ("block_linear_a16", "block_linear", "block_linear_float"):
                        routes[fn] = (lambda f=getattr(kernel, fn): f(x, w.codes, w.scales, w.offsets, w.block))
                times: dict[str, list[float]] = {route: [] for route in routes}
                reps = max(1, int(2e8 // (n * k)))
                for _ in range(args.rounds):
                    for route, run in routes.items():
                        start = time.perf_counter()
                        for _ in range(reps):
                            run()
                        times[route].append((time.perf_counter() - start) / reps * 1e3)
                medians = {route: statistics.median(t) for route, t in times.items()}
                base = medians["dense f32"]
                cells = "  ".join(f"{route} {ms:.3f} ({ms / base:.2f}x)" for route, ms in medians.items())
                print(f"{name:22s} M={rows:2d} t={threads}: {cells}", flush=True)


if __name__ == "__main__":
    main()
