"""torch_native attention views: sliding layers read only their window, decode groups exactly."""

from __future__ import annotations

import torch

from servelm.model.attention import get_attention_backend
from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan


def build(plan: BatchPlan) -> ForwardBatch:
    return ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"),
                              attention=get_attention_backend("torch_native"))


def test_sliding_view_reads_only_the_window() -> None:
    blocks = list(range(10, 20))   # 40 slots, position p -> slot 40 + p
    batch = build(BatchPlan([SequencePlan([1], 30, blocks), SequencePlan([2], 5, blocks[:2])]))
    (decodes,) = batch.attn_metadata.groups
    full, window = decodes.view(None), decodes.view(8)
    assert full.num_columns == 31
    assert window.num_columns == 8
    slots = window.slots.view(2, 8)
    assert slots[0].tolist() == [40 + p for p in range(23, 31)]      # positions 23..30
    assert slots[1, :6].tolist() == [40 + p for p in range(6)]       # the whole short context
    assert window.mask[1, 0, 0].tolist() == [True] * 6 + [False] * 2


def test_prefill_window_starts_at_first_query_minus_window() -> None:
    blocks = list(range(10))
    batch = build(BatchPlan([SequencePlan([1, 2, 3], 20, blocks)]))
    (group,) = batch.attn_metadata.groups
    view = group.view(4)
    assert view.num_columns == 6                                      # positions 17..22
    positions = torch.arange(17, 23)
    expected = torch.stack([(positions <= q) & (positions > q - 4) for q in (20, 21, 22)])
    assert torch.equal(view.mask[0, 0], expected)


def test_decode_window_longer_than_every_context_shares_the_full_view() -> None:
    blocks = list(range(10, 20))
    batch = build(BatchPlan([SequencePlan([1], 30, blocks), SequencePlan([2], 5, blocks[:2])]))
    (decodes,) = batch.attn_metadata.groups
    full = decodes.view(None)
    assert decodes.view(31) is full                 # context 31: position 30 sees 0..30 either way
    assert decodes.view(30) is not full             # position 30 no longer sees position 0
    assert decodes.view(30).num_columns == 30
    built = full.slots.clone(), full.mask.clone()
    assert torch.equal(decodes._build_view(31).slots, built[0])
    assert torch.equal(decodes._build_view(31).mask, built[1])
    (prefill,) = build(BatchPlan([SequencePlan([1, 2, 3], 4, blocks)])).attn_metadata.groups
    assert prefill.view(64) is not prefill.view(None)   # multi-token groups keep their own (tiles)


def test_a_long_context_gets_a_group_of_its_own_so_short_ones_are_not_padded_to_it() -> None:
    from servelm.model.attention import paged_decode
    from servelm.model.attention.torch_native import context_buckets
    assert context_buckets([0, 1, 2], [5, 900, 7]) == [[0, 2], [1]]
    assert context_buckets([0, 1], [300, 500]) == [[0, 1]]          # within 2x: one group, given order
    assert context_buckets([1, 0], [40, 200]) == [[1, 0]]           # 5x but only 160 columns apart
    blocks = list(range(300))
    batch = build(BatchPlan([SequencePlan([1], 4, blocks[:2]), SequencePlan([2], 900, blocks[:226]),
                             SequencePlan([3], 6, blocks[:2]), SequencePlan([4, 5], 3, blocks[:2]),
                             SequencePlan([6, 7], 800, blocks[:201])]))
    groups = batch.attn_metadata.groups
    columns = sorted(group.view(None).num_columns for group in groups)
    if paged_decode.load_kernel() is None:     # SDPA pads a decode group's K/V to its longest context
        assert columns == [5, 7, 802, 901]
    else:                                      # the kernel reads each decode's own span
        assert columns == [5, 802, 901]
