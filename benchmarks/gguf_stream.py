"""The GGUF block kernel at M=1 as a decode step meets it: every layer's weights once, from DRAM.

A microbenchmark that repeats one weight reads it from the L3 cache (32 MiB here; Gemma 3 270M's
largest decoder weight is 2.9 MB), and so overstates what a step gets: a step streams ~106 MB of
decoder weights and then the 100 MB LM head. This one builds ``--layers`` distinct copies of the
model's four decoder shapes (random Q8_0-like codes, one scale per 32 inputs), calls the int16
kernel on one bf16 row per weight in model order with bf16 output (as the served bf16 model does),
and reports GB/s per shape and for the whole pass, next to ``torch.sum`` of a 1 GiB float tensor
(the machine's streaming rate). ``--base SOURCE`` also builds another kernel source (e.g. the one on
main, saved to a file; the AVX2 source where this CPU takes the AVX2 build) and alternates the two
passes in one run (a noisy, shared machine moves both alike).

``--weights-of MODEL`` takes the packaged model's own block weights instead (its decoder layers'
projections in model order, loaded as ``servelm serve MODEL`` loads them: each GGUF type's repack,
offsets and 16-input blocks included) and reports GB/s per projection and type.

    .venv/bin/python benchmarks/gguf_stream.py --threads 1 [--base /tmp/gguf_kernel_main.cpp]
    .venv/bin/python benchmarks/gguf_stream.py --threads 1 --clock thread --weights-of qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_kernels import random_block_weight  # noqa: E402
from linear_kernels import SHAPES  # noqa: E402

from servelm.model.cpp_kernel import CppKernel, isa_flags  # noqa: E402
from servelm.model.gguf.gguf_kernel import AVX2_FLAGS, COMPILE_FLAGS, REQUIRED_FLAGS, load_kernel  # noqa: E402


def one_pass(kernel: object, weights: list[tuple[str, object]], xs: dict[int, torch.Tensor],
             clock: object, per_shape: dict[str, float]) -> float:
    total = 0.0
    for name, w, call in weights:
        # a model's weight: the function serving calls, of this kernel (``--base``: the other build's own)
        fn, codes, scales, offsets = call or (kernel.block_linear_a16, w.codes, w.scales, w.offsets)  # type: ignore[attr-defined]
        fn = getattr(kernel, fn.__name__)
        x = xs[w.codes.shape[1]]
        start = clock()  # type: ignore[operator]
        fn(x, codes, scales, offsets, w.block, True)
        elapsed = clock() - start  # type: ignore[operator]
        per_shape[name] = per_shape.get(name, 0.0) + elapsed
        total += elapsed
    return total


def model_weights(model: str) -> tuple[list[tuple[str, object]], torch.dtype]:
    """The packaged ``model``'s decoder projections as ``servelm serve`` loads them (GGUF blocks), in
    model order, each named by projection and GGUF type (e.g. ``down Q6_K``), and the dtype it serves in
    (the rows the kernel is called with: float32 where the CPU has no native bf16)."""
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_flat({"model": model, "num_threads": 1, "max_total_tokens": 1024}))
    weights = []
    for name, module in engine.runner.model.named_modules():
        weight = module.__dict__.get("gguf_weight")
        if weight is not None and ".layers." in name:   # the kernel call serving makes (packed, compact scales)
            call = module.__dict__["linear_method"].block_call(weight)
            weights.append((f"{name.rsplit('.', 1)[-1].removesuffix('_proj')} {weight.kind}", weight, call))
    assert weights, f"{model} has no GGUF block weights here"
    return weights, engine.runner.dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--model", default="gemma")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--base", default=None, help="another gguf_kernel.cpp to alternate with")
    parser.add_argument("--weights-of", default=None, help="a packaged model: its own decoder block weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernels = {"this": load_kernel()}
    if args.base:   # built as this CPU's build is (the AVX2 source with AVX2's flags)
        avx2 = getattr(kernels["this"], "ISA", "") == "avx2"
        flags = AVX2_FLAGS if avx2 else REQUIRED_FLAGS
        base = CppKernel(Path(args.base), "gguf_block_base_avx2" if avx2 else "gguf_block_base", "base GGUF kernel",
                         flags, ["-O3", *isa_flags(flags)] if avx2 else COMPILE_FLAGS, link_flags=["-fopenmp"])
        kernels["base"] = base.load()
    assert all(k is not None for k in kernels.values()), "no GGUF block kernel on this CPU"
    torch.manual_seed(0)
    dtype = torch.bfloat16
    if args.weights_of:
        weights, dtype = model_weights(args.weights_of)
        args.model = args.weights_of
        torch.set_num_threads(args.threads)   # the engine it loaded set its own
    else:
        shapes = [(name, k, n) for name, k, n in SHAPES[args.model] if name != "head"]
        weights = [(name, random_block_weight(n, k, offsets=False), None)
                   for _ in range(args.layers) for name, k, n in shapes]
    shape_bytes: dict[str, int] = {}
    for name, w, call in weights:   # what the call reads (a model's: packed codes, compact scales)
        read = w.nbytes if call is None else sum(t.nbytes for t in call[1:] if t is not None)
        shape_bytes[name] = shape_bytes.get(name, 0) + read
    total_bytes = sum(shape_bytes.values())
    xs = {w.codes.shape[1]: torch.randn(args.rows, w.codes.shape[1]).to(dtype) for _, w, _ in weights}
    big = torch.ones(1 << 28)
    sums = []
    results: dict[str, list[float]] = {name: [] for name in kernels}
    shapes_ms: dict[str, dict[str, float]] = {name: {} for name in kernels}
    for name, kernel in kernels.items():
        one_pass(kernel, weights, xs, clock, {})
    for _ in range(args.passes):
        start = time.perf_counter()
        big.sum()
        sums.append(time.perf_counter() - start)
        for name, kernel in kernels.items():
            results[name].append(one_pass(kernel, weights, xs, clock, shapes_ms[name]))
    sum_gbs = big.nbytes / statistics.median(sums) / 1e9
    print(f"# {args.model}: {len(weights)} weights, M={args.rows}, {args.threads} threads, {args.clock} clock, "
          f"load {os.getloadavg()[0]:.1f}; torch.sum of 1 GiB: {sum_gbs:.1f} GB/s (noisy, shared machine)")
    print("| kernel | pass ms | GB/s | " + " | ".join(f"{s} ms (GB/s)" for s in shape_bytes) + " |")
    print("|---|---|---|" + "---|" * len(shape_bytes))
    for name, times in results.items():
        ms = 1e3 * statistics.median(times)
        cells = []
        for shape, nbytes in shape_bytes.items():
            shape_ms = 1e3 * shapes_ms[name][shape] / args.passes
            cells.append(f"{shape_ms:.2f} ({nbytes / shape_ms / 1e6:.1f})")
        print(f"| {name} | {ms:.2f} | {total_bytes / ms / 1e6:.1f} | " + " | ".join(cells) + " |")
    if "base" in results:
        ratio = statistics.median(results["this"]) / statistics.median(results["base"])
        print(f"# this / base: {ratio:.3f}")


if __name__ == "__main__":
    main()
