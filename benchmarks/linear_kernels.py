"""Micro-benchmark of the CPU linear kernels behind ``--quantization`` at real model shapes.

For each weight shape (K inputs x N outputs) of Gemma 3 270M and Qwen2.5 0.5B and each number of
rows M it times ``x [M, K] -> [M, N]`` through:

- ``fp32``: ``F.linear`` on float32 weights (the unquantized model);
- ``w8a8``: fbgemm's dynamic quantized linear with per-row activation scaling (``w8a8_int8``);
- ``i8pack``: ``torch._weight_int8pack_mm`` (int8 weight-only, per-channel scale) on bfloat16
  activations (cast included): its vectorised CPU path is bf16-only, float32 activations take a
  scalar reference loop 10-100x slower (``--fp32-packed`` adds those columns);
- ``i8deq``: int8 weights dequantized to float32 in row chunks, then a float32 matmul per chunk;
- ``i4pack-G``: ``torch._weight_int4pack_mm_for_cpu`` (int4 weight-only, group size G), bf16
  activations as above;
- ``i4deq``: int4 (group 128) unpacked and dequantized in row chunks, then a float32 matmul.

The table gives the minimum of repeated calls in milliseconds (the median is in the JSON): on a
shared 2-core machine OpenMP threads stall for whole scheduler quanta (8-32 ms) when another
process holds a core, which swamps medians of sub-millisecond calls. Compare within one run and
note the load average printed at the top and bottom.

    .venv/bin/python benchmarks/linear_kernels.py [--threads 2] [--models gemma,qwen] [--rows 1,8,32,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.model.layers import quantization as quant  # noqa: E402
from servelm.model.layers import weight_only as wo  # noqa: E402

SHAPES: dict[str, list[tuple[str, int, int]]] = {
    # name, K (in), N (out)
    "gemma": [("qkv", 640, 1536), ("o", 1024, 640), ("gate_up", 640, 4096), ("down", 2048, 640),
              ("head", 640, 262144)],
    "qwen": [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
             ("head", 896, 151936)],
}


def time_ms(fn: Callable[[], object], budget_s: float, max_runs: int = 30) -> tuple[float, float]:
    """(median, min) milliseconds of ``fn`` over up to ``max_runs`` calls within ``budget_s``."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def kernels(weight: torch.Tensor, groups: list[int],
            fp32_packed: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> ``x -> y`` for every candidate, each holding its own packed copy of ``weight``."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp32": lambda x: F.linear(x, weight)}
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    quant.Int8DynamicLinearMethod().process(layer)
    out["w8a8"] = lambda x: quant.Int8DynamicLinearMethod.apply(layer.linear_method, layer, x, None)
    q8, s8 = wo.quantize_int8_per_channel(weight)
    s8_bf16 = s8.bfloat16()
    out["i8pack"] = lambda x: torch._weight_int8pack_mm(x.bfloat16(), q8, s8_bf16).float()
    if fp32_packed:
        out["i8pack-f32"] = lambda x: torch._weight_int8pack_mm(x, q8, s8)
    out["i8deq"] = lambda x: wo.dequant_chunked_linear(x, q8, s8, None)
    for group in groups:
        packed, scale_zeros = wo.pack_int4(weight, group)
        out[f"i4pack-{group}"] = (lambda p, sz, g: lambda x: torch._weight_int4pack_mm_for_cpu(
            x.bfloat16(), p, g, sz).float())(packed, scale_zeros.bfloat16(), group)
        if fp32_packed:
            out[f"i4pack-{group}-f32"] = (lambda p, sz, g: lambda x: torch._weight_int4pack_mm_for_cpu(
                x, p, g, sz))(packed, scale_zeros, group)
    codes, s4, z4 = wo.quantize_int4_groupwise(weight, 128)
    nibbles = wo.pack_nibbles(codes)
    out["i4deq"] = lambda x: wo.dequant_chunked_linear(x, nibbles, s4, z4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="gemma,qwen")
    parser.add_argument("--rows", default="1,8,32,1024")
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--budget-s", type=float, default=0.4, help="time per (shape, M, kernel) cell")
    parser.add_argument("--fp32-packed", action="store_true",
                        help="also time the packed kernels on float32 activations (slow reference path)")
    parser.add_argument("--json", type=Path, help="also write every cell here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()}", flush=True)
    cells = []
    for model in args.models.split(","):
        for name, k, n in SHAPES[model]:
            weight = torch.randn(n, k) * 0.02
            candidates = kernels(weight, groups, args.fp32_packed)
            for rows in rows_list:
                if name == "head" and rows > 32:
                    continue    # prefill computes the head for the last position of each prompt only
                x = torch.randn(rows, k)
                line = {}
                for kernel, fn in candidates.items():
                    median, best = time_ms(lambda: fn(x), args.budget_s)
                    line[kernel] = best
                    cells.append({"model": model, "layer": name, "K": k, "N": n, "M": rows,
                                  "kernel": kernel, "median_ms": median, "min_ms": best})
                fastest = min(line, key=line.__getitem__)
                print(f"| {model} {name} {k}x{n} | {rows} | "
                      + " | ".join(f"{line[c]:.3g}" for c in candidates) + f" | {fastest} |", flush=True)
        print(f"(kernels: {' | '.join(candidates)})  load average {os.getloadavg()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
