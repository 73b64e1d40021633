"""servelm against vLLM's CPU build on a random-weight MoE of realistic proportions (issue 33).

The model is a Qwen3-MoE written here as a Hugging Face directory (float32 safetensors, transformers'
own random init, seed 0) with Qwen2.5's real tokenizer copied beside it: 16 experts, top-4
(renormalised), hidden 1024, expert FFN 768, 4 layers, 16 query / 4 KV heads of 64, tied embeddings
(Qwen3-30B-A3B's proportions scaled down: 128 experts top-8, hidden 2048, expert FFN 768). Both
servers take the directory as shipped (their default flags) and are measured by compare_peers.py's
client and columns (prefill, 1, 8 and 32 streams), all started at once and measured in ``--rounds``
interleaved rounds (compare_peers.py ``measure_peers``: fresh prompts and a rotated order each round,
medians and ranges), so each ratio compares neighbouring measurements on this shared machine.
``--gguf`` adds servelm on the same weights written as a Q8_0 GGUF (llama.cpp's layout, tests/unit/model/test_gguf_moe.py's
writer), served at that precision by the GGUF block kernels.

    .venv/bin/python benchmarks/moe_peers.py [--rounds 2] [--output-len 64] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compare_peers import Peer, find_peers, measure_peers, print_rounds  # noqa: E402

TOKENIZER_DIR = Path("/work/peers/hf-qwen2.5-coder-0.5b")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MOE_CONFIG = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768,
                  intermediate_size=3072, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645)


def write_model(path: Path, tokenizer_dir: Path) -> None:
    """The random-weight Qwen3-MoE directory (skipped when ``path`` already holds one)."""
    if (path / "model.safetensors").exists():
        return
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**MOE_CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)


def write_gguf(model_dir: Path) -> Path:
    """The model's Q8_0 GGUF beside its directory (written once)."""
    path = model_dir.with_name(model_dir.name + "-q8_0.gguf")
    if not path.exists():
        import transformers

        from tests.unit.model.test_gguf_moe import write_moe_gguf
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        write_moe_gguf(path, model, "qwen3_moe", expert_types=("Q8_0", "Q8_0", "Q8_0"))
    return path


def gguf_peer(path: Path, args: argparse.Namespace, port: int) -> Peer:
    return Peer(f"servelm serve {path.name} (Q8_0 GGUF)", [
        sys.executable, "-m", "servelm", "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
        "--num-threads", str(args.threads), "--tokenizer", args.hf_dir, "--served-model-name", args.model,
        *args.servelm_args.split()], {}, args.startup_s, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="/tmp/moe-peers/qwen3-moe-16e-top4")
    parser.add_argument("--tokenizer-dir", default=str(TOKENIZER_DIR))
    parser.add_argument("--peers", default="servelm,vllm")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=18433)
    parser.add_argument("--servelm-args", default="", help="extra servelm flags (default: none)")
    parser.add_argument("--startup-s", type=float, default=1800,
                        help="how long a server may take to start (vLLM compiles its graphs on a first start)")
    parser.add_argument("--gguf", action="store_true", help="also servelm on the weights as a Q8_0 GGUF")
    parser.add_argument("--log-dir", default="/tmp/moe_peers")
    args = parser.parse_args()
    model_dir = Path(args.model_dir)
    write_model(model_dir, Path(args.tokenizer_dir))
    args.model = args.hf_dir = str(model_dir)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    peers, skipped = find_peers(args, model_dir, args.port)
    for message in skipped:
        print(f"skipped {message}", flush=True)
    for peer in peers:
        peer.startup_s = args.startup_s
    if args.gguf:
        peers.append(gguf_peer(write_gguf(model_dir), args, args.port + len(peers)))
    print(f"{model_dir}: {MOE_CONFIG}; {args.threads} threads, {os.cpu_count()} cpus", flush=True)
    print_rounds(measure_peers(peers, args, log_dir), args.rounds)

if __name__ == "__main__":
    main()
