"""Mixtral and Qwen3-MoE GGUF files (llama.cpp's layout: ``ffn_gate_inp`` router, stacked
``ffn_{gate,up,down}_exps`` experts) against transformers holding the same dequantized weights.

The files are written here from tiny random transformers models with the ``gguf`` package: the
experts in K-quant blocks (random bytes, scaled to the model's weight size: gguf-py cannot quantize
to K-quants) and Q8_0 (quantized from the model's own weights), attention and embedding in Q8_0.
The reference is the transformers model with each weight replaced by gguf's own dequantization of
the bytes written. Served in the file's blocks (``--quantization auto``), the experts run on the
GGUF block kernels, one linear per expert; dequantized (``--quantization none``), the float path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servelm.model.gguf import GGUFFile, llama_permute
from servelm.model.layers.moe import FusedMoE
from tests.prequantized_checkpoints import make_quant_hf_model

from .conftest import prompts_for
from .test_gguf_blocks import dequantize_raw, random_raw
from .test_prequantized import logits_and_greedy, make_quant_runner, reference_logits_and_greedy

HIDDEN = EXPERT_FFN = 256   # a K-quant block spans 256 inputs
EXPERT_TYPES = {"mixtral": ("Q4_K", "Q4_K", "Q6_K"), "qwen3_moe": ("Q8_0", "Q8_0", "Q4_K")}
"""(gate, up, down) expert types per family, as llama.cpp's Q4_K_M / Q8_0 mixes put them."""
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
_DENSE_MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


NUM_EXPERTS = 4   # top-2 of 4: every expert gets rows of the prompts, few blocks to repack


def _moe_model(arch: str) -> Any:
    if arch == "mixtral":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=EXPERT_FFN, seed=2,
                                   num_local_experts=NUM_EXPERTS)
    return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=EXPERT_FFN,
                               num_experts=NUM_EXPERTS)


def _encoded(values: np.ndarray, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF bytes of ``kind`` for ``values`` [rows, cols], their dequantization): Q8_0 quantizes the
    values; a K-quant is random blocks with headers scaled to the values' standard deviation."""
    import gguf
    from gguf.quants import quantize
    rows, cols = values.shape
    if kind == "Q8_0":
        raw = quantize(values, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    else:
        raw = random_raw(kind, rows, cols, seed)
        factor = float(values.std() / dequantize_raw(raw, kind, rows, cols).std())
        headers = raw.reshape(rows * cols // 256, -1)
        for offset in (0, 2) if kind == "Q4_K" else (208,):
            field = headers[:, offset:offset + 2].copy().view(np.float16)
            headers[:, offset:offset + 2] = (field.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1), dequantize_raw(raw, kind, rows, cols).numpy()


def write_moe_gguf(path: Path, model: Any, arch: str,
                   expert_types: tuple[str, str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write ``model`` as a llama.cpp GGUF of ``arch`` (experts in ``expert_types``, default
    ``EXPERT_TYPES[arch]``; the other linears Q8_0); returns its in-memory state dict with each
    weight as the file holds it (the transformers reference's weights)."""
    import gguf
    config = model.config
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    head_dim = config.hidden_size // config.num_attention_heads if arch == "mixtral" else config.head_dim
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(config.num_local_experts if arch == "mixtral" else config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "mixtral":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_vocab_size(config.vocab_size)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    seeds = iter(range(1000))

    def put(gguf_name: str, hf_name: str, kind: str = "F32", permute_heads: int = 0) -> None:
        values = state[hf_name].numpy()
        if kind == "F32":
            writer.add_tensor(gguf_name, values.astype(np.float32))
            return
        raw, stored = _encoded(values, kind, next(seeds))
        state[hf_name] = torch.from_numpy(stored)
        if permute_heads:   # llama.cpp's rotary row order (the loader undoes it)
            raw = llama_permute(torch.from_numpy(raw), permute_heads).numpy()
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    put("token_embd.weight", "model.embed_tokens.weight", "Q8_0")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight", "Q8_0")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        put(f"blk.{layer}.attn_norm.weight", f"{prefix}.input_layernorm.weight")
        put(f"blk.{layer}.ffn_norm.weight", f"{prefix}.post_attention_layernorm.weight")
        for hf, ours in _ATTENTION.items():
            if f"{prefix}.self_attn.{hf}.weight" in state:
                heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(hf, 0)
                put(f"blk.{layer}.{ours}.weight", f"{prefix}.self_attn.{hf}.weight",
                    "F32" if hf.endswith("norm") else "Q8_0", heads if arch == "mixtral" else 0)
        if f"{prefix}.mlp.gate.weight" not in state:   # a dense layer (Qwen3-MoE's mlp_only_layers)
            for hf, ours in _DENSE_MLP.items():
                put(f"blk.{layer}.{ours}.weight", f"{prefix}.mlp.{hf}.weight", "Q8_0")
            continue
        put(f"blk.{layer}.ffn_gate_inp.weight", f"{prefix}.mlp.gate.weight")
        _put_experts(writer, state, f"{prefix}.mlp.experts", layer, expert_types or EXPERT_TYPES[arch], seeds)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def _put_experts(writer: Any, state: dict[str, torch.Tensor], prefix: str, layer: int,
                 kinds: tuple[str, str, str], seeds: Any) -> None:
    """The stacked ``ffn_{gate,up,down}_exps`` from transformers' ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I]; ``state`` takes the stored values."""
    import gguf
    gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
    size = gate_up.shape[1] // 2
    stored = []
    for name, stack, kind in (("gate", gate_up[:, :size], kinds[0]), ("up", gate_up[:, size:], kinds[1]),
                              ("down", down, kinds[2])):
        encoded = [_encoded(np.ascontiguousarray(expert.numpy()), kind, next(seeds)) for expert in stack]
        writer.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", np.stack([raw for raw, _ in encoded]),
                          raw_dtype=gguf.GGMLQuantizationType[kind])
        stored.append(torch.from_numpy(np.stack([values for _, values in encoded])))
    state[f"{prefix}.gate_up_proj"] = torch.cat(stored[:2], dim=1)
    state[f"{prefix}.down_proj"] = stored[2]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(arch, the GGUF file, the transformers reference on its dequantized weights)."""
    arch = request.param
    model = _moe_model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    state = write_moe_gguf(path, model, arch)
    model.load_state_dict(state)
    return arch, path, model


def test_config_from_the_moe_metadata(moe_gguf: tuple[str, Path, Any]) -> None:
    arch, path, reference = moe_gguf
    config, expected = GGUFFile.open(path).hf_config(), reference.config
    assert config.model_type == expected.model_type
    for field in ("num_experts_per_tok", "hidden_size", "num_hidden_layers", "intermediate_size", "head_dim"):
        assert getattr(config, field) == getattr(expected, field), field
    if arch == "qwen3_moe":
        assert (config.num_experts, config.moe_intermediate_size) == (expected.num_experts, EXPERT_FFN)
        assert config.norm_topk_prob and config.mlp_only_layers == expected.mlp_only_layers == [1]
    else:
        assert config.num_local_experts == expected.num_local_experts


def _runner_and_prompts(arch: str, path: Path, quantization: str) -> tuple[Any, list[list[int]]]:
    runner = make_quant_runner(path, dtype="auto" if quantization == "auto" else "float32",
                               quantization=quantization)
    return runner, prompts_for(arch, runner.vocab_size)


def test_dequantized_moe_gguf_matches_transformers(moe_gguf: tuple[str, Path, Any]) -> None:
    arch, path, reference = moe_gguf
    runner, prompts = _runner_and_prompts(arch, path, "none")
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert greedy == expected_greedy


def test_moe_gguf_experts_run_in_their_blocks(moe_gguf: tuple[str, Path, Any]) -> None:
    """Served in the file's blocks: every expert's gate_up and down are block linears of the file's
    types (no float expert weight left), and the logits stay within the activation rounding of the
    dequantized reference's, greedy tokens equal."""
    arch, path, reference = moe_gguf
    runner, prompts = _runner_and_prompts(arch, path, "auto")
    assert runner.quantization == "gguf"
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gate_up_proj is None and m.down_proj is None for m in moes)
    gate, up, down = EXPERT_TYPES[arch]
    for moe in moes:
        assert moe.expert_layers is not None
        kinds = {(layers.gate_up_proj.gguf_weight.kind, layers.down_proj.gguf_weight.kind)
                 for layers in moe.expert_layers}
        assert kinds == {(gate if gate == up else f"{gate}+{up}", down)}
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    assert (logits - expected_logits).norm() <= 2e-3 * expected_logits.norm()
    assert greedy == expected_greedy


def test_other_moe_ggufs_are_refused_by_name(tmp_path: Path) -> None:
    import gguf

    from servelm.model.gguf import GGUFError
    path = tmp_path / "qwen2moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'qwen2moe' with experts.*Mixtral and Qwen3-MoE GGUFs do"):
        GGUFFile.open(path)
