"""The paged decode attention kernel against gather + SDPA, on a pool laid out in blocks.

Every kernel test runs on each build this CPU can run (``kernel``: the AVX-512 build and the AVX2
build, which an AVX-512 machine runs too), so CI on any x86 CPU with AVX2 tests the AVX2 build."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import paged_decode
from servelm.model.cpp_kernel import CppKernel


@pytest.fixture(scope="module", params=paged_decode.KERNELS, ids=lambda build: build.name)
def kernel(request: pytest.FixtureRequest) -> ModuleType:
    build: CppKernel = request.param
    if build.missing_cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(build.missing_cpu_flags())}")
    module = build.load()
    if module is None:
        pytest.skip(build.status())
    return module


def pool_case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, spans: list[int],
              columns: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, K and V pools of 64 blocks of 4 slots, and each sequence's slots scattered over them."""
    torch.manual_seed(seed)
    b, block_size = len(spans), 4
    num_slots = max(64 * block_size, b * columns)   # every sequence's columns take distinct slots
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim).to(dtype)
    v_pool = torch.randn_like(k_pool)
    slots = torch.randperm(num_slots)[:b * columns].view(b, columns)
    q = torch.randn(b, num_heads, head_dim).to(dtype)
    return q, k_pool, v_pool, slots, torch.tensor(spans)


def gathered_sdpa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                  spans: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch path's arithmetic in float32: the context gathered and padded, SDPA with GQA folded."""
    q, k_pool, v_pool = q.float(), k_pool.float(), v_pool.float()
    (b, columns), (num_heads, head_dim), num_kv_heads = slots.shape, q.shape[1:], k_pool.shape[1]
    k = k_pool[slots.flatten()].view(b, columns, num_kv_heads, head_dim).transpose(1, 2)
    v = v_pool[slots.flatten()].view(b, columns, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(columns)[None, :] < spans[:, None])[:, None, None, :]
    group = num_heads // num_kv_heads
    return F.scaled_dot_product_attention(q.view(b, num_kv_heads, group, head_dim), k, v,
                                          attn_mask=mask, scale=scale).reshape(b, num_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 1, 32), (6, 2, 32), (2, 2, 32), (14, 2, 64),
                                                             (7, 1, 128)])
def test_kernel_matches_sdpa(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             kernel: ModuleType) -> None:
    """Mixed spans (1 to the whole padded width), GQA groups of 1-7 heads, both pool dtypes."""
    q, k_pool, v_pool, slots, spans = pool_case(num_heads, num_kv_heads, head_dim, dtype,
                                                [12, 1, 7, 12, 3, 9], 12, 0)
    out = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.3, kernel)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2   # bf16: the output's rounding
    torch.testing.assert_close(out.float(), gathered_sdpa(q, k_pool, v_pool, slots, spans, 0.3),
                               atol=tolerance, rtol=tolerance)


def test_the_avx2_build_takes_head_dims_of_8_lanes() -> None:
    """head_dim 24 (8-lane multiples, not 16): the AVX2 build computes it, the AVX-512 build refuses."""
    avx2 = paged_decode.load_kernel({"avx2", "fma"})
    if avx2 is None:
        pytest.skip(paged_decode.kernel_status({"avx2", "fma"}))
    assert avx2.ISA == "avx2" and avx2.LANES == 8
    q, k_pool, v_pool, slots, spans = pool_case(6, 2, 24, torch.float32, [5, 17, 1], 17, 2)
    assert paged_decode.supports(q, k_pool, avx2)
    out = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.2, avx2)
    torch.testing.assert_close(out, gathered_sdpa(q, k_pool, v_pool, slots, spans, 0.2), atol=1e-5, rtol=1e-5)
    wide = paged_decode.load_kernel({"avx512f"})
    if wide is not None:
        assert wide.LANES == 16 and not paged_decode.supports(q, k_pool, wide)


def test_the_builds_agree_up_to_float32_rounding() -> None:
    """On an AVX-512 CPU: the 8-lane build's floats are the 16-lane build's up to its sums' order."""
    builds = [build.load() for build in paged_decode.KERNELS if not build.missing_cpu_flags()]
    if len(builds) < 2 or None in builds:
        pytest.skip("needs both builds (an AVX-512 CPU)")
    for dtype in (torch.float32, torch.bfloat16):
        case = pool_case(14, 2, 64, dtype, [40, 1, 23, 64, 17], 64, 3)
        wide, narrow = (paged_decode.attend(*case, 0.125, module) for module in builds)
        torch.testing.assert_close(narrow.float(), wide.float(), atol=2e-6, rtol=2e-6)


def test_the_build_follows_the_cpu_flags() -> None:
    """AVX-512F picks the 16-lane build, AVX2 + FMA alone the 8-lane one (compiled without any AVX-512
    flag), neither no build: the backend keeps the torch path."""
    avx2 = {"avx2", "fma"}
    assert paged_decode.BUILDS.candidates(avx2 | {"avx512f"}) == [paged_decode.KERNEL, paged_decode.AVX2_KERNEL]
    assert paged_decode.BUILDS.candidates(avx2) == [paged_decode.AVX2_KERNEL]
    assert not any("avx512" in flag for flag in paged_decode.AVX2_KERNEL.compile_flags)
    assert paged_decode.BUILDS.candidates({"avx2"}) == [] and paged_decode.load_kernel({"avx2"}) is None
    assert paged_decode.missing_cpu_flags({"avx2"}) == ["fma"]
    assert paged_decode.kernel_status(set()).startswith("this CPU lacks avx512f and avx2, fma")


def test_supports_only_float32_or_bf16_and_whole_vectors() -> None:
    pool = torch.zeros(8, 1, 32)
    assert not paged_decode.supports(torch.zeros(1, 2, 32, dtype=torch.float16), pool)
    assert not paged_decode.supports(torch.zeros(1, 2, 32), pool.to(torch.float8_e4m3fn))
    assert not paged_decode.supports(torch.zeros(1, 2, 12), torch.zeros(8, 1, 12))
    assert paged_decode.supports(torch.zeros(1, 2, 32), pool) == (paged_decode.load_kernel() is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (4, 1, 256), (14, 2, 64), (9, 3, 64), (16, 1, 32), (12, 2, 128), (7, 7, 16)])
def test_tiled_kernel_equals_plain_bit_for_bit(num_heads: int, num_kv_heads: int, head_dim: int,
                                               dtype: torch.dtype, kernel: ModuleType,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every head-group size (1-8 per chunk, 16 in two chunks), D not a multiple of 64, spans
    that leave a partial tile of columns: the tiled arrangement computes the same floats."""
    q, k_pool, v_pool, slots, spans = pool_case(num_heads, num_kv_heads, head_dim, dtype,
                                                [23, 1, 2, 3, 5, 22], 23, 1)
    q = q.float()
    tiled = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.125, kernel)
    monkeypatch.setattr(paged_decode, "TILED", False)
    plain = paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.125, kernel)
    assert torch.equal(tiled, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (4, 1, 256), (9, 3, 64)])
def test_the_values_chunks_keep_the_floats(num_heads: int, num_kv_heads: int, head_dim: int,
                                           dtype: torch.dtype, kernel: ModuleType,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Contexts longer than the values pass's chunk of columns (VALUE_COLUMNS): a span of exactly one
    chunk, one column past it, two chunks and a part, beside short ones. The partial sums kept in the
    output between chunks give the plain arrangement's floats, and SDPA's up to rounding."""
    chunk = kernel.VALUE_COLUMNS
    spans = [2 * chunk + 44, chunk, chunk + 1, 1, 3 * chunk - 1]
    q, k_pool, v_pool, slots, span_tensor = pool_case(num_heads, num_kv_heads, head_dim, dtype, spans, max(spans), 5)
    q = q.float()
    tiled = paged_decode.attend(q, k_pool, v_pool, slots, span_tensor, 0.125, kernel)
    torch.testing.assert_close(tiled, gathered_sdpa(q, k_pool, v_pool, slots, span_tensor, 0.125),
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(paged_decode, "TILED", False)
    assert torch.equal(tiled, paged_decode.attend(q, k_pool, v_pool, slots, span_tensor, 0.125, kernel))


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (6, 2, 32)])
def test_write_and_attend_equals_index_copy_then_attend(num_heads: int, num_kv_heads: int, head_dim: int,
                                                        dtype: torch.dtype, tiled: bool, kernel: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The one call the flat decode path makes, on q, k, v as views of a QKV projection's rows (q read
    in place where float32): the pools written as two ``index_copy_`` write them, and the output equal
    bit for bit to ``attend`` after them, in q's dtype."""
    monkeypatch.setattr(paged_decode, "TILED", tiled)
    spans = [23, 1, 5]
    _, k_pool, v_pool, slots, span_tensor = pool_case(num_heads, num_kv_heads, head_dim, dtype, spans, 23, 2)
    rows = len(spans)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split_with_sizes([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k, v = (q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim),
               v.view(rows, num_kv_heads, head_dim))
    slot_mapping = slots[torch.arange(rows), span_tensor - 1].contiguous()   # each sequence's newest column
    k_expected, v_expected = k_pool.clone(), v_pool.clone()
    k_expected.index_copy_(0, slot_mapping, k)
    v_expected.index_copy_(0, slot_mapping, v)
    expected = paged_decode.attend(q, k_expected, v_expected, slots, span_tensor, 0.125, kernel).view(rows, -1)
    out = paged_decode.write_and_attend(q, k, v, k_pool, v_pool, slot_mapping, slots, span_tensor, 0.125, kernel)
    assert out.dtype == dtype and out.shape == (rows, num_heads * head_dim)
    assert torch.equal(out, expected)
    assert torch.equal(k_pool, k_expected) and torch.equal(v_pool, v_expected)
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode.write_and_attend(q, k, v, k_pool, v_pool, slot_mapping + k_pool.shape[0], slots, span_tensor,
                                      0.125, kernel)



@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (6, 2, 32)])
def test_write_and_attend_qkv_equals_it_on_the_views(num_heads: int, num_kv_heads: int, head_dim: int,
                                                      dtype: torch.dtype, tiled: bool, kernel: ModuleType,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The QKV rows whole (a row stride past their width, as a narrowed output gives): the same pools
    and the same floats as ``write_and_attend`` on their q, k, v views."""
    monkeypatch.setattr(paged_decode, "TILED", tiled)
    spans = [23, 1, 5]
    _, k_pool, v_pool, slots, span_tensor = pool_case(num_heads, num_kv_heads, head_dim, dtype, spans, 23, 3)
    rows, width = len(spans), (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(rows, width + 16).to(dtype)[:, :width]
    q, k, v = qkv.split_with_sizes([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k, v = (q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim),
               v.view(rows, num_kv_heads, head_dim))
    slot_mapping = slots[torch.arange(rows), span_tensor - 1].contiguous()
    k_expected, v_expected = k_pool.clone(), v_pool.clone()
    expected = paged_decode.write_and_attend(q, k, v, k_expected, v_expected, slot_mapping, slots, span_tensor, 0.125,
                                             kernel)
    out = paged_decode.write_and_attend_qkv(qkv, num_heads, k_pool, v_pool, slot_mapping, slots, span_tensor, 0.125,
                                            kernel)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(k_pool, k_expected) and torch.equal(v_pool, v_expected)
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode.write_and_attend_qkv(qkv, num_heads, k_pool, v_pool, slot_mapping + k_pool.shape[0], slots,
                                          span_tensor, 0.125, kernel)
    with pytest.raises(RuntimeError, match="H \\+ 2 Hkv"):
        paged_decode.write_and_attend_qkv(qkv, num_heads + 1, k_pool, v_pool, slot_mapping, slots, span_tensor,
                                          0.125, kernel)

class CountingBuild:
    """A build whose ``decode_attention`` and ``write_and_attend`` calls are counted (its ISA and lanes
    as they are)."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.ISA, self.LANES, self.calls = module, module.ISA, module.LANES, 0

    def decode_attention(self, *args: object) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.module.decode_attention(*args)
        return out

    def write_and_attend(self, *args: object) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.module.write_and_attend(*args)
        return out

    def write_and_attend_qkv(self, *args: object) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.module.write_and_attend_qkv(*args)
        return out


@pytest.fixture
def forced_avx2(monkeypatch: pytest.MonkeyPatch) -> CountingBuild:
    """The AVX2 build as the one this CPU takes (also on an AVX-512 CPU), its calls counted."""
    module = paged_decode.load_kernel({"avx2", "fma"})
    if module is None:
        pytest.skip(paged_decode.kernel_status({"avx2", "fma"}))
    build = CountingBuild(module)
    monkeypatch.setattr(paged_decode, "load_kernel", lambda flags=None: build if flags is None else module)
    return build


def test_the_module_path_decodes_on_the_avx2_build(forced_avx2: CountingBuild,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 tiny Llama (GQA 4/2, head_dim 16) through torch_native: every decode step's every
    layer takes the kernel, and the logits equal the gather + SDPA path's within float32 tolerance."""
    from tests.tiny_models import make_tiny_hf_model
    from tests.unit.model.conftest import make_runner, make_source, prompts_for
    from tests.unit.model.test_flat_decode import STEPS, runner_decode_logits

    hf_model = make_tiny_hf_model("llama")
    prompts = prompts_for("llama", hf_model.config.vocab_size)[:3]
    prompts[1] = prompts[1] * 5                      # mixed context lengths in one decode group
    on_kernel = runner_decode_logits(make_runner(make_source(hf_model)), prompts)
    assert forced_avx2.calls == STEPS * hf_model.config.num_hidden_layers
    monkeypatch.setattr(paged_decode, "load_kernel", lambda flags=None: None)
    on_torch = runner_decode_logits(make_runner(make_source(hf_model)), prompts)
    for step, (kernel_logits, torch_logits) in enumerate(zip(on_kernel, on_torch)):
        torch.testing.assert_close(kernel_logits, torch_logits, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_the_flat_decode_path_takes_the_avx2_build(forced_avx2: CountingBuild,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 tiny Qwen2 on block weights through the flat decode plan: its attention is the AVX2
    build's, bit-identical to the module path's (which takes the same build)."""
    from servelm.model.architectures.llama_decode import LlamaDecodePlan
    from servelm.model.layers import fused
    from servelm.model.gguf import gguf_kernel
    from tests.tiny_models import make_tiny_hf_model
    from tests.unit.model.test_flat_decode import check_flat_against_modules, decode_logits

    if gguf_kernel.load_kernel() is None or fused.load_kernel() is None:
        pytest.skip("the flat decode path needs the GGUF block kernel and the fused ops")
    hf_model = make_tiny_hf_model("qwen2")
    check_flat_against_modules(LlamaDecodePlan, 3, lambda: decode_logits(hf_model, "qwen2", 3), monkeypatch)
    assert forced_avx2.calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_kernel_is_the_same_at_every_thread_count(dtype: torch.dtype, kernel: ModuleType) -> None:
    """The threads take (sequence, segment) tasks from a shared counter (servelm_parallel.h): how many
    threads there are, and which tasks each one takes, never changes a result bit."""
    q, k_pool, v_pool, slots, spans = pool_case(12, 2, 64, dtype, [23, 1, 17, 3, 5, 22, 9, 14, 2], 23, 4)
    q = q.float()
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(paged_decode.attend(q, k_pool, v_pool, slots, spans, 0.125, kernel))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], gathered_sdpa(q, k_pool, v_pool, slots, spans, 0.125),
                               atol=2e-5, rtol=1e-4)
    for result in results[1:]:
        assert torch.equal(result, results[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (4, 1, 256), (9, 3, 64), (2, 2, 32)])
def test_long_contexts_in_segments(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                   kernel: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contexts past a segment (SEGMENT_COLUMNS): one column past it, whole segments, a part past three,
    beside one column. Each segment's softmax and values are merged in order: SDPA's result up to
    rounding; the plain arrangement's floats; and a sequence's floats are its own, whether it is
    attended alone (its heads then split over the threads) or in the batch, at any thread count."""
    segment = kernel.SEGMENT_COLUMNS
    spans = [segment + 1, 2 * segment, 1, 3 * segment + 77, segment]
    q, k_pool, v_pool, slots, span_tensor = pool_case(num_heads, num_kv_heads, head_dim, dtype, spans, max(spans), 6)
    q = q.float()
    tiled = paged_decode.attend(q, k_pool, v_pool, slots, span_tensor, 0.125, kernel)
    torch.testing.assert_close(tiled, gathered_sdpa(q, k_pool, v_pool, slots, span_tensor, 0.125),
                               atol=2e-5, rtol=1e-4)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for i in (0, 3):
                alone = paged_decode.attend(q[i:i + 1], k_pool, v_pool, slots[i:i + 1], span_tensor[i:i + 1], 0.125,
                                            kernel)
                assert torch.equal(alone, tiled[i:i + 1]), f"row {i} alone at {count} threads"
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(paged_decode, "TILED", False)
    assert torch.equal(tiled, paged_decode.attend(q, k_pool, v_pool, slots, span_tensor, 0.125, kernel))
