"""Kernel table for GGUF block-quantized weights at Gemma 3 270M and Qwen2.5 0.5B shapes.

For each weight shape (K inputs x N outputs; the LM heads included: 262,144 and 151,936 rows) and
each number of rows M it times ``x [M, K] float32 -> [M, N]`` through:

- ``fp32`` / ``bf16``: ``F.linear`` on the dequantized weight in float32 / bfloat16 (bf16: x cast
  in the call). The reference columns: every other column is a ratio to these, measured in the
  same run.
- ``blk``: servelm's AVX512-VNNI kernel (servelm/model/gguf/gguf_kernel.cpp) on int8 codes with a
  float32 scale per 32 inputs: Q8_0 as stored, and every other repackable type after its lossless
  repack (gguf_blocks.py). Activations quantized to int8 per 32 inputs in the call, as llama.cpp.
- ``blk-off``: the same with an offset per block too (Q4_1, Q4_K, Q5_K).
- ``blkf``: the same weights, float32 activations: codes dequantized in registers and multiplied
  in float (no activation rounding; equals the float32 dequantized layer up to summation order).
- ``blk16``: activations rounded to 16 bits per 32 inputs as two int8 halves, two VNNI dot
  products (``--quantization gguf``, the default).
- ``deq-bf16``: the block weight dequantized to bf16 inside the call, then ``F.linear`` (the
  large-M path: the dequantization is paid once per call, amortised over M rows).
- ``i4pack``: ``torch._weight_int4pack_mm_for_cpu``, group 32, bf16 activations: a lossless home
  for Q4_0/Q4_1 only (Q5_0 and Q8_0 codes do not fit 4 bits).
- ``i8pack``: ``torch._weight_int8pack_mm`` (one scale per row): Q8_0's per-32 scales do not fit
  it without error, so it is a speed reference, not a lossless candidate.

Each cell is the median of repeated calls (``--repeats`` rounds of up to 30 calls; the median of
the round medians); the machine is shared and noisy, compare ratios within one run.

    .venv/bin/python benchmarks/gguf_kernels.py [--threads 2] [--models gemma,qwen] [--rows 1,8,32,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linear_kernels import SHAPES, time_ms  # noqa: E402  (the same shapes and timing loop)

from servelm.model.layers import weight_only as wo  # noqa: E402
from servelm.model.gguf.gguf_blocks import BlockWeight  # noqa: E402
from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel  # noqa: E402


def median_ms(fn: Callable[[], object], budget_s: float, repeats: int) -> tuple[float, float]:
    """(median of the round medians, minimum) milliseconds: ``repeats`` rounds of ``time_ms``."""
    rounds = [time_ms(fn, budget_s / repeats) for _ in range(repeats)]
    return statistics.median(median for median, _ in rounds), min(best for _, best in rounds)


def random_block_weight(n: int, k: int, offsets: bool) -> BlockWeight:
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n, k // 32) * 2e-4
    return BlockWeight(codes, scales, torch.randn(n, k // 32) * 1e-3 if offsets else None, 32, "Q8_0")


def kernels(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    kernel = load_kernel()
    weight = random_block_weight(n, k, offsets=False)
    dense = weight.dequantize()
    dense_bf16 = dense.bfloat16()
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "fp32": lambda x: F.linear(x, dense),
        "bf16": lambda x: F.linear(x.bfloat16(), dense_bf16).float(),
    }
    if kernel is not None:
        with_offsets = random_block_weight(n, k, offsets=True)
        out["blk"] = lambda x: kernel.block_linear(x, weight.codes, weight.scales, None, 32)
        out["blk-off"] = lambda x: kernel.block_linear(x, with_offsets.codes, with_offsets.scales,
                                                       with_offsets.offsets, 32)
        out["blkf"] = lambda x: kernel.block_linear_float(x, weight.codes, weight.scales, None, 32)
        out["blk16"] = lambda x: kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)
    out["deq-bf16"] = lambda x: F.linear(x.bfloat16(), weight.dequantize(dtype=torch.bfloat16)).float()
    packed, scale_zeros = wo.pack_int4(dense, 32)
    scale_zeros = scale_zeros.bfloat16()
    out["i4pack"] = lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, scale_zeros).float()
    q8, s8 = wo.quantize_int8_per_channel(dense)
    s8 = s8.bfloat16()
    out["i8pack"] = lambda x: torch._weight_int8pack_mm(x.bfloat16(), q8, s8).float()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="gemma,qwen")
    parser.add_argument("--rows", default="1,8,32,1024")
    parser.add_argument("--budget-s", type=float, default=0.6, help="time per (shape, M, kernel) cell")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write every cell here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    load_kernel()
    print(f"torch {torch.__version__}, {args.threads} threads, kernel: {kernel_status()}, "
          f"load average {os.getloadavg()}", flush=True)
    cells = []
    header_done = False
    for model in args.models.split(","):
        for name, k, n in SHAPES[model]:
            candidates = kernels(n, k)
            if not header_done:
                names = list(candidates)
                print("| shape (K x N) | M | fp32 ms | bf16 ms | "
                      + " | ".join(f"{c} /fp32 | /bf16" for c in names[2:]) + " |")
                print("|---" * (4 + 2 * (len(names) - 2)) + "|", flush=True)
                header_done = True
            for rows in rows_list:
                if name == "head" and rows > 32:
                    continue    # prefill computes the head for the last position of each prompt only
                x = torch.randn(rows, k)
                timed = {kernel: median_ms(lambda: fn(x), args.budget_s, args.repeats)
                         for kernel, fn in candidates.items()}
                for kernel, (median, best) in timed.items():
                    cells.append({"model": model, "layer": name, "K": k, "N": n, "M": rows,
                                  "kernel": kernel, "median_ms": median, "min_ms": best})
                for statistic, index in (("median", 0), ("min", 1)):
                    line = {kernel: values[index] for kernel, values in timed.items()}
                    ratios = " | ".join(f"{line[c] / line['fp32']:.2f} | {line[c] / line['bf16']:.2f}"
                                        for c in list(line)[2:])
                    print(f"| {model} {name} {k}x{n} | {rows} {statistic} | {line['fp32']:.3g} | "
                          f"{line['bf16']:.3g} | {ratios} |", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
