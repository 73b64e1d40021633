"""Tiny random-weight transformers checkpoints for tests (shared by model and engine tests).

``make_tiny_model_dir(tmp_path, arch)`` writes ``config.json`` + ``model.safetensors`` (no tokenizer)
for arch in ``TINY_ARCHS``. Weights come from transformers' own init with a fixed seed, with a
larger std than usual so greedy outputs vary from token to token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from servelm.model.gguf.gguf_blocks import BlockWeight

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
TINY_TP_ARCHS = ("llama_uneven", "gemma3_mqa")
"""Head layouts for tensor-parallel tests: ``llama_uneven`` has 6 query / 3 KV heads (SmolLM2's
9/3 in miniature: 2 ranks split the KV heads 2 + 1); ``gemma3_mqa`` has one KV head (Gemma 3 270M:
the KV head is replicated on every rank)."""
TINY_MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")
"""Mixture-of-experts configs: 8 experts (top-2, qwen2_moe top-4), a dense layer among the sparse
ones where the family has them (qwen3_moe's ``mlp_only_layers``, qwen2_moe's
``decoder_sparse_step``), renormalised top-k (qwen3_moe, mixtral) and not (qwen2_moe, olmoe)."""
TINY_MLA_ARCHS = ("deepseek_v2", "deepseek_v3")
"""DeepSeek's multi-head latent attention and experts, V2-Lite's shape scaled down (kv_lora_rank 32,
rope 8, no-rope 16, v 16; 8 routed experts, shared experts, layer 0 dense): ``deepseek_v2`` without
q_lora_rank (V2-Lite), group-limited softmax top-3 (4 groups of 2, best 2: a top-3 across three
groups is refused), YaRN whose mscale and
mscale_all_dim differ (so the cos/sin factor and the softmax scale both depart from 1);
``deepseek_v3`` with q_lora_rank, sigmoid grouped top-2 with a random correction bias,
renormalised and scaled by 2.5, interleaved rope."""
TINY_NUM_EXPERTS = 8
TINY_SLIDING_WINDOW = 8
TINY_VOCAB_SIZE = 320


def make_tiny_config(arch: str) -> Any:
    """A transformers config with hidden 64, 2-4 layers, GQA (4 heads / 2 KV heads), vocab 320."""
    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if arch == "llama_uneven":
        return transformers.LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 6,
                                           "num_key_value_heads": 3}, num_hidden_layers=2,
                                        tie_word_embeddings=True, hidden_act="silu")
    if arch == "gemma3_mqa":
        config = make_tiny_config("gemma3")
        config.num_key_value_heads = 1
        return config
    moe = dict(num_experts_per_tok=2, output_router_logits=False)
    if arch == "qwen3_moe":  # layers 0 and 2 sparse, 1 dense; renormalised top-2
        return transformers.Qwen3MoeConfig(
            **common, **moe, num_hidden_layers=3, head_dim=32, num_experts=TINY_NUM_EXPERTS,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
    if arch == "mixtral":  # every layer sparse; softmax over the chosen two
        return transformers.MixtralConfig(**{**common, "intermediate_size": 48}, **moe, num_hidden_layers=2,
                                          num_local_experts=TINY_NUM_EXPERTS, tie_word_embeddings=False)
    if arch == "qwen2_moe":  # every 2nd layer sparse, with the shared expert; top-4 not renormalised
        return transformers.Qwen2MoeConfig(
            **common, **{**moe, "num_experts_per_tok": 4}, num_hidden_layers=2, num_experts=TINY_NUM_EXPERTS,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2,
            norm_topk_prob=False, tie_word_embeddings=False)
    if arch == "olmoe":  # whole-projection q/k norms, q/k/v clipped; top-2 not renormalised
        return transformers.OlmoeConfig(**{**common, "intermediate_size": 32}, **moe, num_hidden_layers=2,
                                        num_experts=TINY_NUM_EXPERTS, clip_qkv=3.0, norm_topk_prob=False,
                                        tie_word_embeddings=False)
    mla = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=TINY_NUM_EXPERTS, n_shared_experts=2,
               moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
               tie_word_embeddings=False)
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **{**common, **mla}, **{**moe, "num_experts_per_tok": 3}, q_lora_rank=None,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                             "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 64})
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**common, **mla}, **moe, q_lora_rank=24, norm_topk_prob=True,
                                             routed_scaling_factor=2.5, rope_interleave=True)
    if arch == "llama":  # SmolLM2-like: tied embeddings; llama3 rope scaling
        return transformers.LlamaConfig(
            **common, num_hidden_layers=2, tie_word_embeddings=True, hidden_act="silu",
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32})
    if arch == "qwen2":  # qkv bias, untied head
        return transformers.Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "qwen3":  # qk norm, explicit head_dim
        return transformers.Qwen3Config(**common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)
    if arch == "gemma3":  # sliding + global layers, window 8
        return transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS + TINY_MOE_ARCHS + TINY_MLA_ARCHS}")


TINY_SEEDS = {"mixtral": 2}
"""Seeds other than 0: seed 0's Mixtral router never picks one expert of layer 1 on the parity
tests' prompts (an expert whose weights no test would check)."""


def make_tiny_hf_model(arch: str, seed: int | None = None) -> Any:
    """The transformers model (float32, eval mode, eager attention) for ``make_tiny_config(arch)``
    (``seed`` None: ``TINY_SEEDS``' or 0)."""
    seed = TINY_SEEDS.get(arch, 0) if seed is None else seed
    config = make_tiny_config(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model, 0.0 if arch.startswith("gemma3") else 1.0)  # Gemma norms scale by (1 + w)
    return model.eval()


def perturb_norms_and_biases(model: Any, norm_mean: float) -> None:
    """HF inits norms at identity and biases (DeepSeek-V3's routing bias too) at 0; perturb them so
    loading them is actually tested."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(norm_mean, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero at init
                buffer.normal_(0.0, 0.1)


def make_tiny_model_dir(tmp_path: str | Path, arch: str, seed: int | None = None) -> Path:
    """Save a tiny model as ``tmp_path/tiny-<arch>/{config.json, model.safetensors}``; returns the dir."""
    path = Path(tmp_path) / f"tiny-{arch}"
    make_tiny_hf_model(arch, seed).save_pretrained(path, safe_serialization=True)
    return path


def random_block_weight(n: int, k: int, block: int, offsets: bool, seed: int) -> BlockWeight:
    """A GGUF-style block weight [n, k] of random int8 codes, a scale per ``block`` inputs and, with
    ``offsets``, an offset per block (the kernels' tests: gguf_rows, gguf_i8gemm)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, k // block, generator=generator) * 1e-2
    offs = torch.randn(n, k // block, generator=generator) * 1e-2 if offsets else None
    return BlockWeight(codes, scales, offs, block, "test")


# -- a tiny vision-language model (Gemma 3 + SigLIP) -------------------------------------------------

TINY_VLM_BOI, TINY_VLM_EOI, TINY_VLM_IMAGE = 300, 301, 302
"""<start_of_image>, <end_of_image> and the image placeholder token of the tiny Gemma 3 VLM."""
TINY_VLM_NEWLINES = 7
"""The token the tiny VLM's processor puts around an expanded image (Gemma's "\\n\\n")."""
TINY_VLM_IMAGE_SIZE = 64
TINY_VLM_IMAGE_TOKENS = 16
"""4 x 4 pooled from SigLIP's 8 x 8 patches: longer than the text model's sliding window (8), so a
sliding layer's window cuts through an image block."""


def make_tiny_vlm_config() -> Any:
    """Gemma3Config: the tiny Gemma 3 text model (window 8) + a 2-layer SigLIP over 64 x 64 images."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=TINY_VLM_IMAGE_SIZE, patch_size=8, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=make_tiny_config("gemma3"), vision_config=vision, mm_tokens_per_image=TINY_VLM_IMAGE_TOKENS,
        boi_token_index=TINY_VLM_BOI, eoi_token_index=TINY_VLM_EOI, image_token_index=TINY_VLM_IMAGE,
        tie_word_embeddings=True)


def make_tiny_vlm(seed: int = 0) -> Any:
    """transformers' Gemma3ForConditionalGeneration (float32, eval, eager attention) with every
    weight random: Gemma (1 + w) norms around 0, SigLIP LayerNorms around 1, biases and the
    projector (zeros at init) drawn too, so loading each of them is tested."""
    config = make_tiny_vlm_config()
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager",
                                                                     dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_layer_norm = "vision_tower" in name and ("layer_norm" in name or "post_layernorm" in name)
            if is_layer_norm and name.endswith(".weight"):
                param.normal_(1.0, 0.1)
            elif "norm" in name and not is_layer_norm:
                param.normal_(0.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "mm_input_projection_weight" in name:
                param.normal_(0.0, 0.1)
    return model.eval()


def make_tiny_vlm_dir(tmp_path: str | Path, seed: int = 0) -> Path:
    """Save the tiny VLM with a ``preprocessor_config.json`` (64 x 64, transformers' Gemma 3
    defaults otherwise) as ``tmp_path/tiny-gemma3-vlm``; returns the dir."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    path = Path(tmp_path) / "tiny-gemma3-vlm"
    make_tiny_vlm(seed).save_pretrained(path, safe_serialization=True)
    Gemma3ImageProcessorPil(size={"height": TINY_VLM_IMAGE_SIZE, "width": TINY_VLM_IMAGE_SIZE}).save_pretrained(path)
    return path


def random_image(seed: int, width: int = 80, height: int = 56, mode: str = "RGB") -> Any:
    """A PIL image of random pixels (the processor resizes it to the tower's size)."""
    from PIL import Image
    generator = torch.Generator().manual_seed(seed)
    channels = len(mode) if mode in ("RGB", "RGBA") else 1
    pixels = torch.randint(0, 256, (height, width, channels), generator=generator, dtype=torch.uint8).numpy()
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)   # RGB, RGBA or L by shape


# -- a tiny Qwen2-VL ---------------------------------------------------------------------------------

TINY_QWEN2_VL_START, TINY_QWEN2_VL_END, TINY_QWEN2_VL_IMAGE = 300, 301, 302
"""<|vision_start|>, <|vision_end|> and <|image_pad|> of the tiny Qwen2-VL."""
TINY_QWEN2_VL_PIXELS = {"min_pixels": 256, "max_pixels": 4096, "patch_size": 4, "merge_size": 2,
                        "temporal_patch_size": 2}
"""Its image processor: sides in multiples of 8 (patch 4 x merge 2), 256..4096 pixels."""


TINY_QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""Qwen2-VL and Qwen2.5-VL: one text model, processor and token ids; their vision towers differ."""


def make_tiny_qwen2_vl_config(family: str = "qwen2_vl") -> Any:
    """Qwen2VLConfig (or Qwen2_5_VLConfig): a 2-layer Qwen2 text model (head_dim 16, mrope_section
    2/3/3) + a small tower. Qwen2.5-VL's has 3 blocks, the middle one full attention, the others in
    windows of 2 x 2 merge units (16 pixels), so the test images span several windows, partial ones too."""
    text_kwargs = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    tower_kwargs = dict(num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1)
    if family == "qwen2_5_vl":
        text = transformers.Qwen2_5_VLTextConfig(**text_kwargs)
        vision = transformers.Qwen2_5_VLVisionConfig(
            depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, hidden_act="silu", window_size=16,
            fullatt_block_indexes=[1], **tower_kwargs)
        config_class = transformers.Qwen2_5_VLConfig
    else:
        text = transformers.Qwen2VLTextConfig(**text_kwargs)
        vision = transformers.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2,
                                                  hidden_act="quick_gelu", **tower_kwargs)
        config_class = transformers.Qwen2VLConfig
    return config_class(
        text_config=text, vision_config=vision, image_token_id=TINY_QWEN2_VL_IMAGE, video_token_id=303,
        vision_start_token_id=TINY_QWEN2_VL_START, vision_end_token_id=TINY_QWEN2_VL_END,
        tie_word_embeddings=False)


def make_tiny_qwen2_vl(seed: int = 0, family: str = "qwen2_vl") -> Any:
    """transformers' Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration (float32,
    eval, eager), norms and biases drawn."""
    config = make_tiny_qwen2_vl_config(family)
    model_class = (transformers.Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl"
                   else transformers.Qwen2VLForConditionalGeneration)
    return _random_vlm(model_class, config, seed)


def _random_vlm(model_class: Any, config: Any, seed: int) -> Any:
    """``model_class`` over ``config`` (float32, eval, eager) with norm scales (``norm``, ``ln_q``)
    drawn around 1 and biases around 0, so loading each of them is tested."""
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith(".weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


def make_tiny_qwen2_vl_dir(tmp_path: str | Path, seed: int = 0, family: str = "qwen2_vl") -> Path:
    """Save the tiny Qwen2-VL (or Qwen2.5-VL) with its ``preprocessor_config.json`` as
    ``tmp_path/tiny-<family>``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    path = Path(tmp_path) / f"tiny-{family.replace('_', '-')}"
    make_tiny_qwen2_vl(seed, family).save_pretrained(path, safe_serialization=True)
    Qwen2VLImageProcessorPil(**TINY_QWEN2_VL_PIXELS).save_pretrained(path)
    return path


TINY_VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma 3's chat template in miniature: content lists walked, an image item written as the marker."""


# -- a tiny Idefics3 / SmolVLM --------------------------------------------------------------------------

TINY_IDEFICS3_FAKE, TINY_IDEFICS3_GLOBAL, TINY_IDEFICS3_IMAGE, TINY_IDEFICS3_END = 300, 301, 302, 303
"""<fake_token_around_image>, <global-img>, <image> and <end_of_utterance> of the tiny Idefics3."""
TINY_IDEFICS3_ROW_COL = {f"<row_{r}_col_{c}>": 304 + 2 * (r - 1) + (c - 1) for r in (1, 2) for c in (1, 2)}
TINY_IDEFICS3_PIXELS = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 48}}
"""Frames of 48 x 48, images up to 96 a side: at most 2 x 2 crops plus the whole image."""
TINY_IDEFICS3_FAMILIES = ("idefics3", "smolvlm")


def make_tiny_idefics3_config(family: str = "idefics3") -> Any:
    """Idefics3Config (or SmolVLMConfig): the tiny Llama text model + a 2-layer SigLIP-style tower
    over 48 x 48 frames of 8-pixel patches (6 x 6: the bucketed position ids' 1/6 steps are inexact
    in float32), pixel shuffle by 2: 9 tokens per frame."""
    vision_kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         image_size=48, patch_size=8, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                         initializer_range=0.1)
    if family == "smolvlm":
        vision, config_class = transformers.SmolVLMVisionConfig(**vision_kwargs), transformers.SmolVLMConfig
    else:
        vision, config_class = transformers.Idefics3VisionConfig(**vision_kwargs), transformers.Idefics3Config
    return config_class(text_config=make_tiny_config("llama"), vision_config=vision, scale_factor=2,
                        image_token_id=TINY_IDEFICS3_IMAGE, tie_word_embeddings=True)


def make_tiny_idefics3(seed: int = 0, family: str = "idefics3") -> Any:
    """transformers' Idefics3ForConditionalGeneration or SmolVLMForConditionalGeneration (float32,
    eval, eager), LayerNorms, RMSNorms and biases drawn."""
    config = make_tiny_idefics3_config(family)
    model_class = (transformers.SmolVLMForConditionalGeneration if family == "smolvlm"
                   else transformers.Idefics3ForConditionalGeneration)
    return _random_vlm(model_class, config, seed)


def make_tiny_idefics3_dir(tmp_path: str | Path, seed: int = 0, family: str = "idefics3") -> Path:
    """Save the tiny Idefics3 (or SmolVLM) with its ``preprocessor_config.json`` and tokenizer as
    ``tmp_path/tiny-<family>``."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    path = Path(tmp_path) / f"tiny-{family}"
    make_tiny_idefics3(seed, family).save_pretrained(path, safe_serialization=True)
    Idefics3ImageProcessorPil(**TINY_IDEFICS3_PIXELS).save_pretrained(path)
    write_tiny_vlm_tokenizer(path, family="idefics3")
    return path


TINY_IDEFICS3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
"""SmolVLM's chat template in miniature: an image item written as ``<image>``."""

_TINY_TOKENIZERS: dict[str, tuple[dict[int, str], dict[str, str], str]] = {
    "gemma3": ({0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<start_of_turn>", 4: "<end_of_turn>",
                TINY_VLM_BOI: "<start_of_image>", TINY_VLM_EOI: "<end_of_image>", TINY_VLM_IMAGE: "<image_soft_token>"},
               {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
               TINY_VLM_CHAT_TEMPLATE),
    "idefics3": ({0: "<pad>", 1: "<eos>", 2: "<bos>", TINY_IDEFICS3_FAKE: "<fake_token_around_image>",
                  TINY_IDEFICS3_GLOBAL: "<global-img>", TINY_IDEFICS3_IMAGE: "<image>",
                  TINY_IDEFICS3_END: "<end_of_utterance>",
                  **{token_id: text for text, token_id in TINY_IDEFICS3_ROW_COL.items()}},
                 {"image_token": "<image>"}, TINY_IDEFICS3_CHAT_TEMPLATE),
}


def write_tiny_vlm_tokenizer(path: str | Path, family: str = "gemma3") -> None:
    """A real byte-level BPE tokenizer (``tokenizers``, no merges) for a tiny VLM in ``path``
    (``family`` gemma3 or idefics3): ids 0-4 pad/eos/bos (and Gemma's turn markers), the byte
    symbols of printable ASCII, tab and newline from 10 on, the family's image tokens at their
    config ids (300 on), and ASCII words ``w<id>`` for the other ids, so that whatever a random
    model generates decodes to ASCII text; with the family's chat template. Text in is ASCII only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials, extra_special_tokens, chat_template = _TINY_TOKENIZERS[family]
    byte_symbols = _byte_level_symbols()
    ascii_bytes = [9, 10, *range(32, 127)]
    vocab = {byte_symbols[byte]: 10 + index for index, byte in enumerate(ascii_bytes)}
    for token_id in range(TINY_VOCAB_SIZE):
        if token_id not in vocab.values():
            vocab.setdefault(specials.get(token_id, f"w{token_id}"), token_id)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials.values()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", extra_special_tokens=extra_special_tokens)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def _byte_level_symbols() -> dict[int, str]:
    """byte -> the symbol the ByteLevel pre-tokenizer writes for it (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    symbols = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols
