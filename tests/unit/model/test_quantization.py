"""W8A8 int8 quantization: the quantized linear's error bound and a quantized tiny model's outputs."""

from __future__ import annotations

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.layers.linear import RowParallelLinear
from servelm.model.layers.quantization import (Int8DynamicLinearMethod, quantize_model,
                                               quantize_weight_per_channel)
from servelm.model.runner import ModelRunner
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import BLOCK_SIZE, POOL_TOKENS, make_source


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_per_channel_weights_round_trip_within_half_a_step() -> None:
    weight = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]   # very different row ranges
    quantized, scale = quantize_weight_per_channel(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (64,)
    assert quantized.abs().max() == 127
    error = (quantized.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("use_fbgemm", [True, False], ids=["fbgemm", "int_mm_per_token"])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_quantized_linear_error_bound(use_fbgemm: bool, rows: int) -> None:
    if use_fbgemm and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm")
    torch.manual_seed(0)
    layer = RowParallelLinear(96, 80, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.1)
    x = torch.randn(rows, 96)
    expected = layer(x)
    Int8DynamicLinearMethod(use_fbgemm=use_fbgemm).process(layer)
    assert layer.weight is None
    actual = layer(x)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert relative_error(actual, expected) < 0.04
    assert torch.equal(layer(x), actual)   # deterministic


def test_tied_head_keeps_exact_embedding() -> None:
    embedding = VocabEmbedding(200, 32)
    embedding.weight.data.normal_()
    head = LMHead(200, 32, tied_to=embedding)
    hidden = torch.randn(3, 32)
    expected = head(hidden)
    original = embedding.weight.detach().clone()
    Int8DynamicLinearMethod().process(head, keep_weight=True)
    assert torch.equal(embedding.weight, original)   # the lookup stays float32
    assert relative_error(head(hidden), expected) < 0.04


def make_runner(source: object, quantization: str) -> ModelRunner:
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32",
                                            quantization=quantization),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS))
    return ModelRunner(config, source)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_quantized_tiny_model_stays_close(arch: str) -> None:
    """Logits of the W8A8 model stay within a few percent of float32 and agree on the argmax
    wherever float32's top-2 margin is clear."""
    hf_model = make_tiny_hf_model(arch)
    with torch.no_grad():   # sharper distributions than the default init, so margins mean something
        for name, param in hf_model.named_parameters():
            if param.dim() == 2:
                param.mul_(2.0)
    source = make_source(hf_model)
    exact, quantized = make_runner(source, "none"), make_runner(source, "w8a8_int8")
    assert quantize_model(quantized.model, "none") == 0
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and "embed" not in n
                   for n, p in quantized.model.named_parameters())
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, exact.vocab_size, (24,), generator=generator).tolist()
    plan = BatchPlan([SequencePlan(tokens, 0, list(range(24 // BLOCK_SIZE)), num_logits=24)])
    expected, actual = exact.execute(plan), quantized.execute(plan)
    assert relative_error(actual, expected) < 0.1
    top2 = expected.topk(2, dim=-1).values
    # without VNNI fbgemm takes 7-bit activations (reduce_range: vpmaddubsw's int16 sums would
    # saturate), twice the rounding step, so a margin must be twice as wide to be clear
    from servelm.model.layers import quantization
    margin = 0.2 if quantization._REDUCE_RANGE else 0.1
    clear = (top2[:, 0] - top2[:, 1]) > margin * expected.std(dim=-1)
    assert clear.sum() >= 4
    assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("kv_dtype", ["fp8_e5m2", "fp8_e4m3"])
def test_fp8_kv_cache_one_byte_per_element_and_close(kv_dtype: str) -> None:
    hf_model = make_tiny_hf_model("gemma3")
    source = make_source(hf_model)
    exact = make_runner(source, "none")
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS,
                                            kv_cache_dtype=kv_dtype))
    fp8 = ModelRunner(config, source)  # type: ignore[arg-type]
    assert fp8.kv_cache.k_caches[0].element_size() == 1
    assert fp8.kv_cache_bytes * 4 == exact.kv_cache_bytes   # same tokens, a quarter of the bytes
    tokens = torch.randint(0, exact.vocab_size, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = list(range(8))
    prefill = BatchPlan([SequencePlan(tokens[:16], 0, blocks, num_logits=1)])
    decode = BatchPlan([SequencePlan(tokens[16:17], 16, blocks, num_logits=1)])
    for runner in (exact, fp8):
        runner.execute(prefill)
    expected, actual = exact.execute(decode), fp8.execute(decode)
    assert torch.isfinite(actual).all()
    assert relative_error(actual, expected) < 0.2   # e5m2 keeps 2 mantissa bits: ~12% per element


@pytest.mark.parametrize(("flags", "expected", "evidence"), [
    ({"avx512f", "amx_bf16", "avx512_bf16"}, torch.bfloat16, "AMX"),
    ({"avx512f", "avx512_vnni", "avx512_bf16"}, torch.bfloat16, "AVX512-BF16"),
    ({"avx512f", "avx512_vnni"}, torch.float32, "neither AMX nor AVX512-BF16"),
    (set(), torch.float32, "neither AMX nor AVX512-BF16"),
])
def test_auto_dtype_on_cpu_follows_its_bf16_features_and_says_why(
        flags: set[str], expected: torch.dtype, evidence: str) -> None:
    from servelm.model.loader import dtype_reason, resolve_dtype
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", None, cpu, flags) == expected
    assert evidence in dtype_reason("auto", cpu, flags)
    assert resolve_dtype("float32", None, cpu, flags) == torch.float32
    assert dtype_reason("float32", cpu, flags) == "--dtype float32"


def test_auto_dtype_reads_this_cpu() -> None:
    from servelm.model.loader import cpu_flags, resolve_dtype
    native_bf16 = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert resolve_dtype("auto", None, torch.device("cpu")) == expected
