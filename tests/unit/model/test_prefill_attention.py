"""The prefill attention kernels against SDPA in float64 on the same inputs: the AVX512-BF16 one on bf16
inputs, the float32 one (FMA tiles, AVX2) on float32 inputs.

Tolerance: the bf16 kernel rounds probabilities to bf16 before P.V (as the GEMM path does) and its
output to bf16 once, so each output element is within 2e-2 absolute of the reference for unit-scale
q/k/v (observed: under 1e-2), and its mean error is under 2e-3. The float32 kernel sums in float32
(a different order than SDPA's): within 2e-5 (observed: ~2e-6), mean under 2e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import prefill_attention

BF16 = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    bool(prefill_attention.KERNEL.missing_cpu_flags()), reason="this CPU lacks AVX512-BF16"))
F32 = pytest.param(torch.float32, id="f32", marks=pytest.mark.skipif(
    bool(prefill_attention.F32_KERNEL.missing_cpu_flags()), reason="this CPU lacks AVX2 and FMA"))
DTYPES = [BF16, F32]
TOLERANCE = {torch.bfloat16: (2e-2, 2e-3), torch.float32: (2e-5, 2e-6)}
"""dtype -> (largest, mean) absolute error against the float64 reference."""


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_builds_where_the_cpu_has_its_instructions(dtype: torch.dtype) -> None:
    """A build failure must fail here, not skip the tests below."""
    assert prefill_attention.load_kernel(dtype) is not None, prefill_attention.kernel_status(dtype)


BLOCK = 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
               scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, Hkv, D] at 0.. -> [n, H, Dv] float64."""
    n, num_heads = q.shape[:2]
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1), attn_mask=visible,
        scale=scale, enable_gqa=num_heads != k.shape[1])
    return out.transpose(0, 1)


class _Inputs:
    """A pool of scattered 16-slot blocks holding ``sequences`` ((cached prefix tokens, new tokens)
    each) and their queries, packed one sequence after another."""

    def __init__(self, sequences: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None, dtype: torch.dtype, seed: int, pool_dtype: torch.dtype | None = None) -> None:
        generator = torch.Generator().manual_seed(seed)
        total_blocks = sum((p + n + BLOCK - 1) // BLOCK for p, n in sequences) + 3
        shape = (total_blocks * BLOCK, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=generator).to(pool_dtype or dtype)
        self.v_cache = torch.randn(shape, generator=generator).to(pool_dtype or dtype)
        blocks = torch.randperm(total_blocks, generator=generator).tolist()
        self.q = torch.randn(sum(n for _, n in sequences), num_heads, head_dim, generator=generator).to(dtype)
        self.window, self.scale = window, head_dim ** -0.5
        self.rows: list[tuple[int, int, int, int, torch.Tensor]] = []
        """Per sequence: (first row, queries, first query's position, column 0's position, all its slots)."""
        row = 0
        for prefix, n in sequences:
            own = [blocks.pop() for _ in range((prefix + n + BLOCK - 1) // BLOCK)]
            slots = torch.tensor([own[p // BLOCK] * BLOCK + p % BLOCK for p in range(prefix + n)])
            self.rows.append((row, n, prefix, 0 if window is None else max(0, prefix - window + 1), slots))
            row += n

    def attend(self, indices: list[int]) -> torch.Tensor:
        """The sequences ``indices`` in one call -> their rows of the output, in that order."""
        picked = [self.rows[i] for i in indices]
        q = torch.cat([self.q[row:row + n] for row, n, *_ in picked])
        columns = max(len(slots) - first for *_, first, slots in picked)
        slots_2d = torch.zeros(len(picked), columns, dtype=torch.int64)
        row_starts, row = [], 0
        for index, (_, n, _, first, slots) in enumerate(picked):
            slots_2d[index, :len(slots) - first] = slots[first:]
            row_starts.append(row)
            row += n
        out = torch.full(q.shape, float("nan")).to(q.dtype)
        assert prefill_attention.supports(q, self.k_cache, self.v_cache)
        prefill_attention.attend(q, self.k_cache, self.v_cache, slots_2d,
                                 prefill_attention.plan(row_starts, [n for _, n, *_ in picked],
                                                        [start for _, _, start, *_ in picked],
                                                        [first for *_, first, _ in picked]),
                                 self.window, self.scale, out)
        return out

    def reference(self) -> torch.Tensor:
        return torch.cat([_reference(self.q[row:row + n], self.k_cache[slots], self.v_cache[slots], start,
                                     self.window, self.scale) for row, n, start, _, slots in self.rows])


def _case(sequences: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
          window: int | None, dtype: torch.dtype, seed: int = 0, pool_dtype: torch.dtype | None = None) -> None:
    """``sequences``: (cached prefix tokens, new tokens) each; all attended in one call."""
    inputs = _Inputs(sequences, num_heads, num_kv_heads, head_dim, window, dtype, seed, pool_dtype)
    out = inputs.attend(list(range(len(sequences))))
    error = (out.double() - inputs.reference()).abs()
    largest, mean = TOLERANCE[dtype]
    assert not torch.isnan(out).any()
    assert error.max() < largest, f"max error {error.max():.3g}"
    assert error.mean() < mean, f"mean error {error.mean():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 40])
def test_causal_gqa_one_sequence(window: int | None, dtype: torch.dtype) -> None:
    _case([(0, 77)], num_heads=4, num_kv_heads=1, head_dim=256, window=window, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 33])
def test_cached_prefix_and_several_sequences(window: int | None, dtype: torch.dtype) -> None:
    # odd lengths, a prefix-cache hit / later chunk (prefix > 0), a single-token tail, two KV heads
    _case([(0, 45), (61, 38), (130, 1), (7, 70)], num_heads=6, num_kv_heads=2, head_dim=64, window=window,
          dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_longer_than_context_and_no_gqa(dtype: torch.dtype) -> None:
    _case([(5, 50), (0, 3)], num_heads=2, num_kv_heads=2, head_dim=64, window=4096, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_shape_second_chunk(dtype: torch.dtype) -> None:
    # Gemma 3 270M: the second 507-token chunk of a 1,019-token prompt, sliding window 512
    _case([(512, 507)], num_heads=4, num_kv_heads=1, head_dim=256, window=512, dtype=dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, window", [
    (4, 1, 512), (4, 1, 37), (7, 1, 50), (4, 2, 19), (8, 2, 3), (4, 1, 1), (6, 3, None)])
def test_windowed_chunks_with_gqa(num_heads: int, num_kv_heads: int, window: int | None, dtype: torch.dtype) -> None:
    """Chunks continuing a prefix (the server's chunked prefill) beside fresh prompts, under windows
    narrower than a tile, a key step and a score block (the kernels skip the key blocks and value
    columns no query of a tile or a row block sees; the bf16 kernel cuts tiles of 16 queries for even
    groups, 32 for odd ones, the float32 one of 24), with tails shorter than a tile."""
    _case([(512, 300), (0, 45), (96, 77), (13, 1), (200, 16)], num_heads=num_heads,
          num_kv_heads=num_kv_heads, head_dim=128, window=window, dtype=dtype, seed=num_heads + (window or 0))


@pytest.mark.parametrize("window", [None, 30])
def test_float32_rows_do_not_depend_on_the_batch_or_the_threads(window: int | None) -> None:
    """Each float32 output row is one task's, its columns in order: a sequence attended alone, at 1 or 2
    threads, or in another order beside others, gives the same bits (greedy tokens must not depend on
    what else is in the batch). Head_dim 80: not a multiple of 16 lanes (the score loop walks dims one
    at a time)."""
    if prefill_attention.F32_KERNEL.missing_cpu_flags():
        pytest.skip("this CPU lacks AVX2 and FMA")
    sequences = [(40, 70), (0, 25), (300, 49)]
    inputs = _Inputs(sequences, 6, 2, 80, window, torch.float32, seed=11)
    together = inputs.attend([0, 1, 2])
    assert (together.double() - inputs.reference()).abs().max() < TOLERANCE[torch.float32][0]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(inputs.attend([0, 1, 2]), together)
            row = 0
            for index, (_, n) in enumerate(sequences):
                assert torch.equal(inputs.attend([index]), together[row:row + n]), f"sequence {index} alone"
                row += n
            assert torch.equal(inputs.attend([2, 0]), torch.cat([together[95:], together[:70]]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("head_dim, window", [(64, None), (256, 512), (80, 21)])
def test_float32_queries_over_a_bf16_pool(head_dim: int, window: int | None) -> None:
    """A float32 model with ``--kv-cache-dtype bfloat16``: the pool's rows widened (exactly) per key
    step, so the float32 tolerance holds against the reference on the same bf16 values; head_dim 80
    widens a tail of lanes one by one."""
    if prefill_attention.F32_KERNEL.missing_cpu_flags():
        pytest.skip("this CPU lacks AVX2 and FMA")
    _case([(512, 300), (0, 45), (13, 1)], num_heads=4, num_kv_heads=1 if head_dim == 256 else 2,
          head_dim=head_dim, window=window, dtype=torch.float32, seed=head_dim, pool_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_plan_or_slot_outside_the_tensors_is_refused(dtype: torch.dtype) -> None:
    """The kernels read q rows and pool rows the plan and slots name: one out of range is an error,
    not a read past the tensor."""
    q, pool = torch.zeros(4, 2, 64, dtype=dtype), torch.zeros(8, 1, 64, dtype=dtype)
    out = torch.empty(4, 2, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="out of the pool"):
        prefill_attention.attend(q, pool, pool, torch.tensor([[0, 1, 8, 2]]), prefill_attention.plan([0], [4], [0], [0]),
                                 None, 0.125, out)
    with pytest.raises(RuntimeError, match="plan row 0 out of range"):
        prefill_attention.attend(q, pool, pool, torch.tensor([[0, 1, 2, 3]]), prefill_attention.plan([1], [4], [0], [0]),
                                 None, 0.125, out)


def test_float32_supports_only_what_it_computes() -> None:
    if prefill_attention.F32_KERNEL.missing_cpu_flags():
        pytest.skip("this CPU lacks AVX2 and FMA")
    q, pool = torch.zeros(3, 4, 64), torch.zeros(8, 2, 64)
    assert prefill_attention.supports(q, pool, pool)
    assert prefill_attention.supports(q, pool.bfloat16(), pool.bfloat16())     # a bf16 pool under float32 q
    assert not prefill_attention.supports(q, pool.bfloat16(), pool)            # pools of two dtypes
    assert not prefill_attention.supports(q.bfloat16(), pool, pool)            # bf16 q over a float32 pool
    assert not prefill_attention.supports(q[..., :40], pool[..., :40], pool[..., :40])   # V's dim not a multiple of 16
    assert not prefill_attention.supports(q.half(), pool.half(), pool.half())


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_stride_of_a_fused_projection(dtype: torch.dtype) -> None:
    """q as a view of a wider QKV row (the layer's split), not contiguous over tokens."""
    generator = torch.Generator().manual_seed(3)
    n, heads, head_dim = 20, 4, 64
    qkv = torch.randn(n, heads + 2, head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads]
    k_cache = torch.randn(32, 1, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(32, 1, head_dim, generator=generator).to(dtype)
    slots = torch.arange(5, 5 + n)[None, :]
    out = torch.empty(n, heads, head_dim, dtype=dtype)
    prefill_attention.attend(q, k_cache, v_cache, slots, prefill_attention.plan([0], [n], [0], [0]),
                             None, 0.125, out)
    reference = _reference(q, k_cache[5:5 + n], v_cache[5:5 + n], 0, None, 0.125)
    assert (out.double() - reference).abs().max() < TOLERANCE[dtype][0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 8])
def test_backend_group_with_a_decode_a_cached_prefix_and_a_fresh_prompt(
        monkeypatch: pytest.MonkeyPatch, window: int | None, dtype: torch.dtype) -> None:
    """torch_native over a pool of the model's dtype: the multi-token group (a chunk continuing a cached
    prefix, a fresh prompt) goes through the kernel, the decode beside it keeps its own path, and the
    result equals the other routes' (GEMMs or SDPA over gathered K/V) to the dtype's rounding."""
    from servelm.model.attention import Attention, get_attention_backend
    from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan
    from servelm.model.kv_cache import KVCache

    torch.manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 64
    cache = KVCache(1, 40, block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    cache.k_caches[0].normal_()
    cache.v_caches[0].normal_()                      # the cached prefixes' K/V (and unused slots)
    plan = BatchPlan([SequencePlan([1], 9, list(range(30, 33))),                 # a decode at position 9
                      SequencePlan(list(range(19)), 13, list(range(8))),         # 19 tokens after 13 cached
                      SequencePlan(list(range(23)), 0, list(range(10, 16)))])    # a fresh 23-token prompt
    batch = ForwardBatch.build(plan, block_size=block_size, device=torch.device("cpu"), kv_cache=cache,
                               attention=get_attention_backend("torch_native"))
    layer = Attention(0, num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    num_tokens = 1 + 19 + 23
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    calls = []
    original = prefill_attention.attend
    monkeypatch.setattr(prefill_attention, "attend", lambda *a: calls.append(1) or original(*a))
    ours = layer(q, k, v, batch)
    monkeypatch.setattr(prefill_attention, "ENABLED", False)
    expected = layer(q, k, v, batch)
    assert calls == [1]
    tolerance = TOLERANCE[dtype][0]
    torch.testing.assert_close(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(ours[0], expected[0])          # the decode row: the same path both times
