"""Image encode time and time to first token with one image, against a text prompt of the same
token count (issue 32), on vision-language models of the three families with random (dummy)
weights, tiny but of real checkpoints' layer shapes (vocabularies cut to 32k so the random init is
quick; fewer layers where noted, so that a run fits the shared 2-core machine):

- gemma3: Gemma 3 270M's text shape (hidden 640, 18 layers, one KV head of 256, window 512) with a
  SigLIP-base tower (224 px, patch 16, 12 layers of 768) pooled to 49 tokens per image (7 x 7).
  Real Gemma 3 4B uses SigLIP-so400m at 896 px (4,096 patches -> 256 tokens): ~60x this tower.
- qwen2_5_vl: Qwen2.5-VL-3B's tower blocks (1280 wide, 16 heads, window 112, patch 14, merge 2) but
  8 of its 32 (full attention at 3 and 7); the 640 x 480 image resized within 224 x 224 pixels
  (aspect kept: 216 patches -> 54 tokens); the text model Qwen2.5-0.5B's shape (hidden 896, 24
  layers, 14 heads, 2 KV heads) with M-RoPE.
- smolvlm: SmolVLM-256M's text model (SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads) and
  tower (SigLIP-base: 12 layers of 768, patch 16) on one 256 px frame (the real frame is 512 px;
  no splitting) -> pixel shuffle by 2 -> 64 tokens.

    python benchmarks/multimodal_ttft.py [--threads 2] [--reps 3] [--families gemma3,qwen2_5_vl,smolvlm]

Prints one JSON object per family: encode_ms (the tower + projector for one image), ttft_ms for the
image prompt with the image not yet encoded, with the image in the encoder cache, and for text of
the same length (prefix cache off throughout, so every prompt is computed whole), the three taken
interleaved in each repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.multimodal.processor import get_processor, image_item  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402

from tests.tiny_models import write_tiny_vlm_tokenizer  # noqa: E402

BOI, EOI, IMAGE, NEWLINES = 30000, 30001, 30002, 108
VISION_START, IMAGE_PAD, VISION_END = 30010, 30011, 30012
SMOL_IMAGE = 302   # <image> in the tiny Idefics3 tokenizer (tests/tiny_models.py), its other tokens 300-307


def write_gemma3(path: Path) -> list[int]:
    """Writes the model's folder; returns the prompt ids that name one image."""
    text = transformers.Gemma3TextConfig(
        vocab_size=32768, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768)
    vision = transformers.SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                             num_attention_heads=12, image_size=224, patch_size=16,
                                             hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=49,
                                       boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 224, "width": 224},
                                                               "image_seq_length": 49}))
    return [BOI]


def write_qwen2_5_vl(path: Path) -> list[int]:
    text = transformers.Qwen2_5_VLTextConfig(
        vocab_size=32768, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]})
    vision = transformers.Qwen2_5_VLVisionConfig(
        depth=8, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=896, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3, 7],
        hidden_act="silu")
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                                           video_token_id=30013, vision_start_token_id=VISION_START,
                                           vision_end_token_id=VISION_END, tie_word_embeddings=True)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 224 * 224, "max_pixels": 224 * 224}))
    return [VISION_START, IMAGE_PAD, VISION_END]


def write_smolvlm(path: Path) -> list[int]:
    text = transformers.LlamaConfig(
        vocab_size=32768, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0)
    vision = transformers.SmolVLMVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, image_size=256, patch_size=16)
    config = transformers.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                                        image_token_id=SMOL_IMAGE, tie_word_embeddings=True)
    config.architectures = ["SmolVLMForConditionalGeneration"]
    config.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 256}, "max_image_size": {"longest_edge": 256}, "do_image_splitting": False}))
    write_tiny_vlm_tokenizer(path, family="idefics3")
    return [SMOL_IMAGE]


FAMILIES = {"gemma3": write_gemma3, "qwen2_5_vl": write_qwen2_5_vl, "smolvlm": write_smolvlm}


def first_token_ms(engine: LLMEngine, request_id: str, ids: list[int], mm_inputs: object = None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    assert engine.add_request(request_id, ids, params, mm_inputs=mm_inputs) is None   # type: ignore[arg-type]
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def measure(family: str, threads: int, reps: int) -> dict[str, object]:
    from PIL import Image
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        marker = FAMILIES[family](path)
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(path), load_format="dummy", dtype="float32", skip_tokenizer_init=True),
            cache=CacheConfig(max_total_tokens=8192, disable_radix_cache=True),
            runtime=RuntimeConfig(num_threads=threads)))
        tokenizer = AutoTokenizer.from_pretrained(str(path)) if family == "smolvlm" else None
        processor = get_processor(str(path), tokenizer)
        assert processor is not None
        if family == "gemma3":
            processor.newline_ids = [NEWLINES]
        generator = torch.Generator().manual_seed(0)

        def image(seed: int) -> object:
            pixels = torch.randint(0, 256, (480, 640, 3), generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.uint8).numpy()
            return image_item(Image.fromarray(pixels))

        text = torch.randint(200, 20000, (24,), generator=generator).tolist()
        runner = engine.runner
        encode, cold, warm, plain, preprocess = [], [], [], [], []
        try:
            for rep in range(reps + 1):   # the first round warms up
                item = image(rep)
                start = time.perf_counter()
                inputs = processor.process(text[:12] + marker + text[12:], [item])
                preprocess.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                runner.encode_images(list(inputs.images))
                encode.append((time.perf_counter() - start) * 1e3)
                runner.encoder_cache.clear()
                cold.append(first_token_ms(engine, f"cold{rep}", inputs.prompt_token_ids, inputs))
                warm.append(first_token_ms(engine, f"warm{rep}", inputs.prompt_token_ids, inputs))
                same_length = torch.randint(200, 20000, (len(inputs.prompt_token_ids),),
                                            generator=generator).tolist()
                plain.append(first_token_ms(engine, f"text{rep}", same_length))
        finally:
            engine.shutdown()
        return {
            "family": family, "threads": threads, "prompt_tokens": len(inputs.prompt_token_ids),
            "image_tokens": inputs.num_image_tokens,
            "preprocess_ms": round(statistics.median(preprocess[1:]), 1),
            "encode_ms": round(statistics.median(encode[1:]), 1),
            "ttft_image_ms": round(statistics.median(cold[1:]), 1),
            "ttft_image_encoder_cached_ms": round(statistics.median(warm[1:]), 1),
            "ttft_text_same_length_ms": round(statistics.median(plain[1:]), 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    for family in args.families.split(","):
        print(json.dumps(measure(family, args.threads, args.reps)), flush=True)


if __name__ == "__main__":
    main()
