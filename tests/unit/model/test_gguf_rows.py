"""The AVX512-BF16 rows kernel (gguf_rows.cpp) against a float64 reference of code x scale (+ offset)
weights, and the routing of a bf16 model's GGUF layers and LM head to it."""

from __future__ import annotations

import pytest
import torch

from servelm.model.gguf import gguf_rows
from servelm.model.gguf.gguf_blocks import BlockWeight, SubScaled, tile_outputs
from servelm.model.gguf.gguf_kernel import load_kernel
from servelm.model.gguf.gguf_linear import BF16_KERNEL_MAX_ROWS, GGUFBlockLinearMethod, RowsCopies, decode_rows
from servelm.model.gguf.gguf_routes import MAX_ROWS_RESOLVED, ROWS_KERNEL_LAST_ROW, Route

ROWS_KERNEL_ROWS = {"layers": (1, ROWS_KERNEL_LAST_ROW), "head": (1, None)}
"""The default routes' rows kernel spans (gguf_routes.default_ranking)."""
DECODE_ROWS = BF16_KERNEL_MAX_ROWS["int16"]
"""A bf16 layer's block kernel reach under the default routes (no rows kernel)."""
from tests.tiny_models import random_block_weight as block_weight


@pytest.fixture(scope="module")
def rows_kernel():
    module = gguf_rows.load_kernel()
    if module is None:
        pytest.skip(f"no rows kernel here: {gguf_rows.kernel_status()}")
    return module


def reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """x @ W.T in float64 with W = code x scale (+ offset) in float64."""
    n, k = weight.codes.shape
    w = weight.codes.double().view(n, -1, weight.block) * weight.scales.double()[..., None]
    if weight.offsets is not None:
        w = w + weight.offsets.double()[..., None]
    return x.double() @ w.reshape(n, k).T


def relative_error(out: torch.Tensor, x: torch.Tensor, weight: BlockWeight, code_bias: float = 0.0) -> float:
    """Largest |out - reference| over the largest sum of |w x| (the scale summation error lives on),
    with ``code_bias`` added to every |code| (the rows GEMM's biased codes sum terms of |code| + 192)."""
    n, k = weight.codes.shape
    w = ((weight.codes.double().abs() + code_bias).view(n, -1, weight.block) * weight.scales.double()[..., None]).abs()
    if weight.offsets is not None:
        w = w + weight.offsets.double().abs()[..., None]
    magnitude = x.double().abs() @ w.reshape(n, k).T
    return float(((out.double() - reference(x, weight)).abs() / magnitude.clamp_min(1e-30)).max())


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("offsets", [False, True])
def test_rows_kernel_matches_the_float64_reference_for_every_m(rows_kernel, block: int, offsets: bool) -> None:
    weight = block_weight(37, 192, block, offsets, seed=block + offsets)   # odd N: a short last tile
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    for m in range(1, 65):
        out = rows_kernel.rows_linear(x[:m].contiguous(), weight.codes, weight.scales, weight.offsets, block)
        assert out.dtype == torch.float32 and out.shape == (m, 37)
        assert relative_error(out, x[:m], weight) < 1e-6, m
        # each row is computed on its own: the same values whatever the other rows are
        assert torch.equal(out, rows_kernel.rows_linear(x[:m].contiguous(), weight.codes, weight.scales,
                                                        weight.offsets, block)[:m])
        if m in (1, 5, 64):
            assert torch.equal(out[-1:], rows_kernel.rows_linear(x[m - 1:m].contiguous(), weight.codes,
                                                                 weight.scales, weight.offsets, block))


def test_rows_kernel_bf16_output_is_the_float32_result_rounded(rows_kernel) -> None:
    weight = block_weight(70, 640, 32, False, seed=5)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(2)).bfloat16()
    full = rows_kernel.rows_linear(x, weight.codes, weight.scales, None, 32)
    assert torch.equal(rows_kernel.rows_linear(x, weight.codes, weight.scales, None, 32, True), full.bfloat16())


def test_rows_kernel_is_more_exact_than_the_dense_bf16_copy(rows_kernel) -> None:
    """The dense copy rounds code x scale to bf16; the kernel keeps it exact in float32."""
    weight = block_weight(256, 640, 32, False, seed=6)
    x = torch.randn(8, 640, generator=torch.Generator().manual_seed(3)).bfloat16()
    kernel_error = relative_error(rows_kernel.rows_linear(x, weight.codes, weight.scales, None, 32), x, weight)
    dense = torch.nn.functional.linear(x.float(), weight.dequantize(dtype=torch.bfloat16).float())
    assert kernel_error < 1e-6 < relative_error(dense, x, weight)


def test_rows_kernel_rejects_what_it_cannot_run(rows_kernel) -> None:
    weight = block_weight(8, 96, 32, False, seed=7)   # K = 96: not a multiple of 64
    with pytest.raises(RuntimeError, match="multiple of 64"):
        rows_kernel.rows_linear(torch.zeros(2, 96, dtype=torch.bfloat16), weight.codes, weight.scales, None, 32)
    weight = block_weight(8, 128, 32, False, seed=7)
    with pytest.raises(RuntimeError, match="bfloat16"):
        rows_kernel.rows_linear(torch.zeros(2, 128), weight.codes, weight.scales, None, 32)


def test_rows_kernel_needs_avx512_bf16() -> None:
    flags = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"}   # every AVX-512 CPU has FMA
    assert gguf_rows.missing_cpu_flags(flags) == ["avx512_bf16"]
    assert gguf_rows.missing_cpu_flags(flags | {"avx512_bf16"}) == []


def packed(weight: BlockWeight, rows_kernel, form: str = "int8"):
    return gguf_rows.pack(weight.codes, weight.scales, weight.offsets, rows_kernel.GEMM_COLS, form in BIT_FORMS)


CODE_FORMS = {"int8": (torch.int8, 5, 0.0), "biased": (torch.uint8, 5, 192.0), "nibbles": (torch.uint8, 3, 128.0),
              "five_bits": (torch.uint8, 3, 144.0), "six_bits": (torch.uint8, 3, 160.0)}
"""The packed codes' forms (gguf_rows.pack): dtype, dimensions and the bias their summation carries."""
FORM_RANGES = {"biased": gguf_rows.BIASED_CODES, "nibbles": gguf_rows.NIBBLE_CODES, "five_bits": gguf_rows.FIVE_BIT_CODES,
               "six_bits": gguf_rows.SIX_BIT_CODES}
BIT_FORMS = {"nibbles": "Q4_1", "five_bits": "Q5_0", "six_bits": "Q6_K"}
"""The ``packed`` route's forms (``pack(..., bits=True)``), with a GGUF type whose codes they hold."""


def in_form(weight: BlockWeight, form: str) -> BlockWeight:
    """``weight`` with codes that pack in ``form``: its random int8 codes moved into the form's range
    (``FORM_RANGES``: Q6_K's, Q5_0's, Q4_K's), that range's extremes included."""
    if form == "int8":
        return weight
    low, high = FORM_RANGES[form]
    codes = (weight.codes.to(torch.int16) * (high - low + 1) // 256 + (low + high + 1) // 2).to(torch.int8)
    codes[0, :2] = torch.tensor((low, high), dtype=torch.int8)
    assert low <= int(codes.min()) and int(codes.max()) <= high
    return BlockWeight(codes, weight.scales, weight.offsets, weight.block, BIT_FORMS.get(form, "test"))


def fp16_scaled(weight: BlockWeight) -> BlockWeight:
    """``weight`` with every scale and offset rounded to an fp16 value (as Q8_0's, Q5_0's, Q4_1's are)."""
    offsets = weight.offsets.half().float() if weight.offsets is not None else None
    return BlockWeight(weight.codes, weight.scales.half().float(), offsets, weight.block, weight.kind)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("form", list(CODE_FORMS))
@pytest.mark.parametrize("fp16", [False, True])
def test_rows_gemm_matches_the_float64_reference_for_every_m(rows_kernel, block: int, offsets: bool,
                                                            form: str, fp16: bool) -> None:
    """Every form of codes, with float32 scales, or fp16 ones where every scale is an fp16 value."""
    weight = block_weight(37, 192, block, offsets, seed=block + offsets)   # N = 37: a padded last tile
    weight = in_form(weight, form)
    if fp16:
        weight = fp16_scaled(weight)
    codes, scales, offs = packed(weight, rows_kernel, form)
    dtype, dims, bias = CODE_FORMS[form]
    assert codes.dtype == dtype and codes.dim() == dims
    assert scales.dtype == (torch.float16 if fp16 else torch.float32)
    assert offs is None or offs.dtype == scales.dtype
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    for m in range(1, 71):
        out = rows_kernel.rows_gemm(x[:m].contiguous(), codes, scales, offs, block, False, 37)
        assert out.dtype == torch.float32 and out.shape == (m, 37)
        assert relative_error(out, x[:m], weight, bias) < 1e-6, m
        # each row is computed on its own, whatever group of rows it falls in
        assert torch.equal(out[-1:], rows_kernel.rows_gemm(x[m - 1:m].contiguous(), codes, scales, offs, block,
                                                           False, 37)), m
        assert torch.equal(rows_kernel.rows_gemm(x[:m].contiguous(), codes, scales, offs, block, True, 37),
                           out.bfloat16()), m


@pytest.mark.parametrize("block,offsets", [(16, False), (32, True)])
@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_rows_act_is_gate_up_then_act_and_mul_bit_for_bit(rows_kernel, block: int, offsets: bool, form: str) -> None:
    """``rows_act`` (a gated MLP's gate_up with act(gate) * up in its epilogue) gives the bits of the
    rows kernel's bf16 gate_up output then fused_ops' ``act_and_mul``, for SiLU and GELU tanh, any row
    count (1-8 rows in one group, more in several), every form of codes; a row's result does not
    depend on the rows beside it; it refuses what it cannot fuse."""
    from servelm.model.layers import fused

    ops = fused.load_kernel()
    if ops is None:
        pytest.skip("no fused ops kernel here")
    weight = in_form(block_weight(128, 192, block, offsets, seed=11), form)   # gate 64 outputs, up 64
    codes, scales, offs = packed(weight, rows_kernel, form)
    x = (torch.randn(20, 192, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    for kind in (0, 1):
        for m in (1, 3, 8, 9, 20):
            rows = x[:m].contiguous()
            expected = ops.act_and_mul(rows_kernel.rows_gemm(rows, codes, scales, offs, block, True, 128), kind)
            actual = rows_kernel.rows_act(rows, codes, scales, offs, block, kind)
            assert actual.dtype == torch.bfloat16 and actual.shape == (m, 64)
            assert torch.equal(actual, expected), (kind, m)
            assert torch.equal(actual[-1:], rows_kernel.rows_act(x[m - 1:m].contiguous(), codes, scales, offs, block,
                                                                 kind)), (kind, m)
    with pytest.raises(RuntimeError, match="act"):   # a gate half that ends inside a tile
        half = in_form(block_weight(96, 192, block, offsets, seed=11), form)
        rows_kernel.rows_act(x[:2].contiguous(), *packed(half, rows_kernel, form), block, 0)
    with pytest.raises(RuntimeError, match="act"):
        rows_kernel.rows_act(x[:2].contiguous(), codes, scales, offs, block, 2)


@pytest.mark.parametrize("block,offsets", [(16, False), (32, True), (32, False)])
@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_amx_gemm_is_the_dense_bf16_copys_product_row_by_row(rows_kernel, block: int, offsets: bool, form: str) -> None:
    """``amx_gemm`` (the ``amx`` route) computes x @ W.T with W the dense copy's bf16 weights
    (``BlockWeight.dequantize`` to bf16, bit for bit) from every form of the rows kernel's copy: within float32
    summation of that product, each row's result that of a call of that row alone (padded row tiles
    included), the bf16 output the float32 one rounded, a bias added before the rounding, act(gate) * up
    as gate_up's bf16 output then ``act_and_mul`` gives it."""
    from servelm.model.layers import fused

    if not gguf_rows.amx_ready(rows_kernel):
        pytest.skip("no AMX bf16 tiles on this CPU (or not granted to the process)")
    weight = in_form(block_weight(64, 256, block, offsets, seed=block + offsets), form)
    codes, scales, offs = packed(weight, rows_kernel, form)
    dense = weight.dequantize(dtype=torch.bfloat16).double()
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    magnitude = x.double().abs() @ dense.abs().T
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    for m in (1, 7, 16, 17, 33, 40):
        rows = x[:m].contiguous()
        out = rows_kernel.amx_gemm(rows, codes, scales, offs, block, False, 64)
        assert out.dtype == torch.float32 and out.shape == (m, 64)
        assert float(((out.double() - rows.double() @ dense.T).abs() / magnitude[:m].clamp_min(1e-30)).max()) < 1e-6, m
        assert torch.equal(out[-1:], rows_kernel.amx_gemm(x[m - 1:m].contiguous(), codes, scales, offs, block, False, 64))
        assert torch.equal(rows_kernel.amx_gemm(rows, codes, scales, offs, block, True, 64), out.bfloat16())
        assert torch.equal(rows_kernel.amx_gemm(rows, codes, scales, offs, block, True, 64, bias),
                           (out + bias).bfloat16())
    ops = fused.load_kernel()
    if ops is not None:
        for kind in (0, 1):
            gate_up = rows_kernel.amx_gemm(x, codes, scales, offs, block, True, 64)
            assert torch.equal(rows_kernel.amx_gemm(x, codes, scales, offs, block, True, 64, None, kind),
                               ops.act_and_mul(gate_up, kind))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        short = in_form(block_weight(64, 16 * 3, 16, False, seed=1), form)
        rows_kernel.amx_gemm(torch.zeros(2, 48).bfloat16(), *packed(short, rows_kernel, form), 16, False, 64)


@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_the_prefetch_setting_changes_no_result(rows_kernel, form: str) -> None:
    """``set_nta_prefetch`` (the route table's measured choice) changes only how a one-group call's codes
    are prefetched: the same bits either way, at one row group and several."""
    weight = in_form(block_weight(64, 256, 32, True, seed=5), form)
    codes, scales, offs = packed(weight, rows_kernel, form)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    before = rows_kernel.nta_prefetch()
    try:
        results = []
        for nta in (True, False):
            rows_kernel.set_nta_prefetch(nta)
            assert rows_kernel.nta_prefetch() is nta
            results.append([rows_kernel.rows_gemm(x[:m].contiguous(), codes, scales, offs, 32, False, 64) for m in (1, 8, 20)])
        assert all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        rows_kernel.set_nta_prefetch(before)


def test_rows_gemm_streams_large_results_and_takes_every_packed_output(rows_kernel) -> None:
    """A result of >= 4 MiB is written with non-temporal stores: the same values."""
    weight = block_weight(33_000, 64, 32, False, seed=9)
    codes, scales, _ = packed(weight, rows_kernel)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = rows_kernel.rows_gemm(x, codes, scales, None, 32, False, 33_000)
    assert relative_error(out, x, weight) < 1e-6
    assert torch.equal(out[:3], rows_kernel.rows_gemm(x[:3].contiguous(), codes, scales, None, 32, False, 33_000))
    # n = -1: every packed output, the padding's zeros included
    whole = rows_kernel.rows_gemm(x[:2].contiguous(), codes, scales, None, 32)
    assert whole.shape == (2, codes.shape[0] * rows_kernel.GEMM_COLS * 16)
    assert torch.equal(whole[:, :33_000], out[:2]) and not whole[:, 33_000:].any()


@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_bf16_layers_and_head_take_the_rows_kernel_in_its_row_range(rows_kernel, form: str) -> None:
    kernel = load_kernel()
    if kernel is None:
        pytest.skip("no VNNI kernel here")
    weight = in_form(block_weight(64, 256, 32, True, seed=8), form)
    route = Route.PACKED if form in BIT_FORMS else Route.ROWS

    def ranking(shape, x_bf16, rows):   # the default ranking, with the packed route where it has rows
        swap = {Route.ROWS: route, route: Route.ROWS}
        return tuple(swap.get(r, r) for r in method.default_ranking(shape, x_bf16, rows))

    method = GGUFBlockLinearMethod(kernel, torch.bfloat16, "int16", rows_kernel, ranking=ranking)
    layer, head = torch.nn.Module(), torch.nn.Module()
    method.process(layer, weight)
    method.process(head, weight, float_output=True)
    assert head.gguf_routes.shape.is_head and head.gguf_dense is None and layer.gguf_dense is not None
    codes, scales, offsets = layer.gguf_packed if route is Route.ROWS else layer.gguf_bits
    assert (codes.dtype, codes.dim()) == CODE_FORMS[form][:2]
    for module, role in ((layer, "layers"), (head, "head")):
        first, last = ROWS_KERNEL_ROWS[role]
        for m in (first - 1, first, 5, 33, last, (last or 64) + 1):
            if m is None or m < 1:
                continue
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
            out = method.apply(module, x, None)
            assert out.dtype == (torch.float32 if role == "head" else torch.bfloat16)
            by_gemm = rows_kernel.rows_gemm(x, codes, scales, offsets, 32, role == "layers", 64)
            takes = first <= m and (last is None or m <= last)
            assert torch.equal(out, by_gemm) == takes, (role, m)
        # float32 rows (a float32 model) never take it
        x = torch.randn(first, 256)
        assert torch.equal(method.apply(module, x, None),
                           kernel.block_linear_a16(x, weight.codes, weight.scales, weight.offsets, 32))
    # a layer's prepared decode call is the GEMM (in the prepared call's argument order), up to the layers' last row
    assert layer.gguf_decode_args[0] is rows_kernel.rows_call
    assert decode_rows(layer.gguf_decode_args) == ROWS_KERNEL_ROWS["layers"][1]
    # a bias goes on top of the GEMM's float32 result
    bias = torch.randn(64).bfloat16()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(method.apply(layer, x, bias),
                       (rows_kernel.rows_gemm(x, codes, scales, offsets, 32, False, 64) + bias).bfloat16())
    assert torch.equal(method.apply(layer, x[:1], bias),   # one row: the prepared call with the bias
                       (rows_kernel.rows_gemm(x[:1], codes, scales, offsets, 32, False, 64) + bias).bfloat16())


def test_without_the_rows_kernel_the_decode_call_is_the_vnni_kernel() -> None:
    kernel = load_kernel()
    if kernel is None:
        pytest.skip("no VNNI kernel here")
    weight = block_weight(48, 256, 32, False, seed=10)
    method = GGUFBlockLinearMethod(kernel, torch.bfloat16, "int16", None)
    layer = torch.nn.Module()
    method.process(layer, weight)
    assert layer.gguf_packed is None and decode_rows(layer.gguf_decode_args) == DECODE_ROWS
    x = torch.randn(DECODE_ROWS, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(method.apply(layer, x, None),
                       kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32, True))


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_rows_gemm_is_the_same_at_every_thread_count(rows_kernel, offsets: bool, form: str) -> None:
    """The threads take units of the call from a shared counter (servelm_parallel.h): how many threads
    there are, and so which units each one computes, never changes a result bit."""
    weight = in_form(block_weight(32 * 97 + 5, 128, 32, offsets, seed=3), form)   # 98 tiles: units of several sizes
    codes, scales, offs = packed(weight, rows_kernel, form)
    assert (codes.dtype, codes.dim()) == CODE_FORMS[form][:2]
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(rows_kernel.rows_gemm(x, codes, scales, offs, 32, False, weight.shape[0]))
    finally:
        torch.set_num_threads(threads)
    assert relative_error(results[0], x, weight, CODE_FORMS[form][2]) < 1e-6
    for result in results[1:]:
        assert torch.equal(result, results[0])


@pytest.mark.parametrize("form", list(CODE_FORMS))
def test_unpack_codes_inverts_every_pack_form(form: str) -> None:
    """``gguf_rows.unpack_codes`` (the torch references' view of the packed copy) gives back the tiled
    int8 codes from each form ``pack`` makes (no kernel needed)."""
    weight = in_form(block_weight(45, 96, 32, False, seed=11), form)
    codes, _, _ = gguf_rows.pack(weight.codes, weight.scales, None, 2, form in BIT_FORMS)
    assert (codes.dtype, codes.dim()) == CODE_FORMS[form][:2]
    tiled, _, _ = tile_outputs(weight.codes, weight.scales, None, 2, group=2)
    assert torch.equal(gguf_rows.unpack_codes(codes), tiled)


def test_one_prepared_call_takes_both_copies_by_row_count(rows_kernel) -> None:
    """A layer whose table sends 1-4 rows to the ``packed`` route and more to ``rows`` keeps both
    copies; its prepared decode call reaches every row of either (the flat decode plan stays on past
    4 rows) and gives, at each row count, exactly what the layer's own routing gives."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip("no VNNI kernel here")
    weight = in_form(block_weight(64, 256, 32, True, seed=9), "nibbles")

    def ranking(shape, x_bf16, rows):
        first = Route.PACKED if rows <= 4 else Route.ROWS
        return (first, *(r for r in method.default_ranking(shape, x_bf16, rows) if r is not first))

    method = GGUFBlockLinearMethod(kernel, torch.bfloat16, "int16", rows_kernel, ranking=ranking)
    layer = torch.nn.Module()
    method.process(layer, weight)
    assert layer.gguf_packed is not None and layer.gguf_bits is not None
    call = layer.gguf_decode_args
    assert isinstance(call[0], RowsCopies) and decode_rows(call) == MAX_ROWS_RESOLVED
    for m in (1, 4, 5, 8, 33, 100):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        kernel_fn, codes, scales, offsets, block = call
        out = kernel_fn(x, codes, scales, offsets, block, True)
        assert torch.equal(out, method.apply(layer, x, None)), m
        copy = layer.gguf_bits if m <= 4 else layer.gguf_packed
        assert torch.equal(out, rows_kernel.rows_gemm(x, *copy, 32, True, 64)), m


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["biased", "six_bits"])
def test_rows_gemm_adds_a_bias_before_the_rounding(rows_kernel, bias_dtype: torch.dtype, form: str) -> None:
    """A bias is added in float32 before any bf16 rounding: exactly torch's ``out + bias`` then ``.to``
    (what the module path computed around the kernel); ``rows_call`` is the same call in a prepared
    decode call's argument order."""
    weight = in_form(block_weight(64, 192, 16, False, seed=13), form)
    codes, scales, offs = packed(weight, rows_kernel, form)
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(6)).bfloat16()
    bias = (torch.randn(64, generator=torch.Generator().manual_seed(7)) * 4).to(bias_dtype)
    for m in (1, 2, 9, 11):
        rows = x[:m].contiguous()
        plain = rows_kernel.rows_gemm(rows, codes, scales, offs, 16, False, 64)
        expected = plain + bias
        assert torch.equal(rows_kernel.rows_gemm(rows, codes, scales, offs, 16, False, 64, bias), expected), m
        assert torch.equal(rows_kernel.rows_gemm(rows, codes, scales, offs, 16, True, 64, bias), expected.bfloat16()), m
        assert torch.equal(rows_kernel.rows_call(rows, codes, scales, offs, 16, True, bias), expected.bfloat16()), m
        assert torch.equal(rows_kernel.rows_call(rows, codes, scales, offs, 16, True), plain.bfloat16()), m


def sub_scaled_weight(form: str, offsets: bool, seed: int) -> BlockWeight:
    """A K-quant-like weight (K = 512: two super-blocks) whose scales (and offsets) are int8
    sub-scales times a float32 multiplier per 256 inputs, as the file's Q4_K/Q6_K headers give them."""
    generator = torch.Generator().manual_seed(seed)
    block = 16 if form == "six_bits" else 32
    n, k = 45, 512
    base = in_form(block_weight(n, k, block, False, seed=seed), form)

    def factors(low: int, high: int) -> SubScaled:
        sub = torch.randint(low, high + 1, (n, k // block), dtype=torch.int8, generator=generator)
        return SubScaled(sub, torch.rand(n, k // 256, generator=generator) * 1e-3 + 1e-5)

    scale_factors = factors(-32, 31) if form == "six_bits" else factors(0, 63)
    offset_factors = factors(0, 63) if offsets else None
    return BlockWeight(base.codes, scale_factors.values(), offset_factors.values() if offsets else None, block,
                       BIT_FORMS[form], scale_factors=scale_factors, offset_factors=offset_factors)


@pytest.mark.parametrize(("form", "offsets"), [("six_bits", False), ("nibbles", True), ("nibbles", False)])
def test_the_packed_copy_holds_k_quant_scales_as_sub_scales(rows_kernel, form: str, offsets: bool) -> None:
    """The ``packed`` route's copy of a K-quant holds its int8 sub-scales and float32 multipliers per
    256 inputs (when they give the scales bit for bit): the same results, bit for bit, as the float32
    scales, in ~0.1 instead of 0.25 bytes a weight; the byte copy keeps float32 scales."""
    weight = sub_scaled_weight(form, offsets, seed=21)
    factors = (weight.scale_factors, weight.offset_factors)
    codes, scales, offs = gguf_rows.pack(weight.codes, weight.scales, weight.offsets, 2, True, factors)
    assert scales.dtype == torch.int8 and scales.shape == (2, 512 // weight.block + 4 * 2, 2, 16)
    assert offs is None if not offsets else (offs.dtype == torch.int8 and offs.shape == scales.shape)
    plain = gguf_rows.pack(weight.codes, weight.scales, weight.offsets, 2, True)
    assert plain[1].dtype == torch.float32 and scales.nbytes < plain[1].nbytes / 2
    assert gguf_rows.pack(weight.codes, weight.scales, weight.offsets, 2, False, factors)[1].dtype == torch.float32
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    for m in (1, 2, 5, 20):
        out = rows_kernel.rows_gemm(x[:m].contiguous(), codes, scales, offs, weight.block, False, 45)
        assert torch.equal(out, rows_kernel.rows_gemm(x[:m].contiguous(), *plain, weight.block, False, 45)), m
        assert relative_error(out, x[:m], weight, CODE_FORMS[form][2]) < 1e-6, m
    # factors that do not give the scales bit for bit are not used
    wrong = SubScaled(weight.scale_factors.sub, weight.scale_factors.multipliers * 1.5)
    assert gguf_rows.pack(weight.codes, weight.scales, weight.offsets, 2, True,
                          (wrong, weight.offset_factors))[1].dtype == torch.float32
