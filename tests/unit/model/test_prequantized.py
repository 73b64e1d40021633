"""Pre-quantized checkpoints (servelm/model/prequantized.py): detection, the flag's agreement, exact
dequantization and parity with the reference in float32, the block routes, TP=2.

GPTQ and AWQ checkpoints are written by tests/prequantized_checkpoints.py to the formats' published
layouts (their libraries need CUDA builds; transformers loads neither format without them), and the
reference is the formats' documented dequantization of the codes the writer chose, loaded into the
transformers model. FP8 block-wise checkpoints are read by transformers itself (its FP8 loader
dequantizes on CPU) as the reference. compressed-tensors checkpoints are made by the
compressed-tensors library where it is installed (``quant-test`` extra), and in the published layout
otherwise.
"""

from __future__ import annotations

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
                                            reference_model, write_awq, write_ct_pack_quantized, write_fp8,
                                            write_gptq)

from .conftest import BLOCK_SIZE, POOL_TOKENS, BlockAllocator, prompts_for

NUM_NEW_TOKENS = 12


def quant_config(**fields: Any) -> Any:
    return type("Config", (), {"quantization_config": fields})()


def make_quant_runner(path: Path, dtype: str = "float32", quantization: str = "auto",
                      parallel: Any = None) -> ModelRunner:
    model_config = ModelConfig(model=str(path), device="cpu", dtype=dtype, quantization=quantization)
    config = EngineConfig(model=model_config, cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS))
    return ModelRunner(config, resolve_model_source(model_config), parallel=parallel)


def logits_and_greedy(runner: ModelRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    allocator = BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
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
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes' (nf4)"),
    ({"load_in_8bit": True}, "'bitsandbytes' (int8)"),
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
    with pytest.raises(ValueError, match="--load-format bitsandbytes is not supported yet"):
        EngineConfig(model=ModelConfig(load_format="bitsandbytes"))


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


def test_gptq_tensor_parallel_2_matches_tp1(tmp_path: Path) -> None:
    """At --tp-size 2 each rank loads its shard of the exactly dequantized weights (group 32 of
    input 64/128: row-parallel shards split on group boundaries, but the float weights split anywhere)."""
    from tests.unit.distributed.test_parallel import run_ranks

    model = make_quant_hf_model("qwen2")
    write_gptq(tmp_path / "gptq", model, 4, 32, sym=False)
    prompts = prompts_for("qwen2", 320)
    plan = lambda: BatchPlan([BlockAllocator(64).plan(i, p, num_logits=len(p))  # noqa: E731
                              for i, p in enumerate(prompts)])

    def work(parallel: Any) -> torch.Tensor:
        return make_quant_runner(tmp_path / "gptq", parallel=parallel).execute(plan())

    expected = work(None)
    for logits in run_ranks(2, work):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# --- block routes ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("desc_act", "shared_order"), [pytest.param(False, True, marks=SLOW), (True, True),
                                                         pytest.param(True, False, marks=SLOW)])
def test_gptq_codes_run_on_the_block_routes(tmp_path: Path, desc_act: bool, shared_order: bool) -> None:
    """--dtype auto at tp 1: the integer codes replace the float weights (checked equal to them) and
    the GGUF block kernel runs them; the logits stay within its 16-bit activation rounding of the
    float32 reference. desc_act: the inputs sorted by group (a permuted input); a fused layer whose
    shards have different orders keeps its float weight."""
    from servelm.model.layers.gguf_kernel import load_kernel
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


def write_ct_with_library(path: Path, model: Any, weights: dict[str, Any], fmt: str,
                          activations: dict[str, Any] | None = None) -> None:
    """A compressed-tensors checkpoint made by the library itself: its quantization config applied to
    the model, min/max scales from its own ``calculate_qparams`` (llm-compressor's minmax observer
    without calibration data), compressed by its ``ModelCompressor`` and saved with its config."""
    import copy
    import json

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import save_file

    model = copy.deepcopy(model)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            module_scheme = getattr(module, "quantization_scheme", None)
            if module_scheme is None or module_scheme.weights is None:
                continue
            args, weight = module_scheme.weights, module.weight
            if args.strategy == "group":
                grouped = weight.unflatten(-1, (weight.shape[1] // args.group_size, args.group_size))
                low, high = grouped.amin(-1), grouped.amax(-1)
            elif args.strategy == "channel":
                low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
            else:
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if activations and hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    config_json = json.loads((path / "config.json").read_text())
    config_json.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config_json))
    compressor.update_config(str(path))
    tied = model.config.tie_word_embeddings
    save_file({name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}, str(path / "model.safetensors"))


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
