"""The int8 x int8 GEMM on GGUF codes (gguf_i8gemm.cpp, VNNI; gguf_i8gemm_avx2.cpp, AVX2) against the same
quantized arithmetic in torch (``gguf_i8gemm.reference``): the activation rounding bit for bit, the
integer block dots exactly, the float32 results to rounding; each build that runs here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from servelm.model.gguf import gguf_i8gemm, gguf_rows
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_kernel import load_kernel as load_vnni_kernel
from servelm.model.gguf.gguf_linear import I8_GEMM_FIRST_ROW, I8_GEMM_SKIPPED, KERNEL_MAX_ROWS, GGUFBlockLinearMethod
from servelm.model.gguf.gguf_routes import PassRows
from servelm.model.layers.linear import dense_linear
from tests.tiny_models import random_block_weight

GEMM_BUILDS = {"vnni": gguf_i8gemm.KERNEL, "avx2": gguf_i8gemm.AVX2_KERNEL}


@pytest.fixture(scope="module")
def kernel():
    """The VNNI build (the routing tests below run it beside the VNNI block kernel and the rows kernel)."""
    module = gguf_i8gemm.load_kernel()
    if module is None:
        pytest.skip(f"no int8 GEMM here: {gguf_i8gemm.kernel_status()}")
    return module


@pytest.fixture(scope="module", params=sorted(GEMM_BUILDS))
def build(request):
    """Each build of the GEMM that runs on this CPU."""
    kernel = GEMM_BUILDS[request.param]
    if kernel.missing_cpu_flags():
        pytest.skip(f"{kernel.description}: this CPU lacks {', '.join(kernel.missing_cpu_flags())}")
    module = kernel.load()
    if module is None:
        pytest.skip(f"{kernel.description}: {kernel.status()}")
    return module


def block_weight(n: int, k: int, block: int, offsets: bool, seed: int, build: object = None) -> BlockWeight:
    """``random_block_weight``'s codes (-128 .. 127), halved (-64 .. 63) for the AVX2 build, which takes
    codes spanning at most 127."""
    weight = random_block_weight(n, k, block, offsets, seed)
    if build is not None and gguf_i8gemm.is_avx2(build):
        weight = BlockWeight(torch.div(weight.codes, 2, rounding_mode="floor"), weight.scales, weight.offsets, block,
                             weight.kind)
    return weight


def gemm(build: object, x: torch.Tensor, weight: BlockWeight, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``build``'s GEMM on ``weight`` packed for it (``pack_for``; ``gemm``'s other arguments after)."""
    packed = gguf_i8gemm.pack_for(build, weight)
    assert packed is not None
    return gguf_i8gemm.gemm(build, x, packed, weight.block, *args, **kwargs)


def assert_matches(out: torch.Tensor, x: torch.Tensor, weight: BlockWeight) -> None:
    """Float32 rounding of the sums over blocks only: 1e-5 of the largest |result|."""
    expected = gguf_i8gemm.reference(x, weight)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [320, 896])   # blocks a row: 10 / 20 and 28 / 56 (groups of 16 and a rest)
def test_activation_rounding_is_the_reference_bit_for_bit(build, dtype: torch.dtype, k: int) -> None:
    x = (torch.randn(37, k, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[3, :32] = 0   # an all-zero block: scale 0, codes 0
    x[4, 5 * 32 + 7] = 40.0   # one block's large value: its own scale only
    for block in (16, 32):
        codes, scales = build.quantize(x, block)
        expected_codes, expected_scales = gguf_i8gemm.quantize_reference(x, block)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
        assert int(codes.abs().max()) == 127


def test_a_value_that_is_not_finite_rounds_only_its_own_block(build) -> None:
    """The VNNI build reduces 16 blocks' absmax at once: a block's inf or NaN stays in that block."""
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(1))
    x[1, 40] = float("inf")
    x[2, 300] = float("nan")
    for block in (16, 32):
        codes, scales = build.quantize(x, block)
        expected_codes, expected_scales = gguf_i8gemm.quantize_reference(x, block)
        keep = torch.ones(3, 896 // block, dtype=torch.bool)
        keep[1, 40 // block] = keep[2, 300 // block] = False
        assert torch.equal(scales[keep], expected_scales[keep])
        by_block = keep.repeat_interleave(block, dim=1)
        assert torch.equal(codes[by_block], expected_codes[by_block])
        assert scales[1, 40 // block] == float("inf")   # an inf's block: scale inf, its codes meaningless


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("codes", [(-128, 127), (-64, 63), (-32, 31), (0, 15), (-16, 15), (3, 66)])
def test_integer_dots_are_exact(build, block: int, codes: tuple[int, int]) -> None:
    """Activations already int8 with a 127 in every block (scale 1) and unit weight scales: every
    product and sum is an integer below 2**24, so float32 holds the exact int64 result. Codes of
    each GGUF kind's range (Q8_0, Q6_K, Q4_K, Q5_0; the AVX2 build adds pairs in int16 where they
    span at most 63, one vpmaddwd for two vpmaddubsw), and every code and activation at its extremes
    (a saturating int16 would show there); the AVX2 build refuses codes spanning more than 127."""
    generator = torch.Generator().manual_seed(block)
    n, k = 45, 256
    weight = BlockWeight(torch.randint(codes[0], codes[1] + 1, (n, k), dtype=torch.int8, generator=generator),
                         torch.ones(n, k // block), None, block, "test")
    if gguf_i8gemm.is_avx2(build) and codes[1] - min(codes[0], 0) > gguf_i8gemm.AVX2_CODE_SPAN:
        assert gguf_i8gemm.pack_for(build, weight) is None and not gguf_i8gemm.fits(build, weight)
        return
    assert gguf_i8gemm.fits(build, weight)
    x = torch.randint(-127, 128, (23, k), generator=generator).float()
    x.view(23, -1, block)[..., 0] = 127
    x[:4] = torch.tensor([127.0, -127.0, 127.0, -127.0])[:, None]   # rows of one sign, at the extremes
    weight.codes[:2] = torch.tensor(codes, dtype=torch.int8)[:, None]   # outputs at the least and greatest code
    weight.codes[2, ::2], weight.codes[2, 1::2] = codes[0], codes[1]
    out = gemm(build, x, weight, False, n)
    assert torch.equal(out.double(), (x.double() @ weight.codes.double().T))


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("offsets", [False, True])
def test_every_row_count_matches_the_reference(build, block: int, offsets: bool) -> None:
    weight = block_weight(75, 192, block, offsets, seed=block + offsets, build=build)   # 75 outputs: a short last tile
    x = torch.randn(40, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = gemm(build, x, weight, False, 75)
    for m in range(1, 41):
        out = gemm(build, x[:m].contiguous(), weight, False, 75)
        assert out.dtype == torch.float32 and out.shape == (m, 75)
        assert_matches(out, x[:m], weight)
        # a row's result does not depend on the other rows
        assert torch.equal(out, full[:m])


@pytest.mark.parametrize("levels", [64, 32])
def test_fewer_activation_levels_take_q8_0_codes_exactly(build, levels: int) -> None:
    """The AVX2 build's LM-head screen: activations rounded to ``levels`` steps (bit for bit as the
    reference), which lets Q8_0's codes (u = code + 127 up to 254) through vpmaddubsw's int16 pairs, one
    at a time at 64 levels and two at 32; every integer dot exact at the extremes of both."""
    if not gguf_i8gemm.is_avx2(build):
        pytest.skip("the VNNI build rounds to 127 levels only")
    generator = torch.Generator().manual_seed(levels)
    x = torch.randn(29, 640, generator=generator) * 3
    x[2, :32] = 0
    codes, scales = build.quantize(x, 32, levels=levels)
    expected_codes, expected_scales = gguf_i8gemm.quantize_reference(x, 32, levels)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    assert int(codes.abs().max()) == levels
    n, k = 45, 256
    weight = BlockWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
                         torch.ones(n, k // 32), None, 32, "Q8_0")
    weight.codes[:2] = torch.tensor([-127, 127], dtype=torch.int8)[:, None]
    weight.codes[2, ::2], weight.codes[2, 1::2] = -127, 127
    packed = gguf_i8gemm.pack_avx2(weight, gguf_i8gemm.AVX2_SCREEN_CODE_SPAN)
    assert packed is not None and packed.call_kwargs == {"code_bias": 127, "code_span": 254}
    q = torch.randint(-levels, levels + 1, (23, k), generator=generator).float()
    q.view(23, -1, 32)[..., 0] = levels   # every block's absmax at ``levels``: scale 1
    q[:4] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * levels   # rows of one sign, at the extremes
    out = build.i8_gemm(q, *packed, 32, False, n, levels=levels, **packed.call_kwargs)
    assert torch.equal(out.double(), q.double() @ weight.codes.double().T)
    torch.testing.assert_close(build.i8_gemm(x[:, :k].contiguous(), *packed, 32, False, n, levels=levels,
                                             **packed.call_kwargs),
                               gguf_i8gemm.reference(x[:, :k], weight, levels), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="code_span"):   # 2 x 254 x 65 does not fit in int16
        build.i8_gemm(q, *packed, 32, False, n, levels=65, **packed.call_kwargs)
    with pytest.raises(RuntimeError, match="levels"):
        build.quantize(x, 32, levels=128)


def test_both_builds_give_the_same_floats() -> None:
    """Where both builds run (an AVX512-VNNI CPU), their results are equal bit for bit: the same
    integer dots, the same float operations in the same order."""
    modules = [kernel.load() for kernel in GEMM_BUILDS.values() if not kernel.missing_cpu_flags()]
    if len(modules) < 2 or None in modules:
        pytest.skip("one build runs here")
    for block, offsets in ((16, False), (32, True)):
        weight = block_weight(75, 256, block, offsets, seed=40 + block, build=modules[1])
        x = torch.randn(19, 256, generator=torch.Generator().manual_seed(41))
        assert torch.equal(gemm(modules[0], x, weight, False, 75), gemm(modules[1], x, weight, False, 75))


@pytest.mark.parametrize("threads", [1, 2])
def test_large_row_counts_and_threads(build, threads: int) -> None:
    """Row panels (K = 2048: a panel of 128 rows) and the tiles split over threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = block_weight(200, 2048, 32, False, seed=3, build=build)
        for m in (129, 600):
            x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).bfloat16()
            out = gemm(build, x, weight, False, 200)
            assert_matches(out, x, weight)
            assert torch.equal(out[-7:], gemm(build, x[-7:].contiguous(), weight, False, 200))
    finally:
        torch.set_num_threads(before)


def test_bf16_output_is_the_float32_result_rounded(build) -> None:
    weight = block_weight(70, 640, 32, False, seed=5, build=build)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(2)).bfloat16()
    full = gemm(build, x, weight, False, 70)
    assert torch.equal(gemm(build, x, weight, True, 70), full.bfloat16())
    if gguf_i8gemm.is_avx2(build):   # a NaN makes its row's results NaN, as the reference's
        x[0, 0] = float("nan")
        assert bool(gemm(build, x, weight, True, 70)[0].isnan().all())
        assert bool(gguf_i8gemm.reference(x, weight)[0].isnan().all())


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_a_bias_goes_in_before_the_rounding(build, bias_dtype: torch.dtype) -> None:
    """``bias``: float32 result + bias, then one rounding to bf16 (as run_route adds it after a float32
    result), on a padded last tile too (70 outputs)."""
    weight = block_weight(70, 256, 32, False, seed=15, build=build)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(16)).bfloat16()
    bias = (torch.randn(70, generator=torch.Generator().manual_seed(17)) * 4).to(bias_dtype)
    full = gemm(build, x, weight, False, 70)
    assert torch.equal(gemm(build, x, weight, True, 70, bias=bias), (full + bias).bfloat16())
    assert torch.equal(gemm(build, x, weight, False, 70, bias=bias), full + bias)
    # not the bf16 result plus the bias (two roundings)
    assert not torch.equal(gemm(build, x, weight, True, 70, bias=bias), (full.bfloat16() + bias).bfloat16())
    with pytest.raises(RuntimeError, match="bias"):
        gemm(build, x, weight, True, 70, bias=bias[:64])


def test_writes_into_a_given_output(build) -> None:
    """A reused buffer (wider rows than n: a padded logits buffer) is written in place."""
    weight = block_weight(64, 128, 32, False, seed=6, build=build)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    buffer = torch.full((5, 80), -1.0)
    out = gemm(build, x, weight, False, 64, buffer[:, :64])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :64], gemm(build, x, weight, False, 64))
    assert bool((buffer[:, 64:] == -1).all())
    with pytest.raises(RuntimeError, match="out"):
        gemm(build, x, weight, False, 64, torch.empty(4, 64))


def test_bad_arguments_are_refused(build) -> None:
    weight = block_weight(32, 128, 32, False, seed=7, build=build)
    with pytest.raises(RuntimeError, match="packed uint8"):
        gemm(build, torch.randn(2, 64), weight, False, 32)
    with pytest.raises(RuntimeError, match="at most"):
        gemm(build, torch.randn(2, 128), weight, False, 33)
    if gguf_i8gemm.is_avx2(build):   # codes wider than vpmaddubsw's pairs take, or a bias beyond them
        packed = gguf_i8gemm.pack_for(build, weight)
        with pytest.raises(RuntimeError, match="code_span"):
            build.i8_gemm(torch.randn(2, 128), *packed, 32, code_bias=64, code_span=130)   # 2 x 130 x 127 > 32,767
        with pytest.raises(RuntimeError, match="code_bias"):
            build.i8_gemm(torch.randn(2, 128), *packed, 32, code_bias=100, code_span=90)
        with pytest.raises(RuntimeError, match="packed uint8"):   # the VNNI build's layout
            build.i8_gemm(torch.randn(2, 128), *gguf_i8gemm.pack(weight), 32, code_bias=64, code_span=127)


def test_layers_take_the_int8_gemm_from_its_first_row_and_the_head_never(kernel) -> None:
    """Routing (gguf_linear.py): a layer's rows from I8_GEMM_FIRST_ROW on; the head never (its rows are generation rows); no dense copy of a layer is
    kept; fewer rows keep their kernels."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    weight = block_weight(70, 256, 32, True, seed=8)
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel)
    layer, head = torch.nn.Module(), torch.nn.Module()
    method.process(layer, weight)
    method.process(head, weight, float_output=True)
    assert layer.gguf_dense is None and head.gguf_dense is None and head.gguf_i8 is None
    codes, scales, offsets = layer.gguf_i8
    first = I8_GEMM_FIRST_ROW
    for m in (1, first - 1, first, first + 37):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        out = method.apply(layer, x, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, 70)
        assert torch.equal(out, kernel.i8_gemm(x, codes, scales, offsets, 32, True, 70)) == (m >= first), m
        logits = method.apply(head, x, None)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, rows_kernel.rows_gemm(x, *head.gguf_packed, 32, False, 70)), m
    # float32 rows (a float32 model, built so on this CPU): the VNNI kernel up to its limit, the rows
    # kernel on them rounded to bf16 above (no dense copy to take them), the int8 GEMM from the first row
    limit = KERNEL_MAX_ROWS["int16"]
    x = torch.randn(first, 256)
    assert torch.equal(method.apply(layer, x, None), kernel.i8_gemm(x, codes, scales, offsets, 32, False, 70))
    for m in (limit + 1, first - 1):
        assert torch.equal(method.apply(layer, x[:m], None),
                           rows_kernel.rows_gemm(x[:m].bfloat16(), *layer.gguf_packed, 32, False, 70)), m
    assert torch.equal(method.apply(layer, x[:limit], None),
                       vnni.block_linear_a16(x[:limit], weight.codes, weight.scales, weight.offsets, 32))
    # a bias goes on top of the float32 result, then the bf16 rounding
    bias = torch.randn(70).bfloat16()
    x = torch.randn(60, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(method.apply(layer, x, bias),
                       (kernel.i8_gemm(x, codes, scales, offsets, 32, False, 70) + bias).bfloat16())
    # a float32 model (no rows kernel, a float32 dense copy) keeps its dense copy below the first row
    float_model = GGUFBlockLinearMethod(vnni, torch.float32, "int16", None, kernel)
    float_layer = torch.nn.Module()
    float_model.process(float_layer, weight)
    assert float_layer.gguf_dense is not None and float_layer.gguf_dense.dtype == torch.float32
    first = I8_GEMM_FIRST_ROW
    x = torch.randn(first, 256)
    assert torch.equal(float_model.apply(float_layer, x, None),
                       kernel.i8_gemm(x, codes, scales, offsets, 32, False, 70))
    assert torch.equal(float_model.apply(float_layer, x[:-1], None),
                       dense_linear(x[:-1], float_layer.gguf_dense))
    # the exact mode never rounds activations to int8
    exact = GGUFBlockLinearMethod(vnni, torch.bfloat16, "float", rows_kernel, kernel)
    exact.process(layer, weight)
    assert layer.gguf_i8 is None and layer.gguf_dense is not None


def test_kv_projections_keep_unrounded_prefill_rows(kernel) -> None:
    """``int8_rows=False`` (gguf_weights passes it for ``I8_GEMM_SKIPPED``): no int8 copy, the dense
    copy for the rows the rows kernel does not take."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    assert "qkv_proj" in I8_GEMM_SKIPPED
    weight = block_weight(70, 256, 32, False, seed=9)
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel)
    layer = torch.nn.Module()
    method.process(layer, weight, int8_rows=False)
    assert layer.gguf_i8 is None and layer.gguf_dense is not None
    x = torch.randn(I8_GEMM_FIRST_ROW, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(method.apply(layer, x, None), dense_linear(x, layer.gguf_dense))


def test_a_qkv_projections_queries_take_the_int8_gemm_into_its_result(kernel) -> None:
    """``int8_lead`` (gguf_weights passes a QKV projection's queries, ``I8_GEMM_LEAD``): from the first
    int8 row the kernel writes the queries into the layer's result in place (rows ``N`` apart), the keys
    and values are the dense copy's; fewer rows keep the layer's own route."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    from servelm.model.gguf.gguf_blocks import concat_rows
    queries, keys_values = block_weight(64, 256, 32, False, seed=12), block_weight(38, 256, 32, False, seed=13)
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel)
    layer = torch.nn.Module()
    method.process(layer, concat_rows([queries, keys_values]), int8_rows=False, int8_lead=queries)
    assert layer.gguf_lead is not None and layer.gguf_lead[0] == 64
    codes, scales, offsets = layer.gguf_i8
    first = I8_GEMM_FIRST_ROW
    x = torch.randn(first + 9, 256, generator=torch.Generator().manual_seed(14)).bfloat16()
    out = method.apply(layer, x, None)
    assert out.shape == (first + 9, 102) and out.dtype == torch.bfloat16
    assert torch.equal(out[:, :64], kernel.i8_gemm(x, codes, scales, offsets, 32, True, 64))
    assert torch.equal(out[:, 64:], dense_linear(x, layer.gguf_dense[64:]))
    torch.testing.assert_close(out[:, 64:].float(), dense_linear(x, layer.gguf_dense)[:, 64:].float())
    fewer = method.apply(layer, x[:first - 1], None)
    assert torch.equal(fewer, method.run_route(layer.gguf_routes.pick(first - 1, True, True), layer,
                                               x[:first - 1], None, False))


@pytest.mark.parametrize("kv_outputs", [32, 38])   # the prepared call's reach; padded outputs (via the routes)
def test_a_qkv_projections_queries_take_the_int8_gemm_beside_the_rows_kernel(kernel, kv_outputs: int) -> None:
    """Where the layer's own prompt route is the rows kernel (no dense copy held), the queries take the
    int8 GEMM (the bias added in float32 before the rounding) and the keys and values the rows kernel's
    tiles after the queries': the bits the whole layer's call gives them, so the cache keeps what it
    kept. Generation rows, alone or in a mixed pass, take the rows kernel whole."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    from servelm.model.gguf.gguf_blocks import concat_rows
    from servelm.model.gguf.gguf_routes import Route
    from tests.unit.model.test_gguf_routes import complete
    queries, keys_values = block_weight(64, 256, 32, False, seed=18), block_weight(kv_outputs, 256, 32, False, seed=19)
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel,
                                   lambda shape, x_bf16, rows: complete([Route.INT8, Route.ROWS]))
    layer = torch.nn.Module()
    method.process(layer, concat_rows([queries, keys_values]), int8_rows=False, int8_lead=queries)
    assert layer.gguf_dense is None and layer.gguf_lead is not None and layer.gguf_lead[2] == {Route.ROWS}
    assert bool(layer.gguf_decode_args) == (kv_outputs == 32)
    n = 64 + kv_outputs
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(20)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(21)).bfloat16()
    out = method.apply(layer, x, bias, PassRows.of([40], [False]))
    whole = method.run_route(Route.ROWS, layer, x, bias, False)
    codes, scales, offsets = layer.gguf_i8
    assert codes.shape[0] * 32 == 64   # the int8 copy holds the queries' outputs only
    assert out.shape == (40, n) and out.dtype == torch.bfloat16
    assert torch.equal(out[:, :64], kernel.i8_gemm(x, codes, scales, offsets, 32, True, 64, bias=bias[:64]))
    assert torch.equal(out[:, 64:], whole[:, 64:])
    assert not torch.equal(out[:, :64], whole[:, :64])
    assert torch.equal(method.apply(layer, x, bias, PassRows.of([1] * 40, [True] * 40)), whole)
    mixed = method.apply(layer, x, bias, PassRows.of([1, 30, 1, 8], [True, False, True, False]))
    generation = [0, 31]
    prompt = [row for row in range(40) if row not in generation]
    assert torch.equal(mixed[generation], whole[generation]) and torch.equal(mixed[prompt], out[prompt])


def bf16_block_layer(kernel, weight: BlockWeight) -> tuple[GGUFBlockLinearMethod, torch.nn.Module, Any]:
    """A bf16 model's layer on ``weight`` with every kernel (VNNI, rows, int8), and the rows kernel's
    module; skips where the VNNI or the rows kernel is missing."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel)
    layer = torch.nn.Module()
    method.process(layer, weight)
    return method, layer, rows_kernel


def test_generation_rows_never_take_the_int8_gemm(kernel) -> None:
    """``PassRows``: in a pass of decode/verify rows only, every row count takes the rows kernel;
    in a mixed pass the prompt rows take the int8 GEMM and the generation rows come out as they would
    in a pass of their own."""
    method, layer, rows_kernel = bf16_block_layer(kernel, block_weight(70, 256, 32, False, seed=10))
    codes, scales, offsets = layer.gguf_i8
    x = torch.randn(90, 256, generator=torch.Generator().manual_seed(11)).bfloat16()

    def by_rows(rows: torch.Tensor) -> torch.Tensor:
        return rows_kernel.rows_gemm(rows.contiguous(), *layer.gguf_packed, 32, True, 70)

    decode = PassRows.of([1] * 90, [True] * 90)   # 90 decode streams
    assert torch.equal(method.apply(layer, x, None, decode), by_rows(x))
    # a float32 model's (its layers have no dense copy on this CPU): the rows kernel, rounded to bf16
    for m in (20, 90):
        assert torch.equal(method.apply(layer, x[:m].float(), None, PassRows.of([1] * m, [True] * m)),
                           rows_kernel.rows_gemm(x[:m].contiguous(), *layer.gguf_packed, 32, False, 70)), m
    # 2 decode rows, a 60-token prompt chunk, a 5-row verify, a 23-token prompt chunk
    counts, generation = [1, 1, 60, 5, 23], [True, True, False, True, False]
    out = method.apply(layer, x, None, PassRows.of(counts, generation))
    by_i8 = kernel.i8_gemm(x, codes, scales, offsets, 32, True, 70)
    gen_rows = list(range(0, 2)) + list(range(62, 67))
    prompt = [r for r in range(90) if r not in gen_rows]
    assert torch.equal(out[gen_rows], by_rows(x[gen_rows]))
    assert torch.equal(out[prompt], by_i8[prompt])
    assert not torch.equal(out[gen_rows], by_i8[gen_rows])   # the fix-up did something
    # one prompt: every row on the int8 GEMM
    assert torch.equal(method.apply(layer, x, None, PassRows.of([90], [False])), by_i8)
    assert torch.equal(method.apply(layer, x, None), by_i8)   # outside any pass: the row count decides


@pytest.mark.parametrize("model", ["bf16", "float32", "float32 dense"])
@pytest.mark.parametrize("num_generation", [3, 20])
@pytest.mark.parametrize("num_prompt", [60, 30])
@pytest.mark.parametrize("projection", ["o_proj", "qkv_proj"])
def test_a_mixed_pass_computes_its_generation_rows_as_a_pass_of_their_own(kernel, model: str, num_generation: int,
                                                                        num_prompt: int, projection: str) -> None:
    """A prompt chunk among decode/verify rows: its rows take what the pass's row count routes them to
    (from I8_GEMM_FIRST_ROW on the int8 GEMM where the layer has it), and the generation rows come out bit for
    bit as a pass of only them gives (their count decides the routing): a bf16 model's rows kernel, a
    float32 model's VNNI kernel (3 rows) and, above its limit (20 rows), the path such a pass takes;
    the same on a KV projection (``I8_GEMM_SKIPPED``: the dense copy above the kernels' rows) and in a
    pass under I8_GEMM_FIRST_ROW. ``float32``: as apply_gguf_blocks builds a float32 model on a CPU
    with AVX512-BF16 (a bf16 dense dtype, the rows kernel, no dense copy but on KV projections);
    ``float32 dense``: on one without (no rows kernel, a float32 dense copy)."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    weight = block_weight(96, 256, 32, True, seed=12)
    method = (GGUFBlockLinearMethod(vnni, torch.float32, "int16", None, kernel) if model == "float32 dense"
              else GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, kernel))
    dtype = torch.bfloat16 if model == "bf16" else torch.float32
    layer = torch.nn.Module()
    method.process(layer, weight, int8_rows=projection not in I8_GEMM_SKIPPED)
    has_i8 = projection not in I8_GEMM_SKIPPED
    assert (layer.gguf_dense is not None) == (model == "float32 dense" or not has_i8)
    x = torch.randn(num_prompt + num_generation, 256,
                    generator=torch.Generator().manual_seed(num_generation)).to(dtype)
    # decode rows, a prompt chunk, then one more decode row
    counts = [1] * (num_generation - 1) + [num_prompt, 1]
    generation = [True] * (num_generation - 1) + [False, True]
    generation_rows = list(range(num_generation - 1)) + [num_generation - 1 + num_prompt]
    prompt = list(range(num_generation - 1, num_generation - 1 + num_prompt))
    for bias in (None, torch.randn(96, generator=torch.Generator().manual_seed(5)).to(dtype)):
        out = method.apply(layer, x, bias, PassRows.of(counts, generation))
        own = method.apply(layer, x[generation_rows], bias, PassRows.of([1] * num_generation, [True] * num_generation))
        by_count = method.apply(layer, x, bias)   # outside a pass: the row count alone decides
        assert out.dtype == own.dtype == dtype
        assert torch.equal(out[generation_rows], own)
        assert torch.equal(out[prompt], by_count[prompt])
        if has_i8 and num_prompt >= I8_GEMM_FIRST_ROW:
            by_i8 = kernel.i8_gemm(x, *layer.gguf_i8, 32, False, 96)
            by_i8 = (by_i8 if bias is None else by_i8 + bias).to(dtype)
            assert torch.equal(out[prompt], by_i8[prompt])
            assert not torch.equal(out[generation_rows], by_i8[generation_rows])


@pytest.mark.parametrize("model", ["bf16", "float32"])
def test_the_heads_generation_rows_are_a_pass_of_their_own(model: str) -> None:
    """The LM head's scope (the runner's: a pass's logit rows): 16 decode rows beside a prompt's last
    row are 17 rows, above the VNNI kernel's limit, where a float32 model's head takes the rows kernel
    as bf16; its decode rows still get the VNNI kernel's logits, as 16 decode rows alone do."""
    vnni, rows_kernel = load_vnni_kernel(), gguf_rows.load_kernel()
    if vnni is None or rows_kernel is None:
        pytest.skip("no VNNI or rows kernel here")
    method = GGUFBlockLinearMethod(vnni, torch.bfloat16, "int16", rows_kernel, gguf_i8gemm.load_kernel())
    head = torch.nn.Module()
    method.process(head, block_weight(96, 256, 32, False, seed=13), float_output=True)
    limit = KERNEL_MAX_ROWS["int16"]
    dtype = torch.bfloat16 if model == "bf16" else torch.float32
    x = torch.randn(limit + 1, 256, generator=torch.Generator().manual_seed(14)).to(dtype)
    counts = [1] * (limit + 1)   # a decode row each, but the prompt's last row in the middle
    generation = [row != limit // 2 for row in range(limit + 1)]
    decode_rows = [row for row in range(limit + 1) if row != limit // 2]
    logits = method.apply(head, x, None, PassRows.of(counts, generation))
    alone = method.apply(head, x[decode_rows], None, PassRows.of([1] * limit, [True] * limit))
    assert logits.dtype == alone.dtype == torch.float32
    assert torch.equal(logits[decode_rows], alone)
    assert torch.equal(logits[limit // 2], method.apply(head, x, None)[limit // 2])   # the prompt's row by count


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_float_residual_output_is_the_unrounded_result(kernel, with_bias: bool) -> None:
    """``float_residual_output`` (a bf16 model's o/down projections beside a float32 residual stream):
    every path returns its float32 result unrounded -- the decode call and the rows kernel for
    generation rows, the int8 GEMM for prompt rows, a mixed pass's fix-up -- which rounds to exactly
    what the layer gives without the flag."""
    method, layer, rows_kernel = bf16_block_layer(kernel, block_weight(96, 256, 32, True, seed=21))
    x = torch.randn(63, 256, generator=torch.Generator().manual_seed(22)).bfloat16()
    bias = torch.randn(96, generator=torch.Generator().manual_seed(23)).bfloat16() if with_bias else None

    def exact(rows: torch.Tensor, int8: bool) -> torch.Tensor:
        out = (kernel.i8_gemm(rows.contiguous(), *layer.gguf_i8, 32, False, 96) if int8
               else rows_kernel.rows_gemm(rows.contiguous(), *layer.gguf_packed, 32, False, 96))
        return out if bias is None else out + bias

    def both(rows: torch.Tensor, counts: list[int], generation: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for flag in (True, False):
            layer.float_residual_output = flag
            outs.append(method.apply(layer, rows, bias, PassRows.of(counts, generation)))
        return outs[0], outs[1]

    for m in (1, 3, 20):   # decode passes (1 row with a bias: the VNNI decode call adds it)
        unrounded, rounded = both(x[:m], [1] * m, [True] * m)
        assert unrounded.dtype == torch.float32 and rounded.dtype == torch.bfloat16
        assert torch.equal(unrounded.bfloat16(), rounded), m
        if bias is None or m > 1:
            assert torch.equal(unrounded, exact(x[:m], int8=False)), m
    unrounded, rounded = both(x[:60], [60], [False])   # a prompt chunk: the int8 GEMM
    assert torch.equal(unrounded, exact(x[:60], int8=True)) and torch.equal(unrounded.bfloat16(), rounded)
    unrounded, rounded = both(x, [1, 1, 60, 1], [True, True, False, True])   # mixed: the fix-up in float32
    generation_rows = [0, 1, 62]
    assert torch.equal(unrounded[generation_rows], exact(x[generation_rows], int8=False))
    assert torch.equal(unrounded[2:62], exact(x[2:62], int8=True))
    assert torch.equal(unrounded.bfloat16(), rounded)


# -- the AVX2 build in the layers: a float32 model on an AVX2 CPU -----------------------------------------

@pytest.fixture(scope="module")
def avx2_method() -> GGUFBlockLinearMethod:
    """A float32 model's method as apply_gguf_blocks makes it on an AVX2 CPU: the AVX2 block kernel, a float32
    dense copy, no rows kernel, the AVX2 build of the int8 GEMM; the constant ranking (int8 from
    I8_GEMM_FIRST_ROW prompt rows)."""
    from servelm.model.gguf import gguf_kernel
    kernels = (gguf_kernel.AVX2_KERNEL, gguf_i8gemm.AVX2_KERNEL)
    if any(kernel.missing_cpu_flags() for kernel in kernels):
        pytest.skip("no AVX2 + FMA + F16C here")
    block, i8 = (kernel.load() for kernel in kernels)
    if block is None or i8 is None:
        pytest.skip("the AVX2 builds do not build here")
    return GGUFBlockLinearMethod(block, torch.float32, "int16", None, i8)


def ranged_weight(n: int, k: int, codes: tuple[int, int], offsets: bool, seed: int) -> BlockWeight:
    """A block weight (block 32) whose codes lie in ``codes`` (a GGUF kind's range)."""
    generator = torch.Generator().manual_seed(seed)
    return BlockWeight(torch.randint(codes[0], codes[1] + 1, (n, k), dtype=torch.int8, generator=generator),
                       torch.rand(n, k // 32, generator=generator) * 1e-2,
                       torch.randn(n, k // 32, generator=generator) * 1e-2 if offsets else None, 32, "test")


@pytest.mark.parametrize("codes", [(-16, 15), (0, 15)])   # Q5_0's, Q4_K's (with offsets)
def test_a_float32_models_prompt_rows_take_the_avx2_int8_gemm(avx2_method: GGUFBlockLinearMethod,
                                                               codes: tuple[int, int]) -> None:
    """Prompt rows from I8_GEMM_FIRST_ROW take the AVX2 build on its own copy (u = code + bias); fewer rows,
    generation rows at any count (alone or beside a prompt chunk) and the LM head never do."""
    method = avx2_method
    weight = ranged_weight(96, 256, codes, codes[0] == 0, seed=30)
    layer, head = torch.nn.Module(), torch.nn.Module()
    method.process(layer, weight)
    method.process(head, weight, float_output=True)
    assert head.gguf_i8 is None and layer.gguf_i8 is not None
    assert layer.gguf_i8.call_kwargs == {"code_bias": -codes[0], "code_span": codes[1] - codes[0]}
    first = I8_GEMM_FIRST_ROW
    x = torch.randn(first + 20, 256, generator=torch.Generator().manual_seed(31))
    by_i8 = gguf_i8gemm.gemm(method.i8_kernel, x, layer.gguf_i8, 32, False, 96)
    assert_matches(by_i8, x, weight)
    assert torch.equal(method.apply(layer, x, None), by_i8)
    assert torch.equal(method.apply(layer, x[:first], None), by_i8[:first])
    fewer = method.apply(layer, x[:first - 1], None)
    assert not torch.equal(fewer, by_i8[:first - 1])
    torch.testing.assert_close(fewer, x[:first - 1] @ weight.dequantize(dtype=torch.float32).T, rtol=1e-4, atol=1e-4)
    decode = method.apply(layer, x, None, PassRows.of([1] * len(x), [True] * len(x)))
    assert not torch.equal(decode, by_i8)
    torch.testing.assert_close(decode, x @ weight.dequantize(dtype=torch.float32).T, rtol=1e-4, atol=1e-4)
    mixed = method.apply(layer, x, None, PassRows.of([1, first + 18, 1], [True, False, True]))
    generation = [0, first + 19]
    assert torch.equal(mixed[1:first + 19], by_i8[1:first + 19])
    assert torch.equal(mixed[generation], method.apply(layer, x[generation], None, PassRows.of([1, 1], [True, True])))
    assert not torch.equal(method.apply(head, x, None), by_i8)


def test_codes_wider_than_the_avx2_build_takes_keep_the_other_routes(avx2_method: GGUFBlockLinearMethod) -> None:
    """Q8_0's codes (-127 .. 127) would saturate vpmaddubsw's int16 pairs: such a layer holds no int8 copy
    and its shape is not an int8 one, so its prompt rows take the dense copy (or a kernel), unrounded."""
    method = avx2_method
    weight = ranged_weight(64, 256, (-127, 127), False, seed=32)
    assert not method.shape(weight).may_int8 and method.shape(ranged_weight(64, 256, (-64, 63), False, 33)).may_int8
    layer = torch.nn.Module()
    method.process(layer, weight)
    assert layer.gguf_i8 is None and layer.gguf_dense is not None
    x = torch.randn(I8_GEMM_FIRST_ROW + 5, 256, generator=torch.Generator().manual_seed(34))
    assert torch.equal(method.apply(layer, x, None), dense_linear(x, layer.gguf_dense))


def test_a_qkv_projections_queries_take_the_avx2_int8_gemm(avx2_method: GGUFBlockLinearMethod) -> None:
    """A merged QKV of Q5_0 queries and Q8_0 keys and values (Qwen2.5's and Gemma 3's GGUFs): from the first
    int8 row the queries come from the AVX2 build's copy of them alone, the keys and values from the dense
    copy, unrounded (the cache keeps them)."""
    from servelm.model.gguf.gguf_blocks import concat_rows
    method = avx2_method
    queries, keys_values = ranged_weight(64, 256, (-16, 15), False, 35), ranged_weight(32, 256, (-127, 127), False, 36)
    layer = torch.nn.Module()
    method.process(layer, concat_rows([queries, keys_values]), int8_rows=False, int8_lead=queries)
    assert layer.gguf_lead is not None and layer.gguf_lead[0] == 64 and layer.gguf_i8[0].shape[0] * 16 == 64
    x = torch.randn(I8_GEMM_FIRST_ROW + 3, 256, generator=torch.Generator().manual_seed(37))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(38))
    out = method.apply(layer, x, bias)
    assert torch.equal(out[:, :64], gguf_i8gemm.gemm(method.i8_kernel, x, layer.gguf_i8, 32, False, 64, bias=bias[:64]))
    assert torch.equal(out[:, 64:], dense_linear(x, layer.gguf_dense[64:]) + bias[64:])


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_qkv_projections_queries_take_the_avx2_int8_gemm_beside_the_float_tiles(
        avx2_method: GGUFBlockLinearMethod, with_bias: bool) -> None:
    """Where the layer's own prompt route is the block kernel's float tiles (no dense copy held), the queries
    take the int8 GEMM and the keys and values the tiles on the weight's rows after the queries: the bits
    the whole layer's call gives them (the bias added to their float32 result, as ``run_route`` adds it).
    Generation rows take the layer's routes whole."""
    from servelm.model.gguf.gguf_blocks import concat_rows
    from servelm.model.gguf.gguf_routes import Route
    from tests.unit.model.test_gguf_routes import complete
    method = GGUFBlockLinearMethod(avx2_method.kernel, torch.float32, "int16", None, avx2_method.i8_kernel,
                                   lambda shape, x_bf16, rows: complete([Route.INT8, Route.TILES, Route.BLOCK]))
    queries, keys_values = ranged_weight(64, 256, (-16, 15), False, 39), ranged_weight(38, 256, (-127, 127), False, 40)
    layer = torch.nn.Module()
    method.process(layer, concat_rows([queries, keys_values]), int8_rows=False, int8_lead=queries)
    assert layer.gguf_dense is None and layer.gguf_lead is not None and layer.gguf_lead[2] == {Route.TILES}
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(41))
    bias = torch.randn(102, generator=torch.Generator().manual_seed(42)) if with_bias else None
    out = method.apply(layer, x, bias, PassRows.of([40], [False]))
    whole = method.run_route(Route.TILES, layer, x, bias, False)
    assert torch.equal(out[:, :64], gguf_i8gemm.gemm(method.i8_kernel, x, layer.gguf_i8, 32, False, 64,
                                                     bias=None if bias is None else bias[:64]))
    assert torch.equal(out[:, 64:], whole[:, 64:]) and not torch.equal(out[:, :64], whole[:, :64])
    assert torch.equal(method.apply(layer, x, bias, PassRows.of([1] * 40, [True] * 40)), whole)


def test_the_screens_amx_gemm_keeps_the_same_candidates(kernel) -> None:
    """``i8_screen(..., amx=True)`` (the screen's GEMM on AMX tiles) gives the VNNI GEMM's candidates and counts
    bit for bit: the same int32 block dots and the same float32 epilogue, at every row count (padded row
    tiles), on a vocabulary ending inside a tile, a row that is not finite with none; a bound wide enough that
    rows keep many candidates, so that their upper bounds' last bits decide membership."""
    if not kernel.amx_permitted():
        pytest.skip("no AMX int8 tiles on this CPU (or not granted to the process)")
    weight = random_block_weight(1000, 256, 32, False, 7)   # 1,000 outputs: the last tile padded
    codes, scales, _ = gguf_i8gemm.screen_pack(kernel, weight)
    generator = torch.Generator().manual_seed(8)
    bound_max = torch.rand(1000, generator=generator) * 2
    bound_sum = bound_max * 4
    x = torch.randn(40, 256, generator=generator)
    x[6, 3] = float("nan")
    for m in (1, 7, 16, 17, 33, 40):
        rows = x[:m].contiguous()
        vnni = kernel.i8_screen(rows, codes, scales, 1000, bound_max, bound_sum, 0.5, 1000)
        tiles = kernel.i8_screen(rows, codes, scales, 1000, bound_max, bound_sum, 0.5, 1000, amx=True)
        assert len(tiles) == m + 1 and all(torch.equal(a, b) for a, b in zip(vnni, tiles)), m
        assert int(vnni[0].max()) > 3 and (m <= 6 or int(vnni[0][6]) == 0)
