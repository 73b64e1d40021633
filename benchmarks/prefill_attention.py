"""A prefill attention kernel alone (prefill_attention.py: the bf16 one, or with ``--dtype float32`` the
float32 one), by default on Gemma 3 270M's shapes as the server runs a prompt: chunks of ``--chunk``
tokens (the server's ``chunked_prefill_size``), each attending over the chunk and the earlier chunks'
K/V in a paged pool (16-token blocks, scattered), 15 sliding (window 512) and 3 global layers per chunk.
Prints ms per prompt of attention (per chunk and layer kind) and the GFLOPS of the useful work (QK^T and
PV over the visible pairs only: the masked part of edge tiles is not counted).

    .venv/bin/python benchmarks/prefill_attention.py [--input-len 1019] [--threads 1] [--clock thread]
    # Qwen2.5-Coder 0.5B's float32 layers (24 global, 14/2 heads x 64):
    .venv/bin/python benchmarks/prefill_attention.py --dtype float32 --heads 14 2 64 --sliding-layers 0 \
        --global-layers 24 --threads 2 --clock wall

``--clock thread`` (with ``--threads 1``) reads the thread's CPU time: the work itself on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.model.attention import prefill_attention  # noqa: E402

BLOCK = 16


def visible_pairs(start: int, n: int, window: int | None) -> int:
    """(query, key) pairs a causal (windowed) chunk of n queries at positions start.. sees."""
    return sum(min(p + 1, window or p + 1) for p in range(start, start + n))


def chunk_inputs(start: int, n: int, window: int | None, num_heads: int, head_dim: int,
                 k_cache: torch.Tensor, slot_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    first = 0 if window is None else max(0, start - window + 1)
    slots = slot_of[first:start + n][None, :].contiguous()
    plan = prefill_attention.plan([0], [n], [start], [first])
    return slots, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=1019)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sliding-layers", type=int, default=15)
    parser.add_argument("--global-layers", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="queries and pool (the kernel of that dtype)")
    parser.add_argument("--heads", type=int, nargs=3, default=[4, 1, 256], metavar=("H", "HKV", "D"),
                        help="query heads, KV heads, head_dim (default Gemma 3 270M's)")
    parser.add_argument("--best", action="store_true", help="the fastest call instead of the median (2 threads "
                        "on a shared machine: a call where no other process took a core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    num_heads, num_kv_heads, head_dim = args.heads
    dtype = getattr(torch, args.dtype)
    if prefill_attention.load_kernel(dtype) is None:
        raise SystemExit(f"no {args.dtype} prefill attention kernel here: {prefill_attention.kernel_status(dtype)}")
    generator = torch.Generator().manual_seed(0)
    num_blocks = (args.input_len + BLOCK - 1) // BLOCK + 8
    k_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=generator).to(dtype)
    blocks = torch.randperm(num_blocks, generator=generator)
    positions = torch.arange(args.input_len)
    slot_of = blocks[positions // BLOCK] * BLOCK + positions % BLOCK
    # q as the layer's split of a fused QKV row: [T, H + 2 Hkv, D] viewed to its first H heads
    qkv = torch.randn(args.input_len, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    rows = []
    total_ms, total_flop = 0.0, 0.0
    for start in range(0, args.input_len, args.chunk):
        n = min(args.chunk, args.input_len - start)
        q = qkv[start:start + n, :num_heads]
        out = torch.empty(n, num_heads, head_dim, dtype=dtype)
        for window, layers in ((args.window, args.sliding_layers), (None, args.global_layers)):
            if layers == 0:
                continue
            slots, plan = chunk_inputs(start, n, window, num_heads, head_dim, k_cache, slot_of)
            call = lambda: prefill_attention.attend(q, k_cache, v_cache, slots, plan, window, scale, out)  # noqa: E731
            call()
            samples = []
            for _ in range(args.repeats):
                begin = clock()
                call()
                samples.append(clock() - begin)
            ms = 1000 * (min(samples) if args.best else statistics.median(samples))
            flop = 4.0 * num_heads * head_dim * visible_pairs(start, n, window)
            rows.append((start, n, window, layers, ms, flop / ms / 1e6))
            total_ms += layers * ms
            total_flop += layers * flop
    print(f"# {args.dtype} prefill attention kernel, {num_heads}/{num_kv_heads} heads x {head_dim}, {args.input_len} tokens in chunks of {args.chunk}, {args.threads} threads, "
          f"{args.clock} clock, {'fastest' if args.best else 'median'} of {args.repeats} calls (noisy, shared machine)")
    print("| chunk | window | layers | ms per layer | GFLOPS |")
    print("|---|---|---|---|---|")
    for start, n, window, layers, ms, gflops in rows:
        print(f"| {start}..{start + n - 1} | {window or 'global'} | {layers} | {ms:.2f} | {gflops:.0f} |")
    print(f"| all | | {args.sliding_layers + args.global_layers} per chunk | {total_ms:.1f} ms per prompt | "
          f"{total_flop / total_ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
