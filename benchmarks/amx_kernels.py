"""The AMX kernels of session 47 against what they replace, on the CPU at hand (AMX tiles needed).

- ``layers``: a GGUF layer's product at m rows, ms a call, each kernel cycling through ``--layers``
  copies of the weight (a decode step reads every layer once: the copies are read from memory, not
  the cache): ``dense`` (oneDNN on the bf16 copy), ``rows`` (gguf_rows ``rows_gemm`` on the copy at the
  codes' bit width: vdpbf16ps), ``rows-nta`` (the same with non-temporal prefetches for a call of one
  row group, ``set_nta_prefetch``: the earlier constant), ``amx`` (``amx_gemm`` on the same copy: the
  dense copy's weights widened per call into AMX tiles; its prefetches always T0).
- ``screen``: the int8 LM-head screen (gguf_i8gemm ``i8_screen``) over a 262,144 x 640 Q8_0 head at m
  rows, its GEMM on VNNI or on AMX tiles (the same candidates).

    .venv/bin/python benchmarks/amx_kernels.py [--rows 1,4,8,16,32,64,128] [--threads 2] [--parts layers,screen]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.model.gguf import gguf_i8gemm, gguf_rows  # noqa: E402
from servelm.model.gguf.gguf_blocks import BlockWeight  # noqa: E402

SHAPES = (  # (outputs, inputs, code range, block, offsets): Gemma 3 270M's and Qwen2.5-Coder 0.5B's largest
    (4096, 640, (-16, 15), 32, False),    # Gemma 3 gate_up, Q5_0
    (640, 2048, (-32, 31), 16, False),    # Gemma 3 down, Q6_K
    (9728, 896, (-16, 15), 32, False),    # Qwen2.5 gate_up, Q5_0
    (896, 4864, (0, 15), 32, True),       # Qwen2.5 down, Q4_K
)


def best_ms(call: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def layers(rows: list[int], copies: int) -> None:
    kernel = gguf_rows.load_kernel()
    if kernel is None or not gguf_rows.amx_ready(kernel):
        print("layers: no rows kernel with AMX here:", gguf_rows.kernel_status())
        return
    print("| shape | m | dense | rows | rows-nta | amx | dense / amx |\n|---|---|---|---|---|---|---|")
    before = kernel.nta_prefetch()
    for n, k, (low, high), block, offsets in SHAPES:
        generator = torch.Generator().manual_seed(n + k)
        held = []
        for _ in range(copies):
            codes = torch.randint(low, high + 1, (n, k), dtype=torch.int8, generator=generator)
            scales = torch.rand(n, k // block, generator=generator) * 0.01
            offs = (torch.rand(n, k // block, generator=generator) - 0.5) * 0.01 if offsets else None
            weight = BlockWeight(codes, scales, offs, block, "test")
            held.append((gguf_rows.pack(codes, scales, offs, kernel.GEMM_COLS, bits=True),
                         weight.dequantize(dtype=torch.bfloat16)))
        for m in rows:
            x = torch.randn(m, k, generator=generator).bfloat16()

            def each(run: Callable[[tuple, torch.Tensor], object], nta: bool = False) -> float:
                kernel.set_nta_prefetch(nta)
                return best_ms(lambda: [run(p, d) for p, d in held]) / copies

            dense = each(lambda p, d: F.linear(x, d))
            rows_ms = each(lambda p, d: kernel.rows_gemm(x, *p, block, True, n))
            rows_nta = each(lambda p, d: kernel.rows_gemm(x, *p, block, True, n), nta=True)
            amx = each(lambda p, d: kernel.amx_gemm(x, *p, block, True, n))
            print(f"| {n}x{k} | {m} | {dense:.3f} | {rows_ms:.3f} | {rows_nta:.3f} | {amx:.3f} | {dense / amx:.2f}x |",
                  flush=True)
    kernel.set_nta_prefetch(before)


def screen(rows: list[int]) -> None:
    kernel = gguf_i8gemm.load_kernel()
    if kernel is None or not kernel.amx_permitted():
        print("screen: no VNNI int8 GEMM with AMX here:", gguf_i8gemm.kernel_status())
        return
    n, k = 262_144, 640
    generator = torch.Generator().manual_seed(7)
    weight = BlockWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
                         torch.rand(n, k // 32, generator=generator) * 0.01, None, 32, "Q8_0")
    codes, scales, _ = gguf_i8gemm.screen_pack(kernel, weight)
    bound_max = torch.rand(n, generator=generator) * 1e-3
    bound_sum = bound_max * 4
    print("| head | m | VNNI ms | AMX ms | VNNI / AMX |\n|---|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, k, generator=generator)
        times = {}
        for amx in (False, True, False, True):
            ms = best_ms(lambda: kernel.i8_screen(x, codes, scales, n, bound_max, bound_sum, 0.01, 256, amx=amx))
            times[amx] = min(times.get(amx, ms), ms)
        print(f"| {n}x{k} | {m} | {times[False]:.2f} | {times[True]:.2f} | {times[False] / times[True]:.2f}x |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=18, help="copies of each weight a timing cycles through")
    parser.add_argument("--parts", default="layers,screen")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(v) for v in args.rows.split(",")]
    parts = args.parts.split(",")
    if "layers" in parts:
        layers(rows, args.layers)
    if "screen" in parts:
        screen(rows)


if __name__ == "__main__":
    main()
