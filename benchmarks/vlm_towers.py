"""Vision-tower encode time of the newer families (issue 32) at real checkpoints' tower shapes,
random weights, float32: servelm's tower against transformers' on the same weights, in one process
(the ratio is the figure; absolute times depend on the machine's load).

- Qwen2.5-VL-3B's tower (32 blocks of 1280, 16 heads, window 112, full attention at 7/15/23/31,
  patch 14, merge 2) on one 224 x 224 image: 256 patches -> 64 tokens (the two towers' 2 x 2.7 GB
  of weights side by side).
- SmolVLM-256M's tower (SigLIP-base: 12 layers of 768, 512 px frames, patch 16) on one frame:
  1,024 patches; the pixel shuffle (scale 4) + projection to 576 -> 64 tokens (ours only: the
  connector is a reshape and one matmul).

    python benchmarks/vlm_towers.py [--threads 2] [--reps 3] [--towers smolvlm,qwen2_5_vl]

Prints one JSON object per tower: ms (median) for servelm and transformers, and the largest
absolute difference of their outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.model.architectures.common import load_named_weights  # noqa: E402
from servelm.model.architectures.idefics3 import Idefics3VisionTower  # noqa: E402
from servelm.model.architectures.qwen2_5_vl import Qwen2_5_VLVisionTower  # noqa: E402


def median_ms(run: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times, out = [], None
    with torch.inference_mode():
        for _ in range(reps):
            start = time.perf_counter()
            out = run()
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), out


def qwen2_5_vl(reps: int) -> dict[str, Any]:
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu")
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    torch.manual_seed(0)
    reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, attn_implementation="sdpa").eval()
    ours = Qwen2_5_VLVisionTower(config)
    load_named_weights(ours, reference.state_dict().items())
    grid = (1, 16, 16)
    patches = torch.randn(16 * 16, 3 * 2 * 14 * 14)
    ours_ms, ours_out = median_ms(lambda: ours(patches, [grid])[0], reps)
    reference_ms, reference_out = median_ms(
        lambda: reference(patches, grid_thw=torch.tensor([grid])).pooler_output, reps)
    return {"tower": "Qwen2.5-VL-3B shape, 224x224 image (256 patches -> 64 tokens)",
            "servelm_ms": round(ours_ms), "transformers_ms": round(reference_ms),
            "max_abs_diff": float((ours_out - reference_out).abs().max())}


def smolvlm(reps: int) -> dict[str, Any]:
    config = transformers.SmolVLMVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, image_size=512, patch_size=16)
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer
    torch.manual_seed(0)
    reference = SmolVLMVisionTransformer._from_config(config, attn_implementation="sdpa").eval()
    ours = Idefics3VisionTower(config)
    load_named_weights(ours, reference.state_dict().items())
    pixels = torch.randn(1, 3, 512, 512)
    ours_ms, ours_out = median_ms(lambda: ours(pixels), reps)
    reference_ms, reference_out = median_ms(lambda: reference(pixel_values=pixels).last_hidden_state, reps)
    return {"tower": "SmolVLM-256M shape (SigLIP-base), one 512x512 frame (1024 patches)",
            "servelm_ms": round(ours_ms), "transformers_ms": round(reference_ms),
            "max_abs_diff": float((ours_out - reference_out).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--towers", default="smolvlm,qwen2_5_vl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    towers = {"smolvlm": smolvlm, "qwen2_5_vl": qwen2_5_vl}
    for name in args.towers.split(","):
        print(json.dumps(towers[name](args.reps)), flush=True)


if __name__ == "__main__":
    main()
