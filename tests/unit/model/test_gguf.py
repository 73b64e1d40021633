"""GGUF reading: name mapping, llama.cpp conversions undone, and parity with transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from servelm.model.gguf.gguf_file import GGUFError, GGUFFile, gguf_to_hf_name, llama_permute, reverse_llama_permute


def test_name_mapping() -> None:
    assert gguf_to_hf_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight", "qwen2") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight", "gemma3") == "model.norm.weight"
    assert gguf_to_hf_name("blk.3.attn_q.bias", "qwen2") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_output.weight", "llama") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.1.ffn_norm.weight", "llama") == "model.layers.1.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.1.ffn_norm.weight", "gemma3") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.1.post_attention_norm.weight", "gemma3") == \
        "model.layers.1.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_k_norm.weight", "qwen3") == "model.layers.2.self_attn.k_norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight", "llama") is None
    with pytest.raises(GGUFError):
        gguf_to_hf_name("blk.0.mystery.weight", "llama")


def test_llama_permute_round_trip_and_layout() -> None:
    num_heads, head_dim = 3, 8
    weight = torch.arange(num_heads * head_dim * 2, dtype=torch.float32).reshape(num_heads * head_dim, 2)
    permuted = llama_permute(weight, num_heads)
    assert torch.equal(reverse_llama_permute(permuted, num_heads), weight)
    # llama.cpp interleaves the rotary halves: per head, row order 0, 4, 1, 5, 2, 6, 3, 7.
    assert permuted[:8, 0].tolist() == [0, 8, 2, 10, 4, 12, 6, 14]
    bias = torch.arange(num_heads * head_dim, dtype=torch.float32)
    assert torch.equal(reverse_llama_permute(llama_permute(bias, num_heads), num_heads), bias)


def _write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], tied: bool) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(4)
        writer.add_value_length(4)
        writer.add_sliding_window(16)
    else:
        writer.add_rope_dimension_count(4)
    writer.add_vocab_size(10)
    writer.add_eos_token_id(1)
    writer.add_token_list([f"t{i}" for i in range(9)] + ["<|endoftext|>"])
    for name, array in tensors.items():
        if tied and name == "output.weight":
            continue
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"token_embd.weight": (10, 8), "output_norm.weight": (8,), "output.weight": (10, 8),
              "blk.0.attn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
              "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8),
              "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def test_tiny_llama_gguf_round_trip(tmp_path: Path) -> None:
    hf = _hf_tensors(np.random.default_rng(0))
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = llama_permute(torch.from_numpy(hf["blk.0.attn_q.weight"]), 2).numpy()
    stored["blk.0.attn_k.weight"] = llama_permute(torch.from_numpy(hf["blk.0.attn_k.weight"]), 1).numpy()
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "llama", stored, tied=True)
    gguf_file = GGUFFile.open(path)
    config = gguf_file.hf_config({"rms_norm_eps": 1e-5})
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 1, 1)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5 and config.head_dim == 4
    assert gguf_file.token_id("<|endoftext|>") == 9
    tensors = dict(gguf_file.tensors())
    assert "lm_head.weight" not in tensors
    for gguf_name, array in hf.items():
        if gguf_name == "output.weight":
            continue
        name = gguf_to_hf_name(gguf_name, "llama")
        assert torch.equal(tensors[name], torch.from_numpy(array)), name


def test_tiny_gemma3_norms_minus_one(tmp_path: Path) -> None:
    hf = _hf_tensors(np.random.default_rng(1))
    path = tmp_path / "tiny-gemma.gguf"
    _write_tiny_gguf(path, "gemma3", hf, tied=False)
    gguf_file = GGUFFile.open(path)
    config = gguf_file.hf_config()
    assert config.model_type == "gemma3_text" and config.sliding_window == 16 and not config.tie_word_embeddings
    tensors = dict(gguf_file.tensors())
    assert torch.equal(tensors["model.norm.weight"], torch.from_numpy(hf["output_norm.weight"]) - 1)
    assert torch.equal(tensors["model.layers.0.pre_feedforward_layernorm.weight"],
                       torch.from_numpy(hf["blk.0.ffn_norm.weight"]) - 1)
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(hf["blk.0.attn_q.weight"]))  # no permutation outside llama
    assert torch.equal(tensors["lm_head.weight"], torch.from_numpy(hf["output.weight"]))


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFError, match="bad magic"):
        GGUFFile.open(path)


# -- parity with transformers on the packaged real models -----------------------------------------

def _reference(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """transformers' float32 tensors and config of packaged model ``name`` (one load per session,
    shared with the beam search and LoRA tests)."""
    from tests.reference import packaged_reference_model
    model = packaged_reference_model(name)
    return model.state_dict(), model.config.to_dict()


def _check_parity(name: str) -> None:
    from servelm.model.packaged import PackagedModelError, packaged_model_path
    try:
        path = packaged_model_path(name)
    except PackagedModelError as e:
        pytest.skip(str(e))
    reference, reference_config = _reference(name)
    gguf_file = GGUFFile.open(path)
    config = gguf_file.hf_config().to_dict()
    ignored = {"_model_name_or_path", "_name_or_path", "architectures", "dtype", "quantization_config"}
    assert {k: v for k, v in config.items() if k not in ignored} == \
        {k: v for k, v in reference_config.items() if k not in ignored}
    seen = set()
    for hf_name, tensor in gguf_file.tensors():
        seen.add(hf_name)
        assert torch.equal(tensor, reference[hf_name]), hf_name
    missing = set(reference) - seen
    if config["tie_word_embeddings"]:
        assert missing == {"lm_head.weight"}
    else:
        assert not missing


def test_smollm2_parity_with_transformers() -> None:
    _check_parity("smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_parity_with_transformers_slow(name: str) -> None:
    _check_parity(name)
