"""Pre-quantized checkpoints (servelm/model/prequantized.py): detection, the flag's agreement, exact
dequantization and parity with the reference in float32, the block routes, TP=2.

GPTQ and AWQ checkpoints are written by tests/prequantized_checkpoints.py to the formats' published
layouts (their libraries need CUDA builds; transformers loads neither format without them), and the
reference is the formats' documented dequantization of the codes the writer chose, loaded into the
transformers model. FP8 block-wise checkpoints are read by transformers itself (its FP8 loader
dequantizes on CPU) as the reference. compressed-tensors checkpoints are made by the
compressed-tensors library where it is installed (``quant-test`` extra), and in the published layout
otherwise; tests/fixtures/llmc holds small checkpoints written by llm-compressor's own ``oneshot``, its
reference logits beside them, so the default run checks that layout without llm-compressor installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model import prequantized
from servelm.model.forward_batch import BatchPlan
from servelm.model.prequantized import UnsupportedQuantization, detect, resolve, unpack_dense
from servelm.model.runner import ModelRunner
from servelm.model.source import resolve_model_source
from tests.prequantized_checkpoints import (make_quant_hf_model, pack_along_cols, pack_along_rows, pack_dense_bits,
                                            reference_model, write_awq, write_ct_pack_quantized, write_ct_with_library,
                                            write_fp8, write_gptq)

from .conftest import BLOCK_SIZE, POOL_TOKENS, BlockAllocator, prompts_for

NUM_NEW_TOKENS = 12


def quant_config(**fields: Any) -> Any:
    return type("Config", (), {"quantization_config": fields})()


def make_quant_runner(path: Path, dtype: str = "float32", quantization: str = "auto",
                      parallel: Any = None) -> ModelRunner:
    model_config = ModelConfig(model=str(path), device="cpu", dtype=dtype, quantization=quantization)
    config = EngineConfig(model=model_config, cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS))
    return ModelRunner(config, resolve_model_source(model_config), parallel=parallel)


def logits_and_greedy(runner: ModelRunner, prompts: list[list[int]],
                      allocator: Any = None) -> tuple[torch.Tensor, list[list[int]]]:
    """The prompts' logits and NUM_NEW_TOKENS greedy tokens each (``allocator``: whose ``plan``
    gives each sequence its blocks; a shuffled pool by default)."""
    allocator = allocator or BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
    plan = BatchPlan([allocator.plan(i, p, num_logits=len(p)) for i, p in enumerate(prompts)])
    logits = runner.execute(plan)
    outputs: list[list[int]] = []
    starts = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outputs = [[token] for token in logits[starts].argmax(-1).tolist()]
    for _ in range(NUM_NEW_TOKENS - 1):
        plan = BatchPlan([allocator.plan(i, out[-1:], num_logits=1) for i, out in enumerate(outputs)])
        for out, token in zip(outputs, runner.execute(plan).argmax(-1).tolist()):
            out.append(token)
    return logits, outputs


def reference_logits_and_greedy(model: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p])).logits[0].float() for p in prompts])
        outputs = [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return logits, outputs


def assert_parity(runner: ModelRunner, reference: Any, arch: str) -> None:
    prompts = prompts_for(arch, runner.vocab_size)
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert greedy == expected_greedy


# --- detection and the flag -------------------------------------------------------------------------

def test_detect_reads_each_format() -> None:
    gptq = detect(quant_config(quant_method="gptq", bits=4, group_size=128, desc_act=True, sym=False))
    assert gptq is not None and (gptq.method, gptq.bits, gptq.group, gptq.desc_act, gptq.zero_plus_one) == \
        ("gptq", 4, 128, True, True)
    assert not detect(quant_config(quant_method="gptq", bits=8, group_size=-1,
                                   checkpoint_format="gptq_v2")).zero_plus_one  # type: ignore[union-attr]
    awq = detect(quant_config(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"))
    assert awq is not None and (awq.method, awq.group) == ("awq", 128)
    fp8 = detect(quant_config(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                              weight_block_size=[128, 128]))
    assert fp8 is not None and fp8.fp8_block == (128, 128) and not fp8.integer
    assert detect(type("Config", (), {})()) is None


@pytest.mark.parametrize(("fields", "named"), [
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3-bit"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
     "quant storage 'bfloat16'"),
    ({"quant_method": "bitsandbytes"}, "neither load_in_4bit nor load_in_8bit"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}}}, "'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_unsupported_schemes_are_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedQuantization, match=named.replace("(", r"\(").replace(")", r"\)")):
        detect(quant_config(**fields))


def test_the_flag_must_agree_with_the_checkpoint() -> None:
    gptq = detect(quant_config(quant_method="gptq", bits=4, group_size=32))
    assert resolve("auto", gptq)[0] == "gptq"
    assert resolve("gptq", gptq)[0] == "gptq"
    assert resolve("gptq_marlin", gptq)[0] == "gptq"
    assert "dequantized exactly" in resolve("none", gptq)[1]
    with pytest.raises(ValueError, match="--quantization awq disagrees with the checkpoint's quantization_config "
                                         r"\(quant_method 'gptq'"):
        resolve("awq", gptq)
    with pytest.raises(ValueError, match="--quantization int8wo disagrees"):
        resolve("int8wo", gptq)
    with pytest.raises(ValueError, match="--quantization fp8 loads a pre-quantized checkpoint .* this model has none"):
        resolve("fp8", None)
    assert resolve("int4wo-32", None) == ("int4wo-32", "")


def test_refused_flag_values_fail_at_start_up() -> None:
    with pytest.raises(ValueError, match="--quantization hqq is not supported: HQQ"):
        EngineConfig(model=ModelConfig(quantization="hqq"))



def test_load_format_bitsandbytes_needs_a_bitsandbytes_checkpoint() -> None:
    nf4 = detect(quant_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True))
    assert nf4 is not None and (nf4.method, nf4.bits, nf4.description) == ("bitsandbytes", 4,
                                                                            "bitsandbytes nf4, double quant")
    assert resolve("bitsandbytes", nf4, "bitsandbytes")[0] == "bitsandbytes"
    assert resolve("auto", nf4, "bitsandbytes")[0] == "bitsandbytes"
    with pytest.raises(ValueError, match="--load-format bitsandbytes loads a bitsandbytes checkpoint .* this "
                                         "model has none .*does not quantize with bitsandbytes at load"):
        resolve("auto", None, "bitsandbytes")
    with pytest.raises(ValueError, match="this model has GPTQ int4"):
        resolve("auto", detect(quant_config(quant_method="gptq", bits=4, group_size=32)), "bitsandbytes")
    with pytest.raises(ValueError, match="--quantization bitsandbytes loads a pre-quantized checkpoint"):
        resolve("bitsandbytes", None)


# --- bit unpacking -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_unpack_dense_reads_the_published_packings(bits: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (6, 64), generator=generator)
    torch.testing.assert_close(unpack_dense(pack_dense_bits(codes, bits), bits, 64, dim=1), codes.to(torch.int32))
    if 32 % bits == 0:
        torch.testing.assert_close(unpack_dense(pack_along_rows(codes.t(), bits), bits, 64, dim=0).t(),
                                   codes.to(torch.int32))
        torch.testing.assert_close(unpack_dense(pack_along_cols(codes, bits), bits, 64, dim=1), codes.to(torch.int32))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_unpack_dense_matches_compressed_tensors(bits: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    generator = torch.Generator().manual_seed(bits)
    signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (5, 40), generator=generator).to(torch.int8)
    for dim in (0, 1):
        packed = helpers.pack_to_int32(signed, bits, packed_dim=dim)
        count = signed.shape[dim]
        ours = unpack_dense(packed, bits, count, dim=dim) - 2 ** (bits - 1)
        torch.testing.assert_close(ours.to(torch.int8), signed)


# --- GPTQ and AWQ parity ---------------------------------------------------------------------------

SLOW = pytest.mark.slow   # each case ~3 s on 2 Zen 3 cores: the default run keeps one or two per format
GPTQ_CASES = [
    # arch, bits, group, sym, desc_act, v2
    pytest.param("llama", 4, 32, True, False, False, marks=SLOW),
    ("qwen2", 4, 32, False, False, False),
    pytest.param("qwen2", 4, -1, True, False, False, marks=SLOW),
    pytest.param("llama", 8, 32, False, False, False, marks=SLOW),
    pytest.param("llama", 8, 64, True, False, True, marks=SLOW),
    pytest.param("qwen2", 4, 32, True, True, False, marks=SLOW),
    ("llama", 4, 32, False, True, True),
]


@pytest.mark.parametrize(("arch", "bits", "group", "sym", "desc_act", "v2"), GPTQ_CASES)
def test_gptq_logits_and_greedy_match_the_dequantized_reference(tmp_path: Path, arch: str, bits: int, group: int,
                                                                sym: bool, desc_act: bool, v2: bool) -> None:
    model = make_quant_hf_model(arch)
    reference = reference_model(model, write_gptq(tmp_path / "gptq", model, bits, group, sym, desc_act, v2))
    runner = make_quant_runner(tmp_path / "gptq")
    assert runner.quantization == "gptq"
    assert_parity(runner, reference, arch)


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=SLOW)])
def test_awq_group_128_logits_and_greedy_match_the_dequantized_reference(tmp_path: Path, arch: str) -> None:
    model = make_quant_hf_model(arch, hidden=128, intermediate=256)
    reference = reference_model(model, write_awq(tmp_path / "awq", model, group=128))
    runner = make_quant_runner(tmp_path / "awq")
    assert runner.quantization == "awq"
    assert_parity(runner, reference, arch)


def test_awq_column_order_matters(tmp_path: Path) -> None:
    """Reading AWQ's packed columns in plain order (no 0 2 4 6 1 3 5 7 interleave) gives other weights:
    the parity above can fail."""
    model = make_quant_hf_model("llama", hidden=128, intermediate=256)
    reference = write_awq(tmp_path / "awq", model)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "awq" / "model.safetensors"), framework="pt") as f:
        parts = {leaf: f.get_tensor(f"model.layers.0.mlp.up_proj.{leaf}") for leaf in ("qweight", "qzeros", "scales")}
    spec = detect(quant_config(quant_method="awq", bits=4, group_size=128))
    assert spec is not None
    weight, block = prequantized._awq(parts, spec, "up")
    assert torch.equal(weight, reference["model.layers.0.mlp.up_proj"])
    plain = (unpack_dense(parts["qweight"], 4, 256, 1) - unpack_dense(parts["qzeros"], 4, 256, 1)
             .repeat_interleave(128, 0)).float() * parts["scales"].float().repeat_interleave(128, 0)
    assert not torch.equal(plain.t(), weight)


@pytest.mark.parametrize("kind", [pytest.param("gptq", marks=SLOW), pytest.param("gptq-desc-act", marks=SLOW), "awq"])
def test_tensor_parallel_2_matches_tp1(tmp_path: Path, kind: str) -> None:
    """At --tp-size 2 each rank loads its shard of the exactly dequantized weights, so a shard need not
    split on a group boundary: GPTQ group 32 (o_proj's 64 inputs split into 32 per rank: on a
    boundary), desc_act (groups scattered over the inputs: no boundary to split on) and AWQ group 128
    (128 inputs split into 64: inside a group) all give the TP=1 logits."""
    from tests.unit.distributed.test_parallel import run_ranks

    if kind == "awq":
        write_awq(tmp_path / "ckpt", make_quant_hf_model("qwen2", hidden=128, intermediate=256), group=128)
    else:
        write_gptq(tmp_path / "ckpt", make_quant_hf_model("qwen2"), 4, 32, sym=False, desc_act=kind != "gptq")
    prompts = prompts_for("qwen2", 320)
    plan = lambda: BatchPlan([BlockAllocator(64).plan(i, p, num_logits=len(p))  # noqa: E731
                              for i, p in enumerate(prompts)])

    def work(parallel: Any) -> torch.Tensor:
        return make_quant_runner(tmp_path / "ckpt", parallel=parallel).execute(plan())

    expected = work(None)
    for logits in run_ranks(2, work):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# --- block routes ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("desc_act", "shared_order"), [pytest.param(False, True, marks=SLOW), (True, True),
                                                         pytest.param(True, False, marks=SLOW)])
def test_gptq_codes_run_on_the_block_routes(tmp_path: Path, desc_act: bool, shared_order: bool,
                                            float32_rest: None) -> None:
    """--dtype auto at tp 1: the integer codes replace the float weights (checked equal to them) and
    the GGUF block kernel runs them; the logits stay within its 16-bit activation rounding of the
    float32 reference. desc_act: the inputs sorted by group (a permuted input); a fused layer whose
    shards have different orders keeps its float weight."""
    from servelm.model.gguf.gguf_kernel import load_kernel
    from servelm.model.prequantized import PermutedInputMethod
    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    model = make_quant_hf_model("llama")
    reference = reference_model(model, write_gptq(tmp_path / "gptq", model, 4, 32, sym=False, desc_act=desc_act,
                                                  shared_order=shared_order))
    runner = make_quant_runner(tmp_path / "gptq", dtype="auto")
    served = {name: module for name, module in runner.model.named_modules() if hasattr(module, "gguf_weight")}
    leaves = ("self_attn.o_proj", "mlp.down_proj") + (("self_attn.qkv_proj", "mlp.gate_up_proj")
                                                      if shared_order else ())
    assert sorted(served) == sorted(f"model.layers.{i}.{leaf}" for i in range(2) for leaf in leaves)
    assert all(module.gguf_weight.block == 32 and module.gguf_weight.offsets is None for module in served.values())
    assert all(isinstance(module.linear_method, PermutedInputMethod) == desc_act for module in served.values())
    prompts = prompts_for("llama", runner.vocab_size)
    logits, _ = logits_and_greedy(runner, prompts)
    expected, _ = reference_logits_and_greedy(reference, prompts)
    assert (logits - expected).norm() <= 1e-3 * expected.norm()


# --- FP8 -------------------------------------------------------------------------------------------

def test_fp8_block_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """transformers loads the FP8 checkpoint itself (dequantized on CPU): the reference."""
    pytest.importorskip("accelerate")
    from tests.reference import load_reference_model
    model = make_quant_hf_model("qwen2", hidden=256, intermediate=512)
    write_fp8(tmp_path / "fp8", model, (128, 128))
    reference = load_reference_model(tmp_path / "fp8")
    runner = make_quant_runner(tmp_path / "fp8")
    assert runner.quantization == "fp8"
    assert_parity(runner, reference, "qwen2")


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_matches_its_documented_dequantization(tmp_path: Path, block: tuple[int, int] | None) -> None:
    """Per-tensor ``weight_scale`` and blocks that do not divide the weight (96 x 192 in 128x128
    blocks: DeepSeek's ceil-sized grid)."""
    model = make_quant_hf_model("llama", hidden=192, intermediate=320)
    reference = reference_model(model, write_fp8(tmp_path / "fp8", model, block))
    assert_parity(make_quant_runner(tmp_path / "fp8"), reference, "llama")


# --- compressed-tensors ------------------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "bits", "sym"), [pytest.param("llama", 4, True, marks=SLOW), ("qwen2", 4, False),
                                                   pytest.param("llama", 8, False, marks=SLOW)])
def test_compressed_tensors_pack_quantized_layout(tmp_path: Path, arch: str, bits: int, sym: bool) -> None:
    model = make_quant_hf_model(arch)
    reference = reference_model(model, write_ct_pack_quantized(tmp_path / "ct", model, bits, 32, sym))
    runner = make_quant_runner(tmp_path / "ct")
    assert runner.quantization == "compressed-tensors"
    assert_parity(runner, reference, arch)


def ct_reference(path: Path) -> Any:
    """transformers' loading of the checkpoint through compressed-tensors, decompressed (run_compressed
    False): the library's own dequantized model, in float32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    return model.eval()


CT_LIBRARY_CASES = [
    pytest.param("llama", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
                 "pack-quantized", None, marks=SLOW),
    ("qwen2", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
     "pack-quantized", None),
    pytest.param("llama", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "int-quantized",
                 {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}, marks=SLOW),
    ("qwen2", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "float-quantized",
     {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
    pytest.param("llama", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
                 "float-quantized", None, marks=SLOW),
]


@pytest.mark.parametrize(("arch", "weights", "fmt", "activations"), CT_LIBRARY_CASES)
def test_compressed_tensors_made_by_the_library(tmp_path: Path, arch: str, weights: dict[str, Any], fmt: str,
                                                activations: dict[str, Any] | None) -> None:
    """W4A16 (sym and asym), W8A8 int8 and FP8 (per channel, per tensor): servelm's logits equal the
    library's decompressed model's (activations unquantized on both sides: the reference in
    float32 is the dequantized model)."""
    pytest.importorskip("compressed_tensors")
    model = make_quant_hf_model(arch)
    write_ct_with_library(tmp_path / "ct", model, weights, fmt, activations)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys() if ".layers.0.mlp.up_proj." in name}
    expected_dtype = {"pack-quantized": torch.int32, "int-quantized": torch.int8,
                      "float-quantized": torch.float8_e4m3fn}[fmt]
    assert any(tensor.dtype == expected_dtype for tensor in stored.values()), stored.keys()
    reference = ct_reference(tmp_path / "ct")
    # the reference holds the quantized weights, not the float ones they came from
    assert not torch.equal(reference.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    runner = make_quant_runner(tmp_path / "ct")
    assert runner.quantization == "compressed-tensors"
    assert_parity(runner, reference, arch)


LLMC_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llmc"
"""Checkpoints written by llm-compressor's own ``oneshot`` (scripts/make_llmc_fixtures.py, in a venv
of its own: its wheel pins an older transformers), each with the library's reference beside it."""


@pytest.mark.parametrize("name", sorted(path.name for path in LLMC_FIXTURES.iterdir()))
def test_checkpoints_written_by_llm_compressor_match_its_reference(name: str) -> None:
    """W8A8 int8, W4A16 (round-to-nearest and GPTQ, group 128, pack-quantized) and FP8_DYNAMIC, as
    llm-compressor saved them (bfloat16 model, its tensor names, dtypes and config): servelm's
    logits in float32 equal those of transformers + compressed-tensors' decompressed model (saved
    by the script, activation quantization off on both sides), and so do the greedy tokens."""
    from safetensors.torch import load_file

    path = LLMC_FIXTURES / name
    meta = json.loads((path / "reference.json").read_text())
    expected = load_file(str(path / "reference.safetensors"))
    runner = make_quant_runner(path / "checkpoint")
    assert runner.quantization == "compressed-tensors"
    logits, greedy = logits_and_greedy(runner, meta["prompts"])
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=1e-4)
    assert greedy == expected["greedy"].tolist()


# --- bitsandbytes ------------------------------------------------------------------------------------

BNB_CASES = [("llama", "int8", False), ("qwen2", "nf4", True), pytest.param("llama", "fp4", False, marks=SLOW),
             pytest.param("qwen2", "fp4", True, marks=SLOW), pytest.param("llama", "nf4", False, marks=SLOW)]


@pytest.mark.parametrize(("arch", "kind", "double_quant"), BNB_CASES)
def test_bitsandbytes_made_by_the_library(tmp_path: Path, arch: str, kind: str, double_quant: bool) -> None:
    """LLM.int8 (``SCB``) and 4-bit nf4/fp4 (``quant_state``, with and without double quant)
    checkpoints saved by transformers + bitsandbytes (its CPU backend): servelm's logits and greedy
    tokens equal the library's dequantized model's in float32."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    from tests.prequantized_checkpoints import bitsandbytes_reference, write_bitsandbytes
    model = make_quant_hf_model(arch)
    write_bitsandbytes(tmp_path / "bnb", model, kind, double_quant)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "bnb" / "model.safetensors"), framework="pt") as f:
        names = [name.removeprefix("model.layers.0.mlp.up_proj.") for name in f.keys()
                 if name.startswith("model.layers.0.mlp.up_proj.")]
    expected_parts = {"weight", "SCB"} if kind == "int8" else (
        {"weight", "weight.absmax", "weight.quant_map", f"weight.quant_state.bitsandbytes__{kind}"}
        | ({"weight.nested_absmax", "weight.nested_quant_map"} if double_quant else set()))
    assert expected_parts <= set(names), names
    reference = bitsandbytes_reference(tmp_path / "bnb")
    assert not torch.equal(reference.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    runner = make_quant_runner(tmp_path / "bnb")
    assert runner.quantization == "bitsandbytes"
    assert_parity(runner, reference, arch)


@pytest.mark.slow   # 8 s on 2 loaded Zen 3 cores; the GPTQ block-route test covers the route
def test_bitsandbytes_int8_codes_run_on_the_block_routes(tmp_path: Path) -> None:
    """--dtype auto at tp 1: LLM.int8's row-wise codes are one group per row, split to 32-input blocks
    for the GGUF block kernel; the logits stay within its 16-bit activation rounding."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    from servelm.model.gguf.gguf_kernel import load_kernel
    from tests.prequantized_checkpoints import bitsandbytes_reference, write_bitsandbytes
    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    write_bitsandbytes(tmp_path / "bnb", make_quant_hf_model("llama"), "int8")
    runner = make_quant_runner(tmp_path / "bnb", dtype="auto", quantization="bitsandbytes")
    served = [name for name, module in runner.model.named_modules() if hasattr(module, "gguf_weight")]
    assert len(served) == 8   # qkv, o, gate_up, down in 2 layers
    prompts = prompts_for("llama", runner.vocab_size)
    logits, _ = logits_and_greedy(runner, prompts)
    expected, _ = reference_logits_and_greedy(bitsandbytes_reference(tmp_path / "bnb"), prompts)
    assert (logits - expected).norm() <= 1e-3 * expected.norm()


@pytest.mark.slow   # 22 s on 2 Zen 3 cores (the engine's start-up)
def test_engine_serves_a_gptq_checkpoint_with_prefix_caching(tmp_path: Path) -> None:
    """The whole engine on a desc_act GPTQ directory: requests sharing a prefix (the second wave hits
    the prefix cache) generate the dequantized reference's greedy tokens."""
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams
    from tests.engine_drive import greedy

    model = make_quant_hf_model("qwen2")
    reference = reference_model(model, write_gptq(tmp_path / "gptq", model, 4, 32, sym=False, desc_act=True))
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "gptq"), skip_tokenizer_init=True, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=512, page_size=BLOCK_SIZE))
    engine = LLMEngine(config)
    try:
        prefix = list(range(20, 40))
        prompts = [prefix + [7, 8], prefix + [9], prefix + [11, 12, 13]]
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        first = greedy(engine, prompts[:1], params)
        rest = greedy(engine, prompts[1:], params)
    finally:
        engine.shutdown()
    _, expected = reference_logits_and_greedy(reference, prompts)
    assert first + rest == expected


# --- with LoRA and speculative decoding --------------------------------------------------------------

def quant_engine(path: Path, **sections: Any) -> Any:
    from servelm.engine.engine import LLMEngine
    config = EngineConfig(model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=512, page_size=BLOCK_SIZE), **sections)
    return LLMEngine(config)


LORA_PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9], [30, 31, 32, 33, 34, 35]]


@pytest.mark.slow   # 23 s on 2 loaded Zen 3 cores (an engine and peft)
def test_lora_adapter_on_a_gptq_base_equals_peft_on_the_dequantized_model(tmp_path: Path) -> None:
    """A PEFT adapter over a desc_act GPTQ base: the engine's greedy tokens with and without it equal
    transformers + peft on the dequantized reference (float32)."""
    import copy

    from servelm.config import LoRAConfig
    from servelm.sampling.params import SamplingParams
    from tests.engine_drive import drain
    peft = pytest.importorskip("peft")
    model = make_quant_hf_model("llama")
    reference = reference_model(model, write_gptq(tmp_path / "gptq", model, 4, 32, sym=False, desc_act=True))
    torch.manual_seed(3)
    adapted = peft.get_peft_model(copy.deepcopy(reference), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    engine = quant_engine(tmp_path / "gptq", lora=LoRAConfig(lora_paths=[f"a={tmp_path / 'adapter'}"]))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        for index, prompt in enumerate(LORA_PROMPTS):
            engine.add_request(f"base{index}", prompt, params)
            engine.add_request(f"lora{index}", prompt, params, lora_name="a")
        outputs = drain(engine)
    finally:
        engine.shutdown()
    for index, prompt in enumerate(LORA_PROMPTS):
        for name, hf_model in (("base", reference), ("lora", adapted)):
            with torch.no_grad():
                expected = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                             do_sample=False, eos_token_id=None, pad_token_id=0,
                                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            assert outputs[f"{name}{index}"] == expected[0, len(prompt):].tolist(), (name, index)
    assert outputs["base0"] != outputs["lora0"]


@pytest.mark.slow   # two engines
def test_a_gptq_draft_speculates_for_its_float_target(tmp_path: Path) -> None:
    """STANDALONE speculative decoding with a GPTQ int8 copy of the target as the draft: greedy
    output identical to plain decoding, and the quantized draft's proposals mostly accepted."""
    from servelm.config import SpeculativeConfig
    from servelm.sampling.params import SamplingParams
    from tests.engine_drive import greedy
    model = make_quant_hf_model("qwen2")
    model.save_pretrained(tmp_path / "target")
    write_gptq(tmp_path / "draft", model, 8, 32, sym=True)
    params = SamplingParams(temperature=0.0, max_tokens=2 * NUM_NEW_TOKENS + 1, ignore_eos=True)
    outputs, stats = [], []
    for draft in (None, tmp_path / "draft"):
        engine = quant_engine(tmp_path / "target", speculative=SpeculativeConfig(
            speculative_draft_model_path=None if draft is None else str(draft), num_speculative_tokens=4))
        try:
            outputs.append(greedy(engine, LORA_PROMPTS, params))
            stats.append(engine.stats())
        finally:
            engine.shutdown()
    assert outputs[1] == outputs[0]
    assert stats[1]["spec_acceptance_rate"] > 0.5, stats[1]
