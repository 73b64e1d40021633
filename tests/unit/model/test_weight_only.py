"""Weight-only int8 / int4 quantization: the math, each method against a float reference, the
embedding rows, quantize_model's bookkeeping, and a tiny model served under every mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.engine.engine import LLMEngine
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers import weight_only
from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.layers.linear import RowParallelLinear
from servelm.model.layers.quantization import QUANTIZATION_METHODS, quantize_model
from servelm.model.layers.weight_only import (Int4Rows, Int4WeightOnlyLinearMethod, Int8Rows,
                                              Int8WeightOnlyLinearMethod, dequantize_int4, pack_nibbles,
                                              quantize_int4_groupwise)
from servelm.model.runner import ModelRunner
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import BLOCK_SIZE, POOL_TOKENS, make_source


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_int4_groups_round_trip_within_half_a_step() -> None:
    weight = torch.randn(48, 128) * torch.linspace(0.01, 3.0, 48)[:, None] + 0.5   # skewed, uneven rows
    codes, scale, zero = quantize_int4_groupwise(weight, 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) == 15 and int(codes.min()) == 0
    assert scale.shape == zero.shape == (48, 4)
    nibbles = pack_nibbles(codes)
    assert nibbles.shape == (48, 64)
    restored = dequantize_int4(nibbles, scale, zero)
    step = scale.repeat_interleave(32, dim=1)
    assert ((restored - weight).abs() <= step / 2 + 1e-5).all()
    # the group's min and max are codes 0 and 15 exactly
    grouped = weight.reshape(48, 4, 32)
    assert torch.allclose(restored.reshape(48, 4, 32).amin(-1), grouped.amin(-1), atol=1e-5)


def make_layer(out_features: int, in_features: int, bias: bool = True) -> RowParallelLinear:
    torch.manual_seed(0)
    layer = RowParallelLinear(in_features, out_features, bias=bias)
    layer.weight.data.normal_(0, 0.05)
    if bias:
        layer.bias.data.normal_(0, 0.1)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_weight_only_linear(rows: int) -> None:
    layer = make_layer(96, 128)
    x = torch.randn(2, rows, 128)
    expected = layer(x)
    dequantized = weight_only.dequantize_int8(*weight_only.quantize_int8_per_channel(layer.weight.data))
    exact = torch.nn.functional.linear(x, dequantized, layer.bias)
    Int8WeightOnlyLinearMethod().process(layer)
    assert layer.weight is None and layer.int8_weight.dtype == torch.int8
    actual = layer(x)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert relative_error(actual, exact) < 0.01        # only bf16 activation rounding on top
    assert relative_error(actual, expected) < 0.02     # int8 weights: ~1% here
    assert torch.equal(layer(x), actual)               # deterministic


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize(("out_features", "rows"), [(96, 1), (96, 9), (40, 5)])   # 40: no kernel
def test_int4_weight_only_linear(group: int, out_features: int, rows: int) -> None:
    layer = make_layer(out_features, 128)
    x = torch.randn(rows, 128)
    expected = layer(x)
    exact = torch.nn.functional.linear(x, dequantize_int4(
        *(lambda c, s, z: (pack_nibbles(c), s, z))(*quantize_int4_groupwise(layer.weight.data, group))),
        layer.bias)
    method = Int4WeightOnlyLinearMethod(group)
    method.process(layer)
    assert (layer.int4_packed is not None) == (out_features % 16 == 0)
    actual = layer(x)
    assert relative_error(actual, exact) < 0.01
    assert relative_error(actual, expected) < (0.1 if group == 32 else 0.13)   # 4 bits: ~8-10%
    assert torch.equal(layer(x), actual)


@pytest.mark.parametrize("int4", [False, True])
def test_dequantized_chunks_match_one_matmul(int4: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The non-kernel path (CUDA, odd int4 shapes) over several row chunks, ragged last chunk."""
    weight = torch.randn(100, 64)
    x = torch.randn(5, 64)
    if int4:
        codes, scale, zero = quantize_int4_groupwise(weight, 32)
        stored: tuple = (pack_nibbles(codes), scale, zero)
        dequantized = dequantize_int4(*stored)
    else:
        quantized, scale = weight_only.quantize_int8_per_channel(weight)
        stored = (quantized, scale, None)
        dequantized = weight_only.dequantize_int8(quantized, scale)
    monkeypatch.setattr(weight_only, "DEQUANT_CHUNK_ELEMENTS", 64 * 30)   # chunks of 30 rows
    actual = weight_only.dequant_chunked_linear(x, *stored)
    torch.testing.assert_close(actual, x @ dequantized.T)
    assert relative_error(actual, x @ weight.T) < (0.1 if int4 else 0.01)


def test_bfloat16_activations_round_trip_dtype() -> None:
    layer = make_layer(64, 64, bias=False)
    Int4WeightOnlyLinearMethod(32).process(layer)
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_embedding_rows_dequantize_only_the_looked_up_rows() -> None:
    weight = torch.randn(300, 64)
    ids = torch.tensor([0, 299, 7, 7])
    for rows, bound in ((Int8Rows.from_weight(weight), 0.01), (Int4Rows(weight, 32), 0.1)):
        looked_up = rows(ids)
        assert looked_up.shape == (4, 64) and looked_up.dtype == torch.float32
        assert relative_error(looked_up, weight[ids]) < bound
    assert Int4Rows(weight, 32).nbytes < Int8Rows.from_weight(weight).nbytes < weight.nbytes / 3


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(320, 64, scale=8.0)
        self.embed_tokens.weight.data.normal_()
        self.lm_head = LMHead(320, 64, tied_to=self.embed_tokens)
        self.proj = make_layer(64, 64, bias=False)


@pytest.mark.parametrize(("method", "head_kind"), [("int8wo", "int8_weight"), ("int4wo-32", "int4_packed"),
                                                   ("w8a8_int8", "int8_fbgemm")])
def test_quantize_model_tied_head_and_embedding(method: str, head_kind: str) -> None:
    model = TiedModel()
    ids = torch.tensor([3, 200])
    hidden = torch.randn(2, 64)
    expected_rows, expected_logits = model.embed_tokens(ids), model.lm_head(hidden)
    stored = quantize_model(model, method)
    assert model.proj.weight is None and hasattr(model.lm_head, head_kind)
    if method == "w8a8_int8":   # keeps the float embedding, shared with nothing quantized
        assert model.embed_tokens.weight is not None and model.embed_tokens.quantized_rows is None
    else:
        assert model.embed_tokens.weight is None and model.lm_head.weight is None
    if method == "int8wo":      # one int8 copy serves the tied head and the lookup
        assert model.embed_tokens.quantized_rows.quantized is model.lm_head.int8_weight
        assert stored < (320 * 64 + 64 * 64) * 1.2
    assert relative_error(model.embed_tokens(ids), expected_rows) < (0.1 if "int4" in method else 0.01)
    assert relative_error(model.lm_head(hidden), expected_logits) < (0.1 if "int4" in method else 0.04)


def test_int4_falls_back_to_int8_where_groups_do_not_divide() -> None:
    model = TiedModel()
    quantize_model(model, "int4wo-128")   # K = 64 < 128
    assert isinstance(model.proj.linear_method, Int8WeightOnlyLinearMethod)
    assert isinstance(model.embed_tokens.quantized_rows, Int8Rows)


def test_mixed_precision_overrides() -> None:
    model = TiedModel()
    quantize_model(model, "w8a8_int8", head="int8wo", embedding="int8")
    assert isinstance(model.lm_head.linear_method, Int8WeightOnlyLinearMethod)
    assert model.embed_tokens.quantized_rows.quantized is model.lm_head.int8_weight
    float_head = TiedModel()
    quantize_model(float_head, "int8wo", head="none", embedding="none")
    assert float_head.lm_head.weight is float_head.embed_tokens.weight and float_head.proj.weight is None
    with pytest.raises(ValueError, match="unknown embedding storage 'int4-100'"):
        quantize_model(TiedModel(), "int8wo", embedding="int4-100")
    with pytest.raises(ValueError, match="unknown quantization method 'int4wo-100'"):
        quantize_model(TiedModel(), "int4wo-100")


def test_config_choices_match_the_registry() -> None:
    """config.py cannot import torch, so it lists the names itself; they must stay the same."""
    from servelm.config import PREQUANTIZED_FLAG_VALUES, REFUSED_QUANTIZATION
    from servelm.model.prequantized import FLAG_ALIASES, PREQUANTIZED_METHODS

    quantization = next(f for f in dataclasses.fields(ModelConfig) if f.name == "quantization")
    assert tuple(quantization.metadata["choices"]) == (QUANTIZATION_METHODS + PREQUANTIZED_FLAG_VALUES
                                                       + tuple(REFUSED_QUANTIZATION))
    assert set(PREQUANTIZED_FLAG_VALUES) == set(PREQUANTIZED_METHODS) | set(FLAG_ALIASES)


def make_runner(source: object, quantization: str) -> ModelRunner:
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", quantization=quantization),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS))
    return ModelRunner(config, source)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gemma_source() -> object:
    hf_model = make_tiny_hf_model("gemma3")
    with torch.no_grad():   # sharper distributions than the default init, so margins mean something
        for param in hf_model.parameters():
            if param.dim() == 2:
                param.mul_(2.0)
    return make_source(hf_model)


@pytest.mark.parametrize(("mode", "bound"), [("int8wo", 0.03), ("int4wo-32", 0.35)])   # random weights: ~9% per layer
def test_quantized_tiny_model_logits_stay_close(gemma_source: object, mode: str, bound: float) -> None:
    exact, quantized = make_runner(gemma_source, "none"), make_runner(gemma_source, mode)
    tokens = torch.randint(0, exact.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    plan = BatchPlan([SequencePlan(tokens, 0, list(range(24 // BLOCK_SIZE)), num_logits=24)])
    expected, actual = exact.execute(plan), quantized.execute(plan)
    assert relative_error(actual, expected) < bound
    if mode == "int8wo":   # argmax agrees wherever float32's top-2 margin is clear
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * expected.std(dim=-1)
        assert clear.sum() >= 4
        assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32", "int4wo-128"])
def test_engine_generates_deterministically_under_each_mode(gemma_source: object, mode: str) -> None:
    """Greedy generation through the engine (prefill, batched decode) runs and repeats exactly."""
    def generate() -> list[list[int]]:
        runner = make_runner(gemma_source, mode)
        engine = LLMEngine(runner.config, runner=runner, eos_token_ids=[], context_length=256)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [[5, 17, 99, 3, 250, 8], [42, 7, 7, 300, 1], list(range(60, 100))]
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, params)
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for output in engine.step():
                outputs[output.request_id].extend(output.new_token_ids)
        return [outputs[f"r{i}"] for i in range(len(prompts))]

    first = generate()
    assert [len(tokens) for tokens in first] == [12, 12, 12]
    assert generate() == first
