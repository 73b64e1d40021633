"""Image encode time and time to first token with one image, against a text prompt of the same
token count (issue 32), on a Gemma 3 shaped model with random (dummy) weights.

The model: Gemma 3 270M's text shape (hidden 640, 18 layers, one KV head of 256, window 512; the
vocabulary cut to 32k so the random init is quick) with a SigLIP-base tower (224 px, patch 16,
12 layers of 768) pooled to 49 tokens per image (7 x 7). Real Gemma 3 4B uses SigLIP-so400m at
896 px (4,096 patches -> 256 tokens): its tower costs about 60x this one's.

    python benchmarks/multimodal_ttft.py [--threads 2] [--reps 3]

Prints one JSON object: encode_ms (the tower + projector for one image), ttft_ms for the image
prompt with the image not yet encoded, with the image in the encoder cache, and for text of the
same length (prefix cache off throughout, so every prompt is computed whole).
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

BOI, EOI, IMAGE, NEWLINES = 30000, 30001, 30002, 108


def write_model(path: Path) -> None:
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


def first_token_ms(engine: LLMEngine, request_id: str, ids: list[int], mm_inputs: object = None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    assert engine.add_request(request_id, ids, params, mm_inputs=mm_inputs) is None   # type: ignore[arg-type]
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from PIL import Image

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        write_model(path)
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(path), load_format="dummy", dtype="float32", skip_tokenizer_init=True),
            cache=CacheConfig(max_total_tokens=8192, disable_radix_cache=True),
            runtime=RuntimeConfig(num_threads=args.threads)))
        processor = get_processor(str(path))
        assert processor is not None
        processor.newline_ids = [NEWLINES]
        generator = torch.Generator().manual_seed(0)

        def image(seed: int) -> object:
            pixels = torch.randint(0, 256, (480, 640, 3), generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.uint8).numpy()
            return image_item(Image.fromarray(pixels))

        text = torch.randint(200, 20000, (24,), generator=generator).tolist()
        runner = engine.runner
        encode, cold, warm, plain, preprocess = [], [], [], [], []
        for rep in range(args.reps + 1):   # the first round warms up
            item = image(rep)
            start = time.perf_counter()
            inputs = processor.process(text[:12] + [BOI] + text[12:], [item])
            preprocess.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            runner.encode_images(list(inputs.images))
            encode.append((time.perf_counter() - start) * 1e3)
            runner.encoder_cache.clear()
            cold.append(first_token_ms(engine, f"cold{rep}", inputs.prompt_token_ids, inputs))
            warm.append(first_token_ms(engine, f"warm{rep}", inputs.prompt_token_ids, inputs))
            same_length = torch.randint(200, 20000, (len(inputs.prompt_token_ids),), generator=generator).tolist()
            plain.append(first_token_ms(engine, f"text{rep}", same_length))
        result = {
            "threads": args.threads, "prompt_tokens": len(inputs.prompt_token_ids),
            "image_tokens": inputs.num_image_tokens,
            "preprocess_ms": round(statistics.median(preprocess[1:]), 1),
            "encode_ms": round(statistics.median(encode[1:]), 1),
            "ttft_image_ms": round(statistics.median(cold[1:]), 1),
            "ttft_image_encoder_cached_ms": round(statistics.median(warm[1:]), 1),
            "ttft_text_same_length_ms": round(statistics.median(plain[1:]), 1),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
