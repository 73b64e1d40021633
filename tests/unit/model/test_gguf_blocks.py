"""GGUF weights served in their own blocks: lossless repack, the int8 kernel, a tiny model end to end.

Reference arithmetic: the repack must rebuild gguf's own dequantization exactly. The float kernel
must equal F.linear on the dequantized weight to float32 summation error (1e-5 of the largest
output); the 16-bit-activation kernel (``--quantization gguf``, the default) to 1e-4. The int8 kernel (``gguf_a8``) must equal llama.cpp's
arithmetic (activations rounded to int8 per 32 inputs, integer block dot products, float scales) to
the same error; against the dequantized weight it differs by the activation rounding only (bounded
at 2% relative, measured ~0.5%).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from servelm.distributed.parallel import ParallelContext
from servelm.model.gguf.gguf_file import GGUFFile, llama_permute
from servelm.model.gguf.gguf_weights import apply_gguf_blocks, gguf_model_dtype, load_gguf_model, resolve_quantization
from servelm.model.gguf import gguf_blocks
from servelm.model.gguf.gguf_blocks import REPACKABLE, BlockWeight, concat_rows, repack
from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel
from servelm.model.gguf.gguf_linear import BF16_KERNEL_MAX_ROWS, KERNEL_MAX_ROWS, GGUFBlockLinearMethod
from servelm.model.loader import load_model

_HEADER_F16 = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each type's fp16 header fields (d, and m or dmin)."""


def random_raw(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of ``kind`` for a ``[rows, cols]`` tensor, with finite fp16 headers."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // elements, block_bytes), dtype=np.uint8)
    for offset in _HEADER_F16[kind]:
        header = (rng.random(len(raw)) * 0.02 + 1e-3).astype(np.float16)
        raw[:, offset:offset + 2] = header.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def dequantize_raw(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    values = dequantize(raw.reshape(rows, -1), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, cols))


@pytest.mark.parametrize("kind", sorted(REPACKABLE))
def test_repack_is_lossless(kind: str) -> None:
    rows, cols = 8, 512
    raw = random_raw(kind, rows, cols)
    weight = repack(raw, (rows, cols), kind)
    assert weight.codes.dtype == torch.int8 and weight.block == REPACKABLE[kind]
    assert torch.equal(weight.dequantize(), dequantize_raw(raw, kind, rows, cols))
    # a fused layer of mixed types keeps every value (scales repeated to the smaller block)
    other = repack(random_raw("Q6_K", 4, cols, seed=1), (4, cols), "Q6_K")
    fused = concat_rows([weight, other])
    assert torch.equal(fused.dequantize(), torch.cat([weight.dequantize(), other.dequantize()]))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_own_decoding_is_the_gguf_packages(kind: str) -> None:
    """The whole-array decoding (Q8_0, Q4_0, Q4_1, Q4_K; gguf's own code for the rest) gives the gguf
    package's float32 values bit for bit, at each sign of the scale."""
    raw = random_raw(kind, 6, 256).reshape(6, -1)
    raw[::2, 1] |= 0x80   # the fp16 d of every other row's first block negative
    got = gguf_blocks.dequantize_raw(raw, kind).reshape(6, 256)
    assert got.dtype == np.float32
    assert torch.equal(torch.from_numpy(got), dequantize_raw(raw.reshape(-1), kind, 6, 256))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_repack_in_row_chunks_is_the_same(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repacking a few rows at a time (to bound start-up memory) gives the whole-tensor result."""
    from servelm.model.gguf import gguf_blocks
    raw = random_raw(kind, 10, 512)
    whole = repack(raw, (10, 512), kind)
    monkeypatch.setattr(gguf_blocks, "REPACK_ROWS", 3)
    chunked = repack(raw, (10, 512), kind)
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.scales, whole.scales)
    assert (chunked.offsets is None) == (whole.offsets is None)
    if whole.offsets is not None:
        assert torch.equal(chunked.offsets, whole.offsets)
    # so is dequantizing to bf16 a chunk at a time (the dense copies made at load)
    assert torch.equal(whole.dequantize(dtype=torch.bfloat16), whole.dequantize().to(torch.bfloat16))


def test_repack_refuses_unsupported_types() -> None:
    with pytest.raises(ValueError, match="no repack"):
        repack(random_raw("Q8_0", 1, 256), (1, 256), "Q3_K")


def llama_cpp_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """llama.cpp's arithmetic in float64: x rounded to int8 per 32 inputs (scale amax / 127)."""
    rows, cols = x.shape
    blocks = x.double().view(rows, cols // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale).view(rows, cols)
    n = weight.codes.shape[0]
    dense = (weight.codes.double().view(n, -1, weight.block) * weight.scales.double()[..., None]).view(n, cols)
    out = rounded @ dense.T
    if weight.offsets is not None:   # offsets multiply the float sum of x over their block
        out += x.double().view(rows, -1, weight.block).sum(-1) @ weight.offsets.double().T
    return out


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernels_match_their_arithmetic(kind: str, rows: int) -> None:
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"no GGUF kernel here: {kernel_status()}")
    n, k = 40, 512
    weight = repack(random_raw(kind, n, k), (n, k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = kernel.block_linear(x, weight.codes, weight.scales, weight.offsets, weight.block)
    reference = llama_cpp_reference(x, weight)
    assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    dense = F.linear(x.double(), weight.dequantize().double())   # the dequantized model's result
    assert (out - dense).norm() <= 0.02 * dense.norm()
    # float activations: the dequantized layer itself, up to float32 summation order
    exact = kernel.block_linear_float(x, weight.codes, weight.scales, weight.offsets, weight.block)
    assert (exact.double() - dense).abs().max() <= 1e-5 * dense.abs().max()
    # 16-bit activations (the default): 2^-16 of each block's largest input (2e-5 measured)
    a16 = kernel.block_linear_a16(x, weight.codes, weight.scales, weight.offsets, weight.block)
    assert (a16.double() - dense).abs().max() <= 1e-4 * dense.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_path_equals_dense_linear(dtype: torch.dtype) -> None:
    """Without a kernel (or above the kernel's rows) the layer is F.linear on the dequantized weight."""
    weight = repack(random_raw("Q5_0", 48, 256), (48, 256), "Q5_0")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
    GGUFBlockLinearMethod(None, dtype).process(layer, weight)
    assert layer.weight is None
    x = torch.randn(64, 256)
    expected = F.linear(x.to(dtype), weight.dequantize(dtype=dtype)).float()
    torch.testing.assert_close(layer.linear_method.apply(layer, x, None), expected)


def test_resolve_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    single, cpu = ParallelContext.single(), torch.device("cpu")
    monkeypatch.setattr("servelm.model.gguf.gguf_weights.load_kernel", lambda: None)  # no kernel here
    mode, reason = resolve_quantization("auto", "/m.gguf", single, cpu, False)
    assert mode == "none" and "kernel is unavailable" in reason   # per-call dequantizing is slower
    monkeypatch.setattr("servelm.model.gguf.gguf_weights.load_kernel", lambda: object())
    assert resolve_quantization("auto", "/m.gguf", single, cpu, False)[0] == "gguf"
    assert resolve_quantization("auto", None, single, cpu, False)[0] == "none"
    assert resolve_quantization("auto", "/m.gguf", single, cpu, True)[0] == "none"
    assert resolve_quantization("none", "/m.gguf", single, cpu, False)[0] == "none"
    assert resolve_quantization("auto", "/m.gguf", single, cpu, False, "float32")[0] == "none"
    assert resolve_quantization("gguf", "/m.gguf", single, cpu, False, "float32")[0] == "gguf"
    assert resolve_quantization("gguf_a8", "/m.gguf", single, cpu, False)[0] == "gguf_a8"
    tp2 = ParallelContext(tp_size=2, group=object())
    with pytest.raises(ValueError, match="--tp-size 1 only"):
        resolve_quantization("gguf", "/m.gguf", tp2, cpu, False)
    assert resolve_quantization("auto", "/m.gguf", tp2, cpu, False)[0] == "none"   # no experts: all dequantized
    experts = ParallelContext(tp_size=2, group=object(), ep_size=2)   # --ep-size: whole experts per rank
    for parallel in (experts, tp2):   # at ep 1 the experts' intermediate columns, where they keep whole blocks
        mode, reason = resolve_quantization("auto", "/m.gguf", parallel, cpu, False, has_experts=True)
        assert mode == "gguf" and "whole under --ep-size" in reason
        assert resolve_quantization("gguf", "/m.gguf", parallel, cpu, False, has_experts=True)[0] == "gguf"
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_quantization("gguf", None, single, cpu, False)


@pytest.mark.parametrize(("flags", "expected", "evidence"), [
    ({"avx512f", "avx512_vnni", "avx512_bf16"}, torch.bfloat16, "AVX512-BF16"),
    ({"avx512f", "amx_bf16", "avx512_bf16"}, torch.bfloat16, "AMX"),
    ({"avx512f", "avx512_vnni"}, torch.float32, "no native bf16 GEMM"),
])
def test_gguf_model_dtype_follows_the_cpu(flags: set[str], expected: torch.dtype, evidence: str) -> None:
    """Under gguf, everything but the blocks runs bf16 where the CPU has a native bf16 GEMM (both
    decisions forced through the CPU flags); a named --dtype wins."""
    cpu = torch.device("cpu")
    dtype, reason = gguf_model_dtype("auto", cpu, flags)
    assert dtype == expected and evidence in reason
    assert gguf_model_dtype("float32", cpu, flags) == (torch.float32, "--dtype float32")
    assert gguf_model_dtype("bfloat16", cpu, flags)[0] == torch.bfloat16


def test_bf16_activations_meet_the_bf16_copy_unconverted() -> None:
    """Above the kernel's rows a bf16 model's activations go straight into the bf16 dense copy
    (no float32 round trip): the result is F.linear in bf16, bias added in bf16."""
    weight = repack(random_raw("Q8_0", 48, 256), (48, 256), "Q8_0")
    layer = torch.nn.Module()
    GGUFBlockLinearMethod(None, torch.bfloat16).process(layer, weight)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    out = layer.linear_method.apply(layer, x, bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x, weight.dequantize(dtype=torch.bfloat16)) + bias)


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_bf16_rows_past_the_bf16_limit_take_the_dense_copy(activations: str) -> None:
    """A bf16 model's layer runs the kernel up to BF16_KERNEL_MAX_ROWS rows and the bf16 dense copy
    above it; float32 rows keep KERNEL_MAX_ROWS (the kernel's result), and so does the LM head
    (``float_output``) in bf16."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"no GGUF kernel here: {kernel_status()}")
    weight = repack(random_raw("Q8_0", 48, 256), (48, 256), "Q8_0")
    method = GGUFBlockLinearMethod(kernel, torch.bfloat16, activations)
    layer, head = torch.nn.Module(), torch.nn.Module()
    method.process(layer, weight)
    method.process(head, weight, float_output=True)
    run = getattr(kernel, "block_linear_a16" if activations == "int16" else "block_linear")
    dense = weight.dequantize(dtype=torch.bfloat16)
    limit = BF16_KERNEL_MAX_ROWS[activations]
    assert limit < KERNEL_MAX_ROWS[activations]
    for rows in (limit, limit + 1, KERNEL_MAX_ROWS[activations]):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        by_kernel = run(x.float(), weight.codes, weight.scales, None, 32)
        expected = by_kernel.bfloat16() if rows <= limit else F.linear(x, dense)
        assert torch.equal(layer.linear_method.apply(layer, x, None), expected)
        assert torch.equal(head.linear_method.apply(head, x, None), by_kernel)
        assert torch.equal(layer.linear_method.apply(layer, x.float(), None), by_kernel)


# -- a tiny llama GGUF with quantized tensors, end to end --------------------------------------------

_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_0",
          "ffn_gate": "Q5_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


def write_quantized_llama(path: Path) -> None:
    """One llama layer, hidden 64 (2 heads of 32, 1 KV head), FFN 128, vocab 100, tied head."""
    import gguf
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (100, 64), "attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64),
              "attn_output": (64, 64), "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 2), ("head_count_kv", 1),
                       ("rope_dimension_count", 32), ("vocab_size", 100)):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_eos_token_id(1)
    writer.add_token_list([f"t{i}" for i in range(100)])
    for name in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for part, shape in shapes.items():
        values = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if part in ("attn_q", "attn_k"):
            values = llama_permute(torch.from_numpy(values), shape[0] // 32).numpy()
        kind = gguf.GGMLQuantizationType[_TYPES[part]]
        name = "token_embd.weight" if part == "token_embd" else f"blk.0.{part}.weight"
        writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_quantized_gguf_served_in_blocks(tmp_path: Path, dtype: torch.dtype) -> None:
    """Every linear, the tied head and the embedding take the file's blocks, loaded without a float
    model first; each block weight equals the float loader's weight (row order, fused shards,
    llama's Q/K permutation), and the logits stay within the activation rounding of the float32
    dequantized model's (bf16: the bf16 model's rounding)."""
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    config = GGUFFile.open(path).hf_config()
    reference = load_model(config, lambda: GGUFFile.open(path).tensors(), torch.float32, torch.device("cpu"))
    model = load_gguf_model(config, path, dtype, torch.device("cpu"))
    layers = {name: module for name, module in model.named_modules() if hasattr(module, "gguf_weight")}
    assert sorted(layers) == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                              "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"]
    for name, module in layers.items():
        weight = reference.get_submodule(name).weight
        assert torch.equal(module.gguf_weight.dequantize(), weight), name
    # fused QKV (Q8_0 q/k + Q5_0 v), o (Q4_0), gate_up (Q5_0 + Q4_1), down (Q8_0)
    assert {m.gguf_weight.kind for m in layers.values()} == {"Q8_0+Q5_0", "Q4_0", "Q5_0+Q4_1", "Q8_0"}
    assert all(p.dim() == 1 and p.dtype == dtype for p in model.parameters())   # no float matrix left
    # the norms were loaded from the file after the blocks
    torch.testing.assert_close(model.model.norm.weight.float(), reference.model.norm.weight)
    ids = torch.tensor([3, 17, 42, 99])
    embedded = model.model.embed_tokens(ids)
    assert embedded.dtype == dtype
    assert torch.equal(embedded, reference.model.embed_tokens(ids).to(dtype))   # lookups are exact
    head = model.lm_head(embedded)
    assert head.dtype == torch.float32   # logits are never rounded to bf16
    expected = reference.lm_head(embedded.float())
    assert (head - expected).norm() <= 0.02 * expected.norm()
    tolerance = 0.02 if dtype == torch.float32 else 0.1
    hidden = model.model.layers[0].mlp(embedded).float()
    expected = reference.model.layers[0].mlp(embedded.float())
    assert (hidden - expected).norm() <= tolerance * expected.norm()


def test_apply_after_a_float_load_checks_each_block(tmp_path: Path) -> None:
    """apply_gguf_blocks on a loaded model compares each block weight with the weight it replaces."""
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    config = GGUFFile.open(path).hf_config()
    model = load_model(config, lambda: GGUFFile.open(path).tensors(), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 0] += 1.0
    with pytest.raises(ValueError, match="down_proj: GGUF blocks differ"):
        apply_gguf_blocks(model, path)


def test_a_qkv_projection_offers_its_queries_to_the_int8_gemm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf_weights passes a merged QKV projection's query block as ``int8_lead`` (``I8_GEMM_LEAD``) and
    the route table measures its shape (an int8 one where the int8 GEMM's build takes its codes: the AVX2
    build does not take Q8_0's); no other layer offers one."""
    from servelm.model.gguf import gguf_i8gemm, gguf_weights
    offered: dict[str, BlockWeight | None] = {}
    process = GGUFBlockLinearMethod.process

    def spy(self, layer, weight, *args, **kwargs):
        offered[next(name for name, module in model.named_modules() if module is layer)] = kwargs.get("int8_lead")
        return process(self, layer, weight, *args, **kwargs)

    measured: list = []
    build_table = gguf_weights.build_table
    monkeypatch.setattr(GGUFBlockLinearMethod, "process", spy)
    monkeypatch.setattr(gguf_weights, "build_table", lambda method, specs, *a, **k: (measured.extend(specs),
                                                                                     build_table(method, specs, *a, **k))[1])
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    config = GGUFFile.open(path).hf_config()
    model = load_model(config, lambda: GGUFFile.open(path).tensors(), torch.float32, torch.device("cpu"))
    apply_gguf_blocks(model, path)
    lead = offered.pop("model.layers.0.self_attn.qkv_proj")
    assert lead is not None and tuple(lead.shape) == (64, 64)   # 2 heads of 32: the queries' rows only
    assert offered and all(value is None for value in offered.values())
    i8 = gguf_i8gemm.load_gemm() if not gguf_i8gemm.gemm_missing_flags() else None
    may_int8 = i8 is None or gguf_i8gemm.fits(i8, lead)
    assert any(spec.shape.out_features == 64 and spec.shape.in_features == 64 and spec.shape.may_int8 == may_int8
               and spec.shape.kind == lead.kind for spec in measured)


def test_no_kernel_without_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX512-VNNI gets no kernel, with the reason (CI without a compiler likewise)."""
    from servelm.model.gguf import gguf_kernel
    monkeypatch.setattr(gguf_kernel.KERNEL, "cpu_flags", lambda: {"avx512f", "avx2"})
    module, reason = gguf_kernel.KERNEL.build()
    assert module is None and reason == "this CPU lacks avx512bw, avx512vl, avx512_vnni"


def test_tiny_gguf_without_kernel_is_the_dequantized_model(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.model.gguf import gguf_weights
    from servelm.model.gguf.block_builds import BuildChoice
    monkeypatch.setattr(gguf_weights, "choose_block_build", lambda *args, **kwargs: BuildChoice(None, None, "no build"))
    monkeypatch.setattr(gguf_weights, "cpu_bf16_feature", lambda: None)   # dequantize to float32
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    config = GGUFFile.open(path).hf_config()
    reference = load_model(config, lambda: GGUFFile.open(path).tensors(), torch.float32, torch.device("cpu"))
    model = load_model(config, lambda: GGUFFile.open(path).tensors(), torch.float32, torch.device("cpu"))
    apply_gguf_blocks(model, path)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.model.layers[0].mlp.gate_up_proj(hidden),
                               reference.model.layers[0].mlp.gate_up_proj(hidden))
    torch.testing.assert_close(model.lm_head(hidden), reference.lm_head(hidden))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_k_quant_factors_rebuild_the_scales(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A K-quant's scales (offsets) are its sub-scales times d (-dmin) per 256 inputs, bit for bit, also
    when repacked in chunks of rows and after rows are taken; the other types carry none."""
    from servelm.model.gguf import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "REPACK_ROWS", 3)
    rows, cols = 7, 512
    weight = repack(random_raw(kind, rows, cols, seed=3), (rows, cols), kind)
    if not kind.endswith("_K"):
        assert weight.scale_factors is None and weight.offset_factors is None
        return
    factors = weight.scale_factors
    assert factors is not None and factors.sub.dtype == torch.int8 and factors.multipliers.shape == (rows, cols // 256)
    assert torch.equal(factors.values().view(torch.int32), weight.scales.view(torch.int32))
    assert (weight.offsets is None) == (weight.offset_factors is None)
    if weight.offset_factors is not None:
        assert torch.equal(weight.offset_factors.values().view(torch.int32), weight.offsets.view(torch.int32))
    taken = weight.permute_rows(torch.tensor([6, 2]))
    assert taken.scale_factors is not None and torch.equal(taken.scale_factors.values(), taken.scales)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_from_packed_codes_in_one_call(kind: str, dtype: torch.dtype) -> None:
    """An embedding lookup of a packed weight (4, 5, 6 bits, centered or not, with and without offsets)
    in the fused ops' one call gives torch's unpack-and-scale floats bit for bit, and the weight's own
    dequantized rows; Q8_0's codes (not packed) keep the torch path."""
    from servelm.model.gguf.gguf_linear import BlockRows
    from servelm.model.layers import fused

    if fused.load_kernel() is None:
        pytest.skip(fused.kernel_status())
    rows, cols = 40, 512
    weight = repack(random_raw(kind, rows, cols, seed=3), (rows, cols), kind)
    expected_rows = weight.dequantize()
    if weight.with_packed() is not None:
        weight.drop_codes()
    lookup = BlockRows(weight, dtype)
    ids = torch.tensor([[3, 39, 0], [3, 17, 5]])
    native = lookup(ids)
    fused.set_enabled(False)
    try:
        reference = lookup(ids)
    finally:
        fused.set_enabled(True)
    assert native.dtype == dtype and native.shape == (2, 3, cols)
    assert torch.equal(native, reference)
    assert torch.equal(native, expected_rows[ids].to(dtype))
    with pytest.raises((RuntimeError, IndexError)):   # an id past the rows: the kernel checks, as indexing does
        lookup(torch.tensor([rows]))


@pytest.mark.parametrize("rows", [1, 6])
def test_the_block_kernel_is_the_same_at_every_thread_count(rows: int) -> None:
    """How many threads split a call's outputs never changes a result bit (each output is one
    thread's, computed alike wherever the split falls)."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"no GGUF kernel here: {kernel_status()}")
    n, k = 1000, 512
    weight = repack(random_raw("Q4_K", n, k), (n, k), "Q4_K")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(kernel.block_linear_a16(x, weight.codes, weight.scales, weight.offsets, weight.block))
    finally:
        torch.set_num_threads(threads)
    dense = F.linear(x.double(), weight.dequantize().double())
    assert (results[0] - dense).norm() <= 0.02 * dense.norm()
    for result in results[1:]:
        assert torch.equal(result, results[0])
