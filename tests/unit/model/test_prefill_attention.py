"""The AVX512-BF16 prefill attention kernel against float32 SDPA on the same bf16 inputs.

Tolerance: the kernel rounds probabilities to bf16 before P.V (as the GEMM path does) and its output
to bf16 once, so each output element is within 2e-2 absolute of the float32 reference for unit-scale
q/k/v (observed: under 1e-2), and its mean error is under 2e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.model.attention import prefill_attention

pytestmark = pytest.mark.skipif(bool(prefill_attention.KERNEL.missing_cpu_flags()),
                                reason="this CPU lacks AVX512-BF16: the GEMM path serves prefill")


def test_the_kernel_builds_where_the_cpu_has_avx512_bf16() -> None:
    """A build failure must fail here, not skip the tests below."""
    assert prefill_attention.load_kernel() is not None, prefill_attention.kernel_status()

BLOCK = 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
               scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, Hkv, D] at 0.. -> [n, H, Dv] float32."""
    n, num_heads = q.shape[:2]
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=visible,
        scale=scale, enable_gqa=num_heads != k.shape[1])
    return out.transpose(0, 1)


def _case(sequences: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
          window: int | None, seed: int = 0) -> None:
    """``sequences``: (cached prefix tokens, new tokens) each; all attended in one call."""
    generator = torch.Generator().manual_seed(seed)
    total_blocks = sum((p + n + BLOCK - 1) // BLOCK for p, n in sequences) + 3
    k_cache = torch.randn(total_blocks * BLOCK, num_kv_heads, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(total_blocks * BLOCK, num_kv_heads, head_dim, generator=generator).bfloat16()
    blocks = torch.randperm(total_blocks, generator=generator).tolist()   # scattered blocks
    num_tokens = sum(n for _, n in sequences)
    q_all = torch.randn(num_tokens, num_heads, head_dim, generator=generator).bfloat16()
    scale = head_dim ** -0.5
    row_starts, query_lens, starts, firsts, slot_rows, expected = [], [], [], [], [], []
    row = 0
    for prefix, n in sequences:
        context = prefix + n
        own = [blocks.pop() for _ in range((context + BLOCK - 1) // BLOCK)]
        slots = torch.tensor([own[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
        first = 0 if window is None else max(0, prefix - window + 1)
        row_starts.append(row), query_lens.append(n), starts.append(prefix), firsts.append(first)
        slot_rows.append(slots[first:])
        expected.append(_reference(q_all[row:row + n], k_cache[slots], v_cache[slots], prefix, window, scale))
        row += n
    columns = max(len(s) for s in slot_rows)
    slots_2d = torch.zeros(len(sequences), columns, dtype=torch.int64)
    for index, s in enumerate(slot_rows):
        slots_2d[index, :len(s)] = s
    out = torch.full((num_tokens, num_heads, head_dim), float("nan")).bfloat16()
    assert prefill_attention.supports(q_all, k_cache, v_cache)
    prefill_attention.attend(q_all, k_cache, v_cache, slots_2d,
                             prefill_attention.plan(row_starts, query_lens, starts, firsts), window, scale, out)
    reference = torch.cat(expected)
    error = (out.float() - reference).abs()
    assert not torch.isnan(out).any()
    assert error.max() < 2e-2, f"max error {error.max():.4f}"
    assert error.mean() < 2e-3, f"mean error {error.mean():.5f}"


@pytest.mark.parametrize("window", [None, 40])
def test_causal_gqa_one_sequence(window: int | None) -> None:
    _case([(0, 77)], num_heads=4, num_kv_heads=1, head_dim=256, window=window)


@pytest.mark.parametrize("window", [None, 33])
def test_cached_prefix_and_several_sequences(window: int | None) -> None:
    # odd lengths, a prefix-cache hit / later chunk (prefix > 0), a single-token tail, two KV heads
    _case([(0, 45), (61, 38), (130, 1), (7, 70)], num_heads=6, num_kv_heads=2, head_dim=64, window=window)


def test_window_longer_than_context_and_no_gqa() -> None:
    _case([(5, 50), (0, 3)], num_heads=2, num_kv_heads=2, head_dim=64, window=4096)


def test_gemma3_shape_second_chunk() -> None:
    # Gemma 3 270M: the second 507-token chunk of a 1,019-token prompt, sliding window 512
    _case([(512, 507)], num_heads=4, num_kv_heads=1, head_dim=256, window=512, seed=1)


@pytest.mark.parametrize("num_heads, num_kv_heads, window", [
    (4, 1, 512), (4, 1, 37), (7, 1, 50), (4, 2, 19), (8, 2, 3), (4, 1, 1), (6, 3, None)])
def test_windowed_chunks_with_gqa(num_heads: int, num_kv_heads: int, window: int | None) -> None:
    """Chunks continuing a prefix (the server's chunked prefill) beside fresh prompts, under windows
    narrower than a tile, a key step and a score block of 8 columns (the kernel skips the key blocks and
    value pairs no query of a tile or 4-row block sees, and cuts tiles of 16 queries for even groups,
    32 for odd ones), with tails shorter than a tile."""
    _case([(512, 300), (0, 45), (96, 77), (13, 1), (200, 16)], num_heads=num_heads,
          num_kv_heads=num_kv_heads, head_dim=128, window=window, seed=num_heads + (window or 0))


def test_query_stride_of_a_fused_projection() -> None:
    """q as a view of a wider QKV row (the layer's split), not contiguous over tokens."""
    generator = torch.Generator().manual_seed(3)
    n, heads, head_dim = 20, 4, 64
    qkv = torch.randn(n, heads + 2, head_dim, generator=generator).bfloat16()
    q = qkv[:, :heads]
    k_cache = torch.randn(32, 1, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(32, 1, head_dim, generator=generator).bfloat16()
    slots = torch.arange(5, 5 + n)[None, :]
    out = torch.empty(n, heads, head_dim, dtype=torch.bfloat16)
    prefill_attention.attend(q, k_cache, v_cache, slots, prefill_attention.plan([0], [n], [0], [0]),
                             None, 0.125, out)
    reference = _reference(q, k_cache[5:5 + n], v_cache[5:5 + n], 0, None, 0.125)
    assert (out.float() - reference).abs().max() < 2e-2


@pytest.mark.parametrize("window", [None, 8])
def test_backend_group_with_a_decode_a_cached_prefix_and_a_fresh_prompt(
        monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """torch_native over a bf16 pool: the multi-token group (a chunk continuing a cached prefix, a
    fresh prompt) goes through the kernel, the decode beside it keeps its own path, and the result
    equals the GEMM path's (prefill_gemm over gathered K/V) to bf16 rounding."""
    from servelm.model.attention import Attention, get_attention_backend
    from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan
    from servelm.model.kv_cache import KVCache

    torch.manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 64
    cache = KVCache(1, 40, block_size, num_kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    cache.k_caches[0].normal_()
    cache.v_caches[0].normal_()                      # the cached prefixes' K/V (and unused slots)
    plan = BatchPlan([SequencePlan([1], 9, list(range(30, 33))),                 # a decode at position 9
                      SequencePlan(list(range(19)), 13, list(range(8))),         # 19 tokens after 13 cached
                      SequencePlan(list(range(23)), 0, list(range(10, 16)))])    # a fresh 23-token prompt
    batch = ForwardBatch.build(plan, block_size=block_size, device=torch.device("cpu"), kv_cache=cache,
                               attention=get_attention_backend("torch_native"))
    layer = Attention(0, num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    num_tokens = 1 + 19 + 23
    q = torch.randn(num_tokens, num_heads, head_dim).bfloat16()
    k = torch.randn(num_tokens, num_kv_heads, head_dim).bfloat16()
    v = torch.randn(num_tokens, num_kv_heads, head_dim).bfloat16()
    calls = []
    original = prefill_attention.attend
    monkeypatch.setattr(prefill_attention, "attend", lambda *a: calls.append(1) or original(*a))
    ours = layer(q, k, v, batch)
    monkeypatch.setattr(prefill_attention, "ENABLED", False)
    expected = layer(q, k, v, batch)
    assert calls == [1]
    torch.testing.assert_close(ours.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(ours[0], expected[0])          # the decode row: the same path both times
