"""The AVX2 + FMA build of the GGUF block linear (gguf_kernel_avx2.cpp) and the choice between builds.

The AVX2 build is forced where the CPU also has AVX-512 (``AVX2_KERNEL`` is compiled without any
AVX-512 flag; ``load_kernel(flags)`` hides features from the choice), so these tests run on every
x86 machine with AVX2. Each of its three functions is checked against its arithmetic in float64:
the dequantized weight times the activations rounded as the function rounds them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from servelm.model.cpp_kernel import CppKernel
from servelm.model.gguf import gguf_blocks, gguf_i8gemm, gguf_kernel
from servelm.model.gguf.gguf_blocks import REPACKABLE, BlockWeight, PackedCodes, concat_rows, repack
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
from servelm.model.gguf.gguf_routes import TILES_FIRST_ROW, Route, complete
from tests.unit.model.test_gguf_blocks import random_raw

AVX2 = {"avx2", "fma", "f16c"}


@pytest.fixture(scope="module")
def avx2() -> object:
    if gguf_kernel.AVX2_KERNEL.missing_cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(gguf_kernel.AVX2_KERNEL.missing_cpu_flags())}")
    module = gguf_kernel.AVX2_KERNEL.load()
    if module is None:
        pytest.skip(gguf_kernel.AVX2_KERNEL.status())
    return module


@pytest.fixture(autouse=True)
def kernel_loads() -> Iterator[None]:
    """A test here that forces other CPU flags (an AVX2-only CPU, no x86) loads kernels under them: a
    kernel first loaded then and found missing its flags is loaded afresh later, not kept unavailable
    for the rest of the session (the LM-head screen's tests after these found no int8 screen)."""
    unloaded = CppKernel.unloaded()
    yield
    CppKernel.forget_failed_loads(unloaded)


def rounded(x: torch.Tensor, qmax: float | None) -> torch.Tensor:
    """x as a rounding function sees it, in float64: per 32 inputs q = round(x * (1 / d)) with
    d = amax / qmax, all in float32 as the kernels compute it (None: unrounded)."""
    if qmax is None:
        return x.double()
    rows, cols = x.shape
    blocks = x.float().view(rows, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / qmax
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).double() * d.double()).view(rows, cols)


def reference(x: torch.Tensor, weight: BlockWeight, qmax: float | None) -> torch.Tensor:
    """The dequantized weight times rounded x, in float64; offsets multiply the unrounded sums."""
    rows, cols = x.shape
    out = rounded(x, qmax) @ weight.dequantize().double().T
    if weight.offsets is not None:   # dequantize() included them with rounded x: swap in unrounded sums
        n = weight.codes.shape[0]
        sums = x.double().view(rows, -1, weight.block).sum(-1)
        rounded_sums = rounded(x, qmax).view(rows, -1, weight.block).sum(-1)
        out += (sums - rounded_sums) @ weight.offsets.double().T
        assert out.shape == (rows, n)
    return out


MODES = {"block_linear_a16": 32512.0, "block_linear": 127.0, "block_linear_float": None}


@pytest.mark.parametrize("kind", sorted(REPACKABLE))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_avx2_kernel_matches_its_arithmetic(avx2: object, kind: str, rows: int) -> None:
    """Every block type gguf_blocks repacks, 1..16 rows, an odd number of outputs; float32 rows."""
    n, k = 37, 512
    weight = repack(random_raw(kind, n, k, seed=rows), (n, k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0   # an all-zero block: d = 0
    for name, qmax in MODES.items():
        out = getattr(avx2, name)(x, weight.codes, weight.scales, weight.offsets, weight.block)
        expected = reference(x, weight, qmax)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert (out.double() - expected).abs().max() <= 2e-6 * expected.abs().max(), name


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K", "Q4_1"])
def test_avx2_kernel_bf16_rows_bias_and_output(avx2: object, kind: str) -> None:
    """bf16 rows are widened exactly; a float32 or bf16 bias is added in float32 before the bf16
    rounding of ``bf16_out``."""
    n, k, rows = 45, 256, 4
    weight = repack(random_raw(kind, n, k), (n, k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    for bias in (None, torch.randn(n), torch.randn(n).bfloat16()):
        for name in MODES:
            run = getattr(avx2, name)
            unrounded = run(x.float(), weight.codes, weight.scales, weight.offsets, weight.block)
            assert torch.equal(run(x, weight.codes, weight.scales, weight.offsets, weight.block), unrounded)
            with_bias = run(x, weight.codes, weight.scales, weight.offsets, weight.block, False, bias)
            expected = unrounded if bias is None else unrounded + bias.float()
            torch.testing.assert_close(with_bias, expected, rtol=1e-6, atol=1e-6)
            as_bf16 = run(x, weight.codes, weight.scales, weight.offsets, weight.block, True, bias)
            assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, with_bias.bfloat16())


@pytest.mark.parametrize("name", ["block_linear_a16", "block_linear_float"])
def test_avx2_kernel_many_rows_and_threads(avx2: object, name: str) -> None:
    """Rows past the 8-row tile (one tile of 7; tails of 1, 2 and 1 after full tiles; float activations
    from 12 rows: dequantized weight tiles in 4 x 3 blocks, tails of 1-3 rows and 1-2 weight rows),
    weight rows split over threads; each row's outputs are those it gets alone (the tiles' interleaved
    activations; a float row alone takes the row tiles, not the weight tiles)."""
    n, k = 301, 1024
    weight = repack(random_raw("Q4_K", n, k, seed=3), (n, k), "Q4_K")
    run = getattr(avx2, name)
    for rows in (7, 9, 10, 12, 13, 33, 66):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        out = run(x, weight.codes, weight.scales, weight.offsets, weight.block)
        expected = reference(x, weight, MODES[name])
        assert (out.double() - expected).abs().max() <= 2e-6 * expected.abs().max()
        # each row alone gives the same numbers (no dependence on the batch)
        for row in range(rows):
            assert torch.equal(run(x[row:row + 1].contiguous(), weight.codes, weight.scales, weight.offsets,
                                   weight.block), out[row:row + 1]), (rows, row)


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q8_0"])
def test_tiles_route_reads_the_block_routes_codes(avx2: object, kind: str) -> None:
    """The tiles route (float activations on dequantized weight tiles) is held beside the int16 block
    route on the AVX2 build: it reads the codes (packed at their bit width where they fit) and the
    compact scales the block route keeps, with no copy of its own, and gives ``block_linear_float``'s
    outputs on the int8 codes bit for bit. A ranking that puts it first at every row count gets it from
    TILES_FIRST_ROW rows (the kernel's own first row of the tiles), the block route below (so one row
    keeps the block route's prepared call); the LM head keeps off it up to HEAD_SCREEN_ROWS rows."""
    assert avx2.FLOAT_TILE_ROWS == TILES_FIRST_ROW
    n, k = 96, 512
    weight = repack(random_raw(kind, n, k, seed=4), (n, k), kind)
    codes, scales, offsets = weight.codes.clone(), weight.scales.clone(), weight.offsets
    method = GGUFBlockLinearMethod(avx2, torch.float32, "int16", ranking=lambda shape, x_bf16, rows: complete(
        [Route.TILES, Route.BLOCK]))
    layer = nn.Module()
    method.process(layer, weight, model_dtype=torch.float32)
    routes = layer.gguf_routes
    assert routes.held == {Route.BLOCK, Route.TILES} and layer.gguf_dense is None
    assert routes.pick(11, False, False) is Route.BLOCK and routes.pick(12, False, True) is Route.TILES
    assert layer.gguf_decode_args   # the 1-row route's prepared call: the block kernel
    assert (weight.packed is not None) == (kind != "Q8_0")
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(2))
    assert torch.equal(method.apply(layer, x, None), avx2.block_linear_float(x, codes, scales, offsets, weight.block))
    assert torch.equal(method.apply(layer, x[:5], None),
                       avx2.block_linear_a16(x[:5].contiguous(), codes, scales, offsets, weight.block))
    head = nn.Module()
    method.process(head, repack(random_raw(kind, n, k, seed=5), (n, k), kind), float_output=True,
                   model_dtype=torch.float32)
    assert head.gguf_routes.pick(16, False, False) is Route.BLOCK
    assert head.gguf_routes.pick(17, False, False) is Route.TILES


def test_avx2_kernel_refuses_bad_arguments(avx2: object) -> None:
    weight = repack(random_raw("Q8_0", 4, 64), (4, 64), "Q8_0")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        avx2.block_linear_a16(torch.randn(1, 48), weight.codes[:, :48].contiguous(), weight.scales[:, :1].contiguous(),
                              None, 32)
    with pytest.raises(RuntimeError, match="block must be 16 or 32"):
        avx2.block_linear_a16(torch.randn(1, 64), weight.codes, weight.scales, None, 8)


PACKED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": None}


@pytest.mark.parametrize("kind", sorted(REPACKABLE))
def test_packed_codes_are_lossless(kind: str) -> None:
    """Each type's codes pack at their own width (Q8_0's stay bytes) and unpack to the same codes,
    whole or by rows; a fused weight packs at its widest part's width."""
    n, k = 6, 512
    weight = repack(random_raw(kind, n, k, seed=2), (n, k), kind)
    packed = PackedCodes.of(weight.codes)
    assert (packed.bits if packed is not None else None) == PACKED_BITS[kind]
    if packed is None:
        return
    assert packed.data.dtype == torch.uint8 and packed.data.shape == (n, k * packed.bits // 8)
    assert packed.centered == (int(weight.codes.min()) < 0)
    assert torch.equal(packed.unpack(), weight.codes)
    assert torch.equal(packed.unpack(torch.tensor([4, 1])), weight.codes[[4, 1]])
    dropped = BlockWeight(weight.codes.clone(), weight.scales, weight.offsets, weight.block, kind, packed)
    assert dropped.drop_codes() == n * k and dropped.stored_codes is None
    assert dropped.shape == (n, k) and torch.equal(dropped.dequantize(), weight.dequantize())


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_K", "Q6_K"])
def test_packed_codes_in_row_chunks_are_the_same(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed REPACK_ROWS rows at a time (here 4, a part chunk last), the bytes are the whole
    weight's packed at once."""
    n, k = 10, 256
    weight = repack(random_raw(kind, n, k, seed=3), (n, k), kind)
    whole = PackedCodes.of(weight.codes)
    monkeypatch.setattr(gguf_blocks, "REPACK_ROWS", 4)
    chunked = PackedCodes.of(weight.codes)
    assert whole is not None and chunked is not None
    assert torch.equal(chunked.data, whole.data) and torch.equal(chunked.unpack(), weight.codes)


def test_fused_weight_packs_at_its_widest_width() -> None:
    parts = [repack(random_raw(kind, 4, 256, seed=1), (4, 256), kind) for kind in ("Q4_K", "Q6_K")]
    fused = concat_rows(parts)
    packed = PackedCodes.of(fused.codes)
    assert packed is not None and packed.bits == 6 and packed.centered
    assert torch.equal(packed.unpack(), fused.codes)


@pytest.mark.parametrize("kind", sorted(kind for kind, bits in PACKED_BITS.items() if bits))
def test_packed_kernel_equals_the_int8_code_kernel(avx2: object, kind: str) -> None:
    """The packed functions compute the int8-code functions' outputs bit for bit: both activation
    roundings and float activations (``packed_float`` and the int8 codes' function alike: row tiles
    below 12 rows, weight tiles from 12), 1, 3, 5, 9 (a last row tile of one: the int8
    codes' one-row pass at row 8), 16 and 33 rows, float32 and bf16 rows, with and without a bias,
    float32 and bf16 out; 300 outputs split over threads."""
    n, k = 300, 512
    weight = repack(random_raw(kind, n, k, seed=5), (n, k), kind)
    packed = PackedCodes.of(weight.codes)
    assert packed is not None
    suffix = "_centered" if packed.centered else ""
    generator = torch.Generator().manual_seed(11)
    for rows in (1, 3, 5, 9, 16, 33):
        x32 = torch.randn(rows, k, generator=generator)
        for x in (x32, x32.bfloat16()):
            for bias in (None, torch.randn(n, generator=generator)):
                for plain, name in (("block_linear_a16", "packed_a16"), ("block_linear", "packed_a8"),
                                    ("block_linear_float", "packed_float")):
                    for bf16_out in (False, True):
                        expected = getattr(avx2, plain)(x, weight.codes, weight.scales, weight.offsets,
                                                        weight.block, bf16_out, bias)
                        out = getattr(avx2, name + suffix)(x, packed.data, weight.scales, weight.offsets,
                                                           weight.block, bf16_out, bias)
                        assert torch.equal(out, expected), (rows, x.dtype, bias is None, name, bf16_out)
                        # one row (the one-row pass: 4, 2, 1 weight rows at a time, stored codes less a
                        # correction) as that row of a many-row call (row tiles)
                        alone = getattr(avx2, name + suffix)(x[-1:].contiguous(), packed.data, weight.scales,
                                                             weight.offsets, weight.block, bf16_out, bias)
                        assert torch.equal(alone, out[-1:])


def test_packed_kernel_refuses_codes_of_another_width(avx2: object) -> None:
    weight = repack(random_raw("Q4_0", 4, 256), (4, 256), "Q4_0")
    packed = PackedCodes.of(weight.codes)
    assert packed is not None
    with pytest.raises(RuntimeError, match="not 4, 5 or 6 bits"):
        avx2.packed_a16_centered(torch.randn(1, 256), packed.data[:, :100].contiguous(), weight.scales, None, 32)
    with pytest.raises(RuntimeError, match="uint8"):
        avx2.packed_a16_centered(torch.randn(1, 256), packed.data.view(torch.int8), weight.scales, None, 32)


COMPACT_LAYOUT = {"Q8_0": torch.float16, "Q4_0": torch.float16, "Q5_0": torch.float16, "Q4_1": torch.float16,
                  "Q5_1": torch.float16, "Q4_K": torch.int8, "Q5_K": torch.int8, "Q6_K": torch.int8}
"""The layout ``with_compact`` gives each type's scales: fp16 (d), or int8 sub-scales x d per 256 inputs."""


def compact_cases() -> list[tuple[str, BlockWeight]]:
    """Every repackable type (K 512; the fp16 types also at K 896: 28 blocks, a tail past 8 at a
    time), fused weights of mixed types, rows taken and inputs cut along super-blocks."""
    cases = [(kind, repack(random_raw(kind, 37, 512, seed=4), (37, 512), kind)) for kind in sorted(REPACKABLE)]
    cases += [(kind + " K896", repack(random_raw(kind, 21, 896, seed=6), (21, 896), kind))
              for kind in ("Q8_0", "Q5_0", "Q4_1")]
    k_quants = [repack(random_raw(kind, 9, 512, seed=8), (9, 512), kind) for kind in ("Q4_K", "Q6_K", "Q5_K")]
    cases.append(("Q4_K+Q6_K+Q5_K", concat_rows(k_quants)))
    cases.append(("Q5_0+Q8_0", concat_rows([repack(random_raw(kind, 8, 512, seed=9), (8, 512), kind)
                                            for kind in ("Q5_0", "Q8_0")])))
    cases.append(("Q4_K rows", k_quants[0].permute_rows(torch.tensor([5, 0, 3]))))
    cases.append(("Q4_K inputs", k_quants[0].narrow(1, 256, 256)))
    return cases


@pytest.mark.parametrize("case", range(len(compact_cases())))
def test_compact_scales_give_the_float32_outputs_bit_for_bit(avx2: object, case: int) -> None:
    """The compact scales and offsets (fp16; int8 sub-scales x a float32 per 256 inputs) widen to the
    float32 values exactly, and every function of the build computes with them the float32 scales'
    outputs bit for bit: the three activation formats on int8 codes and on packed codes, 1
    (weight rows 4 at a time, then 2 and 1), 3 and 16 rows, float32 and bf16 rows, a bias, bf16 out."""
    name, weight = compact_cases()[case]
    scales, offsets = weight.with_compact()
    kind = weight.kind.split("+")[0]
    expected_layout = torch.int8 if "+" in name and "K" in name else COMPACT_LAYOUT[kind]
    assert scales.dtype == expected_layout, name
    assert offsets is None or offsets.dtype == scales.dtype, name
    assert scales.nbytes < weight.scales.nbytes
    packed = PackedCodes.of(weight.codes)
    n, k = weight.shape
    generator = torch.Generator().manual_seed(case)
    functions = [(name_, weight.codes) for name_ in MODES]
    if packed is not None:
        suffix = "_centered" if packed.centered else ""
        functions += [(prefix + suffix, packed.data) for prefix in ("packed_a16", "packed_a8", "packed_float")]
    for rows in (1, 3, 16):
        x32 = torch.randn(rows, k, generator=generator)
        for x in (x32, x32.bfloat16()):
            bias = torch.randn(n, generator=generator)
            for function, codes in functions:
                run = getattr(avx2, function)
                for extra in ((), (True,), (False, bias)):
                    expected = run(x, codes, weight.scales, weight.offsets, weight.block, *extra)
                    out = run(x, codes, scales, offsets, weight.block, *extra)
                    assert torch.equal(out, expected), (name, function, rows, x.dtype, extra)


def test_compact_scales_keep_float32_where_no_layout_is_exact(avx2: object) -> None:
    """Scales that are neither fp16 values nor sub-scaled stay float32; the kernel refuses a compact
    layout of the wrong width."""
    weight = repack(random_raw("Q4_K", 4, 256), (4, 256), "Q4_K")
    odd = BlockWeight(weight.codes, weight.scales * 1.1, weight.offsets, weight.block, "Q4_K")
    scales, _ = odd.with_compact()
    assert scales is odd.scales
    with pytest.raises(RuntimeError, match="int8"):
        avx2.block_linear_a16(torch.randn(1, 256), weight.codes, weight.with_compact()[0][:, :-1].contiguous(),
                              None, weight.block)
    with pytest.raises(RuntimeError, match="float16"):
        avx2.block_linear_a16(torch.randn(1, 256), weight.codes, weight.scales.half()[:, :4].contiguous(), None,
                              weight.block)


def test_avx2_equals_avx512_where_both_build(avx2: object) -> None:
    """Where the CPU has AVX512-VNNI too, both builds compute the same integers: equal up to the
    float32 summation order (16 against 8 lanes: a few ulps of a sum of 512 products)."""
    avx512 = gguf_kernel.KERNEL.load() if not gguf_kernel.KERNEL.missing_cpu_flags() else None
    if avx512 is None:
        pytest.skip("no AVX512-VNNI build here")
    for kind in sorted(REPACKABLE):
        weight = repack(random_raw(kind, 40, 512), (40, 512), kind)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
        for name in MODES:
            args = (x, weight.codes, weight.scales, weight.offsets, weight.block)
            torch.testing.assert_close(getattr(avx2, name)(*args), getattr(avx512, name)(*args),
                                       rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_the_build_follows_the_cpu_flags(avx2: object) -> None:
    """AVX512-VNNI picks the AVX-512 build first, AVX2 + FMA + F16C alone the AVX2 build (compiled
    with no AVX-512 flag), no x86 vector flags no build at all (nothing compiled)."""
    assert gguf_kernel.candidates(AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}) == [
        gguf_kernel.KERNEL, gguf_kernel.AVX2_KERNEL]
    assert gguf_kernel.candidates(AVX2 | {"avx512f"}) == [gguf_kernel.AVX2_KERNEL]
    assert not any("avx512" in flag for flag in gguf_kernel.AVX2_KERNEL.compile_flags)
    assert gguf_kernel.load_kernel(AVX2) is avx2 and avx2.ISA == "avx2"
    assert "AVX2+FMA" in gguf_kernel.kernel_status(AVX2)
    assert gguf_kernel.candidates(set()) == [] and gguf_kernel.load_kernel(set()) is None
    assert gguf_kernel.kernel_status({"avx2"}).startswith("this CPU lacks ")
    assert gguf_kernel.missing_cpu_flags({"avx2"}) == ["fma", "f16c"]


# -- dispatch: the engine on a tiny quantized GGUF with the CPU's flags hidden or not -----------------

KERNEL_MODULES = ("servelm.model.gguf.gguf_kernel", "servelm.model.attention.paged_decode",
                  "servelm.model.attention.prefill_attention", "servelm.model.layers.fused",
                  "servelm.model.gguf.lm_head_screen", "servelm.model.gguf.gguf_rows",
                  "servelm.model.gguf.gguf_i8gemm")


def packed_layers(model: torch.nn.Module) -> dict[str, tuple[str, int, bool]]:
    """name -> (GGUF kind, bits, int8 codes dropped) of every layer whose block route reads packed codes."""
    return {name: (module.gguf_weight.kind, module.gguf_weight.packed.bits, module.gguf_weight.stored_codes is None)
            for name, module in model.named_modules()
            if getattr(module, "gguf_weight", None) is not None and module.gguf_weight.packed is not None}


def greedy(model_path: Path, quantization: str = "auto", layers: dict[str, object] | None = None,
           compact: set[torch.dtype] | None = None) -> tuple[list[int], object]:
    """Greedy tokens of a short request and the LM head's method; ``layers`` gets ``packed_layers``,
    ``compact`` the dtypes of the scales the layers' prepared decode calls read."""
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    engine = LLMEngine(EngineConfig.from_flat(dict(model=str(model_path), skip_tokenizer_init=True,
                                                   quantization=quantization, num_threads=1,
                                                   max_total_tokens=512)))
    try:
        engine.add_request("0", [3, 17, 42, 5, 9], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
        if layers is not None:
            layers.update(packed_layers(engine.runner.model))
        if compact is not None:
            compact.update(module.__dict__["gguf_decode_args"][2].dtype for module in engine.runner.model.modules()
                           if module.__dict__.get("gguf_decode_args"))
        return tokens, engine.runner.model.lm_head.__dict__.get("linear_method")
    finally:
        engine.shutdown()


def test_no_x86_features_compiles_nothing_x86_and_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every CPU flag hidden (a non-x86 CPU), no kernel that needs an x86 instruction is chosen,
    the plain C++ ones are compiled without any -m flag, ``auto`` dequantizes the GGUF, and the engine
    serves it through the torch routes: the same greedy tokens as ``--quantization none``."""
    import importlib

    from servelm.distributed.parallel import ParallelContext
    from servelm.model.gguf.gguf_weights import resolve_quantization
    from tests.unit.model.test_gguf_blocks import write_quantized_llama

    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    expected, _ = greedy(path, "none")
    monkeypatch.setattr("servelm.model.loader.cpu_flags", lambda: set())
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for kernel in getattr(module, "KERNELS", (module.KERNEL,)):
            flags = kernel._compile_flags(set()) if callable(kernel._compile_flags) else kernel._compile_flags
            assert kernel.missing_cpu_flags() or not any(flag.startswith("-m") for flag in flags), kernel.name
    assert gguf_kernel.load_kernel() is None
    mode, reason = resolve_quantization("auto", str(path), ParallelContext.single(), torch.device("cpu"), False)
    assert mode == "none" and "avx2, fma, f16c" in reason
    tokens, method = greedy(path)
    assert method is None and tokens == expected and len(tokens) == 8


def test_avx2_cpu_serves_the_gguf_blocks_on_the_avx2_build(avx2: object, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with AVX2 + FMA and no AVX-512 (forced where it has more): ``auto`` keeps the GGUF
    blocks on the AVX2 build for few rows (the float32 dense copy above), and its greedy tokens are
    the dequantized model's on this tiny model."""
    from tests.unit.model.test_gguf_blocks import write_quantized_llama

    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    expected, _ = greedy(path, "none")
    monkeypatch.setattr("servelm.model.loader.cpu_flags", lambda: AVX2 | {"sse4_2", "avx"})
    packed: dict[str, object] = {}
    compact: set[torch.dtype] = set()
    tokens, method = greedy(path, layers=packed, compact=compact)
    assert method is not None and getattr(method.kernel, "ISA", "") == "avx2"
    assert method.dense_dtype == torch.float32 and method.rows_kernel is None
    assert gguf_i8gemm.is_avx2(method.i8_kernel)   # prompt rows may take the AVX2 build of the int8 GEMM
    # the block route reads packed codes (Q8_0's stay bytes), the int8 copies dropped, and fp16 scales
    assert method.packs and {kinds for kinds in packed.values()} == {("Q4_0", 4, True), ("Q5_0+Q4_1", 5, True)}
    assert method.compact_scales and compact == {torch.float16}
    assert tokens == expected


def test_the_faster_build_serves_and_the_choice_is_cached(avx2: object, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where both builds load (an AVX512-VNNI CPU), the build whose one-row pass over the model's
    linears is faster serves the block route (the timing is made to favour one, then the other):
    the AVX2 build on packed codes, beside the rows kernel and the int8 GEMM where the CPU has them;
    the greedy tokens are the dequantized model's either way; a second start reads the choice
    from the cache, and a build that lost leaves no packed copy behind."""
    from servelm.model import routes as route_table
    from servelm.model.gguf import block_builds
    from tests.unit.model.test_gguf_blocks import write_quantized_llama

    avx512 = gguf_kernel.KERNEL.load() if not gguf_kernel.KERNEL.missing_cpu_flags() else None
    if avx512 is None:
        pytest.skip("one build only here: nothing to choose")
    monkeypatch.setattr(route_table, "CACHE_DIR", tmp_path / "routes")
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    expected, _ = greedy(path, "none")
    _, method = greedy(path)   # a model that fits the cache: the preferred build, not timed
    assert method.kernel is avx512
    assert not any("GGUF block kernel build" in table.read_text() for table in (tmp_path / "routes").glob("*.json"))
    monkeypatch.setattr(block_builds, "MIN_TIMED_BYTES", 0)
    i8 = gguf_i8gemm.load_kernel() if not gguf_i8gemm.missing_cpu_flags() else None
    for faster in (avx2, avx512):
        monkeypatch.setattr(block_builds, "time_candidates",
                            lambda candidates, **_: {name: 1.0 if name == faster.__name__ else 2.0
                                                     for name in candidates})
        packed: dict[str, object] = {}
        tokens, method = greedy(path, layers=packed)
        assert method.kernel is faster and method.i8_kernel is i8 and tokens == expected
        assert bool(packed) == (faster is avx2)   # the AVX-512 build reads int8 codes: none kept packed

        def fail(*args: object, **kwargs: object) -> None:
            raise AssertionError("a cached choice was measured again")

        monkeypatch.setattr(block_builds, "time_candidates", fail)
        again, method = greedy(path)
        assert method.kernel is faster and again == expected
        for choice in (tmp_path / "routes").iterdir():   # the next pass measures anew
            if "GGUF block kernel build" in choice.read_text():
                choice.unlink()


def test_tune_measures_the_routes_and_the_build_again(avx2: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``servelm tune MODEL`` measures every route cell anew (none read from the cache) and the block
    kernel's build where both builds load and the model is timed, and prints both; the table it
    saves is the one the next start reads."""
    from servelm import cli
    from servelm.model import routes as route_table
    from servelm.model.gguf import block_builds
    from tests.unit.model.test_gguf_blocks import write_quantized_llama

    monkeypatch.setattr(route_table, "CACHE_DIR", tmp_path / "routes")
    monkeypatch.setattr(block_builds, "MIN_TIMED_BYTES", 0)
    both = gguf_kernel.KERNEL.load() is not None and not gguf_kernel.KERNEL.missing_cpu_flags()
    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    for _ in range(2):   # the second run measures again: nothing comes from the first one's files
        cli.main(["tune", str(path), "--num-threads", "1"])
        out = capsys.readouterr().out
        assert "block kernel build: " in out and "measured in" in out and " cells from " not in out
        assert ("fastest one-row pass" in out and "measured, saved to" in out) if both else "the only build" in out
        assert "rows " in out and "layer 64x" in out   # the table: one line per shape
    saved = [json.loads(p.read_text()) for p in (tmp_path / "routes").glob("*.json")]
    assert any(table["cells"] and "kernels" in table["key"] for table in saved)
    assert any("one-row pass" in table["cells"] for table in saved) == both


def test_gathered_weights_feed_the_one_call_mlp_half(avx2: object, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On the AVX2 build a float32 Llama's one-row steps take ``DecodeMlp`` (a native object that keeps
    its weights' addresses): it is made after the flat plan has gathered those weights onto huge pages
    (the size floor lifted for this tiny model), so it reads the moved memory, and the greedy tokens
    stay the dequantized model's."""
    from servelm.model import huge_pages
    from servelm.model.architectures import llama_decode
    from tests.unit.model.test_gguf_blocks import write_quantized_llama

    path = tmp_path / "tiny-q.gguf"
    write_quantized_llama(path)
    expected, _ = greedy(path, "none")
    monkeypatch.setattr("servelm.model.loader.cpu_flags", lambda: AVX2 | {"sse4_2", "avx"})
    monkeypatch.setattr(gguf_kernel, "load_kernel", lambda: avx2)
    monkeypatch.setattr(huge_pages, "GATHER_MIN_BYTES", 0)
    events: list[str] = []   # "gather <moved>" and "mlp" (a DecodeMlp built), in order
    original_gather = huge_pages.gather_on_huge_pages

    def recorded_gather(tensors: list[torch.Tensor]) -> tuple[int, int]:
        result = original_gather(tensors)
        events.append(f"gather {result[0]}")
        return result

    monkeypatch.setattr("servelm.model.architectures.flat_decode.gather_on_huge_pages", recorded_gather)
    mlp_calls: list[int] = []
    original_mlp = llama_decode.decode_mlp

    def counted(plan: object, dtype: torch.dtype, norms: list[torch.Tensor]) -> object:
        run = original_mlp(plan, dtype, norms)
        events.append("mlp")
        return None if run is None else (lambda *args: (mlp_calls.append(1), run(*args))[1])

    monkeypatch.setattr(llama_decode, "decode_mlp", counted)
    tokens, _ = greedy(path)
    assert events[0].startswith("gather") and events[0] != "gather 0" and mlp_calls
    assert "mlp" in events and all(event == "mlp" for event in events[1:])   # every DecodeMlp made after it
    assert tokens == expected
