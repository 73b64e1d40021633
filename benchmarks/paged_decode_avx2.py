"""Decode attention per layer: the paged decode kernel this CPU builds against the torch path (issue 30 §4).

The torch path is torch_native.py's for a decode group: every context row gathered into a padded
copy (``index_select`` on the view's flat slots), widened to q's dtype, then SDPA with GQA folded into
the query dimension and the view's mask. The kernel reads each row once from the pool. Both run on
the same scattered slots (blocks of 16 in a random order) of a pool per layer; the layers are
visited in turn so that, as in a step, a layer's K/V is not in cache from its previous call.
Qwen2.5-Coder-0.5B's attention by default (14 query heads, 2 KV heads, head_dim 64).

Each case is timed in interleaved rounds (model/timing.py) and the median per layer printed, in ms.
The machine may be shared: read the ratios, not the absolute times.

    python benchmarks/paged_decode_avx2.py --threads 1 2 --streams 1 8 32 --contexts 64 512 2048

``--base FILE`` builds another paged_decode.cpp (e.g. ``git show REV:servelm/model/attention/paged_decode.cpp``)
the same way, checks its output against this build's (the last column: ``equal`` bit for bit, else the
largest difference, which must be float32 rounding) and times it in the same rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from servelm.model.attention import paged_decode  # noqa: E402
from servelm.model.cpp_kernel import CppKernel  # noqa: E402
from servelm.model.huge_pages import advise_huge_pages  # noqa: E402
from servelm.model.timing import time_candidates  # noqa: E402

BLOCK = 16
COLD_BYTES = 256 << 20
"""Pools visited in turn until this many bytes (several times the last-level cache)."""


def engine_pool(slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A random pool on transparent huge pages where the OS gives them, as the engine allocates its pools
    (kv_cache.py): on 4-KiB pages a cold layer's scattered blocks cost a TLB miss each."""
    pool = torch.empty(slots, kv_heads, head_dim, dtype=dtype)
    advise_huge_pages(pool)
    return pool.copy_(torch.randn(slots, kv_heads, head_dim, generator=g))


class Case:
    """``streams`` decodes of ``context`` columns each, over ``layers`` pools."""

    def __init__(self, streams: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 kv_dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(streams * 7919 + context)
        blocks_per_seq = -(-context // BLOCK)
        num_blocks = streams * blocks_per_seq
        pool_bytes = 2 * num_blocks * BLOCK * kv_heads * head_dim * kv_dtype.itemsize
        self.layers = max(2, min(24, COLD_BYTES // pool_bytes))
        self.pools = [(engine_pool(num_blocks * BLOCK, kv_heads, head_dim, kv_dtype, g),
                       engine_pool(num_blocks * BLOCK, kv_heads, head_dim, kv_dtype, g))
                      for _ in range(self.layers)]
        order = torch.randperm(num_blocks, generator=g).view(streams, blocks_per_seq)
        slots = (order[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(streams, -1)[:, :context]
        self.slots = slots.contiguous()
        self.flat = self.slots.reshape(-1)
        self.spans = torch.full((streams,), context, dtype=torch.int64)
        self.mask = torch.ones(streams, 1, 1, context, dtype=torch.bool)
        self.q = torch.randn(streams, heads, head_dim, generator=g)
        self.shape = (streams, context, heads, kv_heads, head_dim)
        self.scale = head_dim ** -0.5
        self.turn = 0

    def _pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.turn = (self.turn + 1) % self.layers
        return self.pools[self.turn]

    def kernel(self, pool: tuple[torch.Tensor, torch.Tensor] | None = None, build: object = None) -> torch.Tensor:
        k_cache, v_cache = pool or self._pool()
        return paged_decode.attend(self.q, k_cache, v_cache, self.slots, self.spans, self.scale, kernel=build)

    def torch_path(self, pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        k_cache, v_cache = pool or self._pool()
        b, columns, heads, kv_heads, head_dim = self.shape
        k = k_cache.index_select(0, self.flat).view(b, columns, kv_heads, -1).to(self.q.dtype).transpose(1, 2)
        v = v_cache.index_select(0, self.flat).view(b, columns, kv_heads, -1).to(self.q.dtype).transpose(1, 2)
        q = self.q.view(b, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=self.scale)
        return out.reshape(b, heads, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("H", "HKV", "D"))
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of rounds per case")
    parser.add_argument("--base", default=None, help="another paged_decode.cpp, timed beside this build")
    args = parser.parse_args()
    kv_dtype = getattr(torch, args.kv_dtype)
    kernel = paged_decode.load_kernel()
    base = None
    if args.base:
        source = Path(args.base).resolve()
        built = paged_decode.BUILDS.first()
        base = CppKernel.beside(str(source), source.name, built.name + "_base", "base paged decode kernel",
                                built.required_flags).load()
        assert base is not None, f"{source} does not build here"
    print(f"kernel: {paged_decode.kernel_status()} (ISA {getattr(kernel, 'ISA', None)})")
    print(f"attention {args.heads[0]}/{args.heads[1]}x{args.heads[2]}, {args.kv_dtype} pool, ms per layer")
    print("| threads | streams | context | torch path | kernel | speed-up |" + (" base kernel | kernel vs base | outputs |" if base else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|" if base else ""))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for streams in args.streams:
            for context in args.contexts:
                case = Case(streams, context, *args.heads, kv_dtype)
                torch.testing.assert_close(case.kernel(case.pools[0]), case.torch_path(case.pools[0]),
                                           atol=1e-4, rtol=1e-4)
                candidates = {"torch": case.torch_path, "kernel": case.kernel}
                agreement = ""
                if base is not None:
                    ours, theirs = case.kernel(case.pools[0]), case.kernel(case.pools[0], base)
                    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
                    agreement = "equal" if torch.equal(ours, theirs) else f"{(ours - theirs).abs().max().item():.1e}"
                    candidates["base"] = lambda: case.kernel(None, base)
                times = time_candidates(candidates, min_rounds=10, max_rounds=400, budget_s=args.budget)
                extra = (f" {times['base'] / 1e3:.3f} | {times['base'] / times['kernel']:.2f}x | {agreement} |"
                         if base else "")
                print(f"| {threads} | {streams} | {context} | {times['torch'] / 1e3:.3f} | "
                      f"{times['kernel'] / 1e3:.3f} | {times['torch'] / times['kernel']:.2f}x |" + extra, flush=True)


if __name__ == "__main__":
    main()
