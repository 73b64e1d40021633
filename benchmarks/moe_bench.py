"""The fused MoE layer (servelm.model.layers.moe.FusedMoE: rows sorted by expert, a GEMM pair per
expert with rows) against transformers' per-expert loop (one-hot mask, a torch.where per expert)
on one realistic layer shape: 16 experts, top-2, hidden 1024, intermediate 512, float32; and the
same layer with ``--quantization experts_int8``'s experts (int8 per output channel, bf16 activations
into torch's int8 kernel).

    python benchmarks/moe_bench.py [--threads N] [--repeats R]

Prints the median ms per layer call at 1, 8, 32 and 512 tokens, the loop's ratio to the fused float32
layer, the experts_int8 layer's speed-up over it and its output's error relative to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from servelm.model.layers.moe import FusedMoE, route
from servelm.model.layers.quantization import quantize_experts

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 16, 2, 1024, 512


def loop_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (Qwen3MoeExperts.forward's shape of computation)."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=EXPERTS).permute(2, 1, 0)  # [E, k, T]
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(expert[0])
        position, token = torch.where(mask[e])
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, down[e]) * weights[token, position, None]
        out.index_add_(0, token, rows)
    return out


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, "silu")
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.02
    int8_layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, "silu")
    for target in (layer, int8_layer):
        target.weight_loader(target.gate_up_proj, gate_up)
        target.weight_loader(target.down_proj, down)
    quantize_experts(int8_layer)
    router = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.02
    print(f"threads {args.threads}; {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, intermediate {INTERMEDIATE}")
    print("tokens  fused_ms  loop_ms  loop/fused  int8_ms  fused/int8  int8_rel_err")
    with torch.inference_mode():
        for tokens in (1, 8, 32, 512):
            x = torch.randn(tokens, HIDDEN, generator=generator)
            routing = route(x @ router.T, TOP_K, True)
            weights = routing.weights.to(x.dtype)
            torch.testing.assert_close(layer(x, routing), loop_reference(x, gate_up, down, weights, routing.expert_ids),
                                       atol=1e-4, rtol=1e-4)
            fused = median_ms(lambda: layer(x, routing), args.repeats)
            loop = median_ms(lambda: loop_reference(x, gate_up, down, weights, routing.expert_ids), args.repeats)
            int8 = median_ms(lambda: int8_layer(x, routing), args.repeats)
            exact = layer(x, routing)
            error = ((int8_layer(x, routing) - exact).norm() / exact.norm()).item()
            print(f"{tokens:6d}  {fused:8.3f}  {loop:7.3f}  {loop / fused:9.2f}  {int8:7.3f}  {fused / int8:10.2f}"
                  f"  {error:12.2e}")


if __name__ == "__main__":
    main()
