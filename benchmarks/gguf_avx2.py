"""One decode row (and a few) through the GGUF block kernel this CPU builds, against the dense float32
F.linear a CPU without a native bf16 GEMM would run on the dequantized weight (issue 30 section 4).

Qwen2.5-Coder-0.5B's shapes with random codes of its GGUF types (``SHAPES``, ``CODE_RANGES``); each case is timed in interleaved rounds (every route once per
round) and the median per call is printed, in ms, for each thread count. Routes: ``dense f32``, the
kernel's functions on the int8 codes (``block_linear_a16``, ``block_linear``, ``block_linear_float``)
and, where the build has them (AVX2), on the codes packed at their bit width (``packed_a16``,
``packed_a8``: gguf_blocks.PackedCodes), with float32 scales or (``packed_a16 compact``) with the
compact ones (fp16, or int8 sub-scales x a float32 per 256 inputs: ``BlockWeight.with_compact``; the
random scales are drawn so that both layouts hold them exactly, as the file's are); ``int8 gemm``: the int8
GEMM for prompt rows (gguf_i8gemm's build for this CPU: AVX2, or VNNI) on its own copy, activations
rounded to int8 per block (prompt rows only in the engine; a Q8_0 weight's codes are too wide for the AVX2
build: no call).

``--cold`` runs each call on the next of enough copies of the weight to exceed the L3 cache (as
serving does: every layer's weight is read once per step, so none is in cache when its turn comes);
without it one weight is rerun and, where it fits the L3, read from cache. ``--clock thread`` reads
the calling thread's CPU time (1 thread only: the OpenMP workers' time is not counted) on a loaded
machine. ``--base`` builds another gguf_kernel_avx2.cpp (an older revision's, e.g. from ``git show``)
beside this one and times its routes too ("base packed_a16", ...) in the same interleaved rounds, after
checking that both give the same outputs bit for bit. The machine may be shared: read the ratios, not
the absolute times.

    python benchmarks/gguf_avx2.py --threads 1 2 --rows 1 4 16 --cold
    git show HEAD~1:servelm/model/gguf/gguf_kernel_avx2.cpp > /tmp/base/gguf_kernel_avx2.cpp
    python benchmarks/gguf_avx2.py --rows 1 --base /tmp/base/gguf_kernel_avx2.cpp --routes "packed_a16 compact"
    python benchmarks/gguf_avx2.py --threads 2 --rows 64 512 --routes "dense f32" "int8 gemm" --cold
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from servelm.model.cpp_kernel import CppKernel  # noqa: E402
from servelm.model.gguf import gguf_i8gemm, gguf_kernel  # noqa: E402
from servelm.model.gguf.gguf_blocks import SUPER_INPUTS, BlockWeight, PackedCodes, SubScaled  # noqa: E402

SHAPES = {"qkv 1152x896": (1152, 896, "Q5_0"), "o 896x896": (896, 896, "Q5_0"),
          "gate_up 9728x896": (9728, 896, "Q5_0"), "down 896x4864": (896, 4864, "Q6_K"),
          "down 896x4864 Q4_K": (896, 4864, "Q4_K"), "head 151936x896": (151936, 896, "Q8_0"),
          "gemma head 262144x640": (262144, 640, "Q8_0")}
"""Qwen2.5-Coder-0.5B's GGUF (Q4_K_M file): Q5_0 attention and gate/up (half the QKVs fuse a Q8_0
V), Q6_K or Q4_K down, a Q8_0 head; and Gemma 3 270M's Q8_0 head."""
ROUTES = ("dense f32", "block_linear_a16", "block_linear", "block_linear_float", "packed_a16", "packed_a8",
          "packed_float", "packed_a16 compact", "packed_a8 compact", "packed_float compact", "int8 gemm")
L3_BYTES = 32 << 20
"""This machine's L3 (lscpu: 32 MiB); --cold cycles through copies of at least twice that."""


CODE_RANGES = {"Q5_0": (-16, 16, 32, False), "Q6_K": (-32, 32, 16, False), "Q4_K": (0, 16, 32, True),
               "Q8_0": (-128, 128, 32, False)}
"""kind -> (lowest code, highest + 1, block, has offsets)."""


def weight(n: int, k: int, kind: str, seed: int) -> BlockWeight:
    low, high, block, has_offsets = CODE_RANGES[kind]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high, (n, k), dtype=torch.int8, generator=g)
    if not kind.endswith("_K"):   # an fp16 d per block
        return BlockWeight(codes, (torch.rand(n, k // block, generator=g) * 1e-2).half().float(), None, block, kind)

    def factors(sign: float) -> SubScaled:   # 6-bit sub-scales x an fp16 d (or -dmin) per 256 inputs
        return SubScaled(torch.randint(0, 64, (n, k // block), dtype=torch.int8, generator=g),
                         (sign * torch.rand(n, k // SUPER_INPUTS, generator=g) * 1e-3).half().float())

    scales, offsets = factors(1.0), factors(-1.0) if has_offsets else None
    return BlockWeight(codes, scales.values(), None if offsets is None else offsets.values(), block, kind,
                       scale_factors=scales, offset_factors=offsets)


def route_call(kernel: object, route: str, w: BlockWeight, packed: PackedCodes | None,
               dense: torch.Tensor | None, i8: object = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One call of ``route`` on this copy of the weight, or None where it does not run here (``i8``: the
    int8 GEMM's module)."""
    if route == "dense f32":
        return None if dense is None else (lambda x: F.linear(x, dense))
    if route == "int8 gemm":
        i8_copy = gguf_i8gemm.pack_for(i8, w) if i8 is not None else None
        return None if i8_copy is None else (lambda x: gguf_i8gemm.gemm(i8, x, i8_copy, w.block))
    if route.startswith("packed"):
        function, _, compact = route.partition(" ")
        if packed is None or not hasattr(kernel, function) or (compact and not getattr(kernel, "COMPACT_SCALES", False)):
            return None
        f = getattr(kernel, function + ("_centered" if packed.centered else ""))
        scales, offsets = w.with_compact() if compact else (w.scales, w.offsets)
        return lambda x: f(x, packed.data, scales, offsets, w.block)
    f = getattr(kernel, route)
    return lambda x: f(x, w.codes, w.scales, w.offsets, w.block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--cold", action="store_true", help="cycle through copies exceeding the L3")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--base", default=None, help="another gguf_kernel_avx2.cpp whose routes run too")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernel = gguf_kernel.load_kernel()
    i8 = gguf_i8gemm.load_gemm() if "int8 gemm" in args.routes else None
    kernels = {"": kernel}
    if args.base:
        base = Path(args.base).resolve()
        kernels["base "] = CppKernel.beside(str(base), base.name, "gguf_block_avx2_base", "base GGUF kernel",
                                            gguf_kernel.AVX2_FLAGS).load()
        assert kernels["base "] is not None, f"{base} does not build here"
    print(f"kernel: {gguf_kernel.kernel_status()}; "
          + (f"int8 GEMM: {gguf_i8gemm.gemm_status()}; " if "int8 gemm" in args.routes else "")
          + f"{'cold (copies > L3)' if args.cold else 'one weight'}, {args.clock} clock")
    assert kernel is not None or args.routes == ["dense f32"], "no kernel builds here"
    for name in args.shapes:
        n, k, kind = SHAPES[name]
        w = weight(n, k, kind, n + k)
        # --cold: copies of the int8 form exceeding twice the L3 (more than the packed form needs)
        copies_needed = (1 + (2 * L3_BYTES) // max(1, w.nbytes)) if args.cold else 1
        weights = [w] + [weight(n, k, kind, n + k + i) for i in range(1, copies_needed)]
        packed = [PackedCodes.of(copy.codes) for copy in weights]
        dense_copies = (1 + (2 * L3_BYTES) // (n * k * 4)) if args.cold else 1
        dense = ([copy.dequantize() for copy in weights[:dense_copies]] if "dense f32" in args.routes else [])
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, k)
                calls: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
                for route in args.routes:
                    for prefix, build in kernels.items():
                        if prefix and route in ("dense f32", "int8 gemm"):
                            continue
                        runs = [route_call(build, route, copy, pack, dense[i] if i < len(dense) else None, i8)
                                for i, (copy, pack) in enumerate(zip(weights, packed))]
                        present = [run for run in runs if run is not None]
                        if present:
                            calls[prefix + route] = present
                for route in calls:
                    if route.startswith("base "):
                        assert torch.equal(calls[route][0](x), calls[route.removeprefix("base ")][0](x)), route
                if not calls:
                    print(f"{name:18s} M={rows:2d} t={threads}: none of the routes runs this weight here", flush=True)
                    continue
                times: dict[str, list[float]] = {route: [] for route in calls}
                reps = max(2 * max(len(runs) for runs in calls.values()), int(2e8 // (n * k)))
                for _ in range(args.rounds):
                    for route, runs in calls.items():
                        start = clock()
                        for i in range(reps):
                            runs[i % len(runs)](x)
                        times[route].append((clock() - start) / reps * 1e3)
                medians = {route: statistics.median(t) for route, t in times.items()}
                base = medians.get("dense f32") or next(iter(medians.values()))
                cells = "  ".join(f"{route} {ms:.3f} ({ms / base:.2f}x)" for route, ms in medians.items())
                print(f"{name:18s} M={rows:2d} t={threads}: {cells}", flush=True)


if __name__ == "__main__":
    main()
