"""The fused elementwise ops at a prefill chunk's shapes (Gemma 3 270M by default: 1,019 rows, hidden 640,
intermediate 2048, 4 q heads + 1 KV head of 256), each timed alone: median and min over ``--repeats``.

``--threads 1`` reads the thread CPU clock (the work itself on a shared machine); more threads read the
wall clock (on a loaded machine the min is the figure where both threads ran: say "noisy, shared machine").

    .venv/bin/python benchmarks/fused_prefill_ops.py [--threads 2] [--rows 1019]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.model.layers import fused  # noqa: E402
from servelm.model.layers.activation import ActAndMul  # noqa: E402
from servelm.model.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from servelm.model.layers.rotary import RotaryEmbedding  # noqa: E402


def timed(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> tuple[float, float]:
    """(median, min) ms of ``fn`` over ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    times.sort()
    return 1000 * times[len(times) // 2], 1000 * times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1019)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    assert fused.load_kernel() is not None, fused.kernel_status()
    dtype, rows = torch.bfloat16, args.rows
    x = torch.randn(rows, args.hidden, dtype=dtype)
    residual = torch.randn(rows, args.hidden, dtype=dtype)
    gemma_norm, llama_norm = GemmaRMSNorm(args.hidden).to(dtype), RMSNorm(args.hidden).to(dtype)
    gate_up = torch.randn(rows, 2 * args.intermediate, dtype=dtype)
    rotary = RotaryEmbedding(args.head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(rows)
    q_columns, k_columns = args.heads * args.head_dim, args.kv_heads * args.head_dim
    qkv = torch.randn(rows, q_columns + 2 * k_columns, dtype=dtype)
    q = qkv[:, :q_columns].view(rows, args.heads, args.head_dim)   # [T, H, D] views of the QKV output
    k = qkv[:, q_columns:q_columns + k_columns].view(rows, args.kv_heads, args.head_dim)
    q_norm, k_norm = GemmaRMSNorm(args.head_dim).to(dtype), GemmaRMSNorm(args.head_dim).to(dtype)
    cache: dict[object, object] = {}
    rotary(positions, q, k, cache, q_norm, k_norm)
    cases: dict[str, Callable[[], object]] = {
        "Gemma norm(x)": lambda: gemma_norm(x),
        "Gemma norm(x) + residual (post-norm)": lambda: gemma_norm(x, residual),
        "Llama add_norm(x, residual) (pre-norm)": lambda: llama_norm.add_norm(x, residual),
        "GELU-tanh(gate) * up": lambda: ActAndMul("gelu_pytorch_tanh")(gate_up),
        "SiLU(gate) * up": lambda: ActAndMul("silu")(gate_up),
        "RoPE cos/sin of the positions": lambda: rotary.cos_sin(positions, dtype),
        "q/k norm + RoPE in place": lambda: rotary(positions, q, k, cache, q_norm, k_norm),
        "reference: copy of x": lambda: x.clone(),
    }
    print(f"# {rows} rows, bf16, {args.threads} thread(s), {'thread CPU' if args.threads == 1 else 'wall'} clock")
    print("| op | median ms | min ms |\n|---|---|---|")
    for name, fn in cases.items():
        median, best = timed(fn, args.repeats, clock)
        print(f"| {name} | {median:.3f} | {best:.3f} |")


if __name__ == "__main__":
    main()
