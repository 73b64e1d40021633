"""The GGUF block kernel of a git revision against the working tree's: same outputs, and time.

Builds ``servelm/model/gguf/gguf_kernel.cpp`` as it was at ``--ref`` next to the current one
(``load_kernel``), checks that all three activation formats (``block_linear`` int8,
``block_linear_a16`` 16-bit, ``block_linear_float``) give bit-identical results on random codes (block
32 without offsets, block 16 with), then times both, interleaved (7 rounds of 15 calls each, median
of the round medians, 1 thread), at the Gemma 3 / Qwen2.5 shapes and M = 1, 8, 16 (the kernel's rows).
Noisy on a shared machine: a single cell jumping 2x is an OpenMP/scheduler stall, not the code.

    .venv/bin/python benchmarks/gguf_kernel_ab.py [--ref HEAD~1] [block_linear block_linear_a16 ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servelm.model.gguf.gguf_kernel import COMPILE_FLAGS, load_kernel  # noqa: E402

FORMATS = ("block_linear_a16", "block_linear", "block_linear_float")
SHAPES = [(640, 1536), (1024, 640), (896, 9728), (4864, 896), (640, 32768)]
"""(K, N): Gemma qkv and o, Qwen gate_up and down, a 32k-row slice of an LM head."""


SOURCE_PATHS = ("servelm/model/gguf/gguf_kernel.cpp", "servelm/model/layers/gguf_kernel.cpp")
"""Where the kernel's source is in a revision: since the GGUF package, and before it."""


def build_ref(ref: str, build_dir: Path) -> object:
    from torch.utils import cpp_extension
    for source_path in SOURCE_PATHS:
        shown = subprocess.run(["git", "show", f"{ref}:{source_path}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            source = shown.stdout
            break
    else:
        raise SystemExit(f"{ref} has the kernel at none of {', '.join(SOURCE_PATHS)}")
    path = build_dir / "gguf_kernel_ref.cpp"
    path.write_text(source)
    return cpp_extension.load(name="servelm_gguf_kernel_ref", sources=[str(path)], extra_cflags=COMPILE_FLAGS,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD~1")
    parser.add_argument("formats", nargs="*", default=list(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = build_ref(args.ref, Path(tempfile.mkdtemp(prefix="gguf_kernel_ref_")))
    new = load_kernel()
    assert new is not None, "no kernel on this machine"
    g = torch.Generator().manual_seed(0)
    for name in FORMATS:
        for k, n in SHAPES:
            for block, has_offsets in ((32, False), (16, True)):
                codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
                scales = torch.rand(n, k // block, generator=g) * 0.01
                offsets = torch.randn(n, k // block, generator=g) * 0.01 if has_offsets else None
                for m in (1, 5, 16):
                    x = torch.randn(m, k, generator=g)
                    a = getattr(old, name)(x, codes, scales, offsets, block)
                    b = getattr(new, name)(x, codes, scales, offsets, block)
                    assert torch.equal(a, b), (name, k, n, block, m)
    print(f"bit-identical to {args.ref}: {len(FORMATS)} formats x {len(SHAPES)} shapes x 2 layouts x M 1,5,16")
    print(f"| kernel | shape K x N | M | {args.ref} ms | now ms | now / {args.ref} |")
    print("|---|---|---|---|---|---|")
    for name in args.formats:
        for k, n in SHAPES:
            codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
            scales = torch.rand(n, k // 32, generator=g) * 0.01
            for m in (1, 8, 16):
                x = torch.randn(m, k, generator=g)
                rounds: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(7):
                    for label, module in (("old", old), ("new", new)):
                        kernel = getattr(module, name)
                        kernel(x, codes, scales, None, 32)
                        calls = []
                        for _ in range(15):
                            start = time.perf_counter()
                            kernel(x, codes, scales, None, 32)
                            calls.append(time.perf_counter() - start)
                        rounds[label].append(statistics.median(calls))
                before, now = (statistics.median(rounds[label]) * 1e3 for label in ("old", "new"))
                print(f"| {name} | {k}x{n} | {m} | {before:.3f} | {now:.3f} | {now / before:.2f} |", flush=True)


if __name__ == "__main__":
    main()
