"""DeepSeek's latent KV pool against --disable-mla's expanded per-head K/V: bytes per token, and
decode and prefill step time at DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads,
kv_lora_rank 512, rope 64, no-rope 128, v 128) with few layers and small experts (random weights;
the attention and its pool are what differ between the two).

    python benchmarks/mla_bench.py [--layers 2] [--streams 8] [--context 1024] [--threads N]

Prints each form's pool bytes per token, the prefill of ``streams`` prompts of ``context`` tokens,
and the median decode step of ``streams`` sequences at that context; then the full models' pool
bytes per token (V2-Lite, V3) computed from their shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model.architectures.deepseek import DISABLE_MLA
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.kv_cache import KVCache, LatentKVCache
from servelm.model.runner import ModelRunner

BLOCK = 16


def v2_lite_shape(layers: int, disable_mla: bool) -> Any:
    config = transformers.DeepseekV2Config(
        vocab_size=4096, hidden_size=2048, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, n_shared_experts=2,
        moe_intermediate_size=352, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096})
    setattr(config, DISABLE_MLA, disable_mla)
    return config


def make_runner(hf_config: Any, pool_tokens: int) -> ModelRunner:
    source = SimpleNamespace(hf_config=hf_config, weights=None, tokenizer_path=None, eos_token_ids=[],
                             context_length=8192, description="V2-Lite-shaped, random weights")
    config = EngineConfig(model=ModelConfig(model="bench", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=BLOCK, max_total_tokens=pool_tokens))
    return ModelRunner(config, source)


def measure(disable_mla: bool, args: argparse.Namespace) -> dict[str, float]:
    tokens_per_seq = args.context + args.steps + 1
    blocks_per_seq = -(-tokens_per_seq // BLOCK)
    runner = make_runner(v2_lite_shape(args.layers, disable_mla), args.streams * blocks_per_seq * BLOCK)
    generator = torch.Generator().manual_seed(0)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(args.streams)]
    prompts = [torch.randint(0, 4096, (args.context,), generator=generator).tolist() for _ in tables]
    start = time.perf_counter()
    logits = runner.execute(BatchPlan([SequencePlan(p, 0, t, 1) for p, t in zip(prompts, tables)]))
    prefill_ms = (time.perf_counter() - start) * 1e3
    times = []
    for step in range(args.steps):
        tokens = logits.argmax(-1).tolist()
        plan = BatchPlan([SequencePlan([tok], args.context + step, t, 1) for tok, t in zip(tokens, tables)])
        start = time.perf_counter()
        logits = runner.execute(plan)
        times.append((time.perf_counter() - start) * 1e3)
    return {"bytes_per_token": runner.kv_bytes_per_token, "prefill_ms": prefill_ms,
            "decode_ms": statistics.median(times[1:])}


def full_model_bytes() -> list[tuple[str, int, int]]:
    """(model, latent bytes per token, expanded bytes per token) in bf16 for the released shapes."""
    shapes = [("DeepSeek-V2-Lite", 27, 16), ("DeepSeek-V3", 61, 128)]   # layers, heads; both 512 + 64, 192 / 128
    return [(name, LatentKVCache.bytes_per_token(layers, 1, 576, torch.bfloat16),
             KVCache.bytes_per_token(layers, heads, 192, torch.bfloat16, 128)) for name, layers, heads in shapes]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"V2-Lite attention shape, {args.layers} layers, float32, {args.threads} threads, "
          f"{args.streams} streams at {args.context} tokens")
    for name, disable in (("latent (MLA)", False), ("expanded (--disable-mla)", True)):
        result = measure(disable, args)
        print(f"{name:26s} {result['bytes_per_token']:7d} bytes/token  prefill {result['prefill_ms']:8.0f} ms  "
              f"decode step {result['decode_ms']:7.1f} ms")
    for name, latent, expanded in full_model_bytes():
        print(f"{name}: bf16 pool {latent} bytes/token latent, {expanded} expanded ({expanded / latent:.1f}x)")


if __name__ == "__main__":
    main()
