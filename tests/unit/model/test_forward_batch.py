"""BatchPlan -> ForwardBatch: positions, slots and logits rows."""

from __future__ import annotations

import pytest
import torch

from servelm.model.attention import get_attention_backend
from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan


def test_slots_positions_and_logits_rows() -> None:
    plan = BatchPlan([
        SequencePlan(token_ids=[10, 11, 12], start_position=3, block_ids=[7, 2], num_logits=2),
        SequencePlan(token_ids=[20], start_position=0, block_ids=[5], num_logits=1),
        SequencePlan(token_ids=[30, 31], start_position=0, block_ids=[1], num_logits=0),
    ])
    batch = ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"),
                               attention=get_attention_backend("torch_native"))
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert batch.positions.tolist() == [3, 4, 5, 0, 0, 1]
    # position 3 -> block 7 offset 3; positions 4, 5 -> block 2 offsets 0, 1
    assert batch.slot_mapping.tolist() == [31, 8, 9, 20, 4, 5]
    assert batch.logits_indices.tolist() == [1, 2, 3]
    assert batch.context_lens == [6, 1, 2]
    decode_group, other_group = batch.attn_metadata.groups
    assert decode_group.kv_slots.tolist() == [[20]]
    assert other_group.kv_slots.tolist() == [[28, 29, 30, 31, 8, 9], [4, 5, 0, 0, 0, 0]]
    assert other_group.valid_rows.tolist() == [0, 1, 2, 4, 5]


def _fields(value: object) -> dict[str, object]:
    """A batch's or a group's fields (dataclasses), for comparing two builds."""
    names = getattr(value, "__dataclass_fields__")
    return {name: getattr(value, name) for name in names if name not in ("attn_metadata", "views", "attention")}


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif hasattr(a, "__dataclass_fields__") and not isinstance(a, type):
        assert type(a) is type(b)
        for (name, x), y in zip(_fields(a).items(), _fields(b).values()):
            _assert_same(x, y)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_few_rows_from_lists_equal_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of at most ``LIST_ROWS`` rows (positions, slots, the attention groups made from Python's
    lists) equal what the torch ops make of them: decodes, a chunk, a draft tree, a mixed batch, LoRA
    rows (the same build at any size)."""
    from servelm.model import forward_batch
    from servelm.model.forward_batch import DraftTree

    plans = [
        BatchPlan([SequencePlan([5], 9, [3, 1, 4])]),
        BatchPlan([SequencePlan([5], 9, [3, 1, 4]), SequencePlan([6], 0, [2]), SequencePlan([7], 4, [8, 9])]),
        BatchPlan([SequencePlan([10, 11, 12], 3, [7, 2], 2), SequencePlan([20], 0, [5]),
                   SequencePlan([30, 31], 0, [1], 0)]),
        BatchPlan([SequencePlan([1, 2, 3, 4], 5, [6, 7, 8], 4, tree=DraftTree(6, [-1, 0, 0]))]),
        BatchPlan([SequencePlan([5, 6], 9, [3, 1, 4], lora_slot=2), SequencePlan([6], 0, [2]),
                   SequencePlan([7], 4, [8, 9], lora_slot=2), SequencePlan([8], 1, [5], lora_slot=1)]),
    ]
    backend = get_attention_backend("torch_native")
    for plan in plans:
        built = ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"), attention=backend)
        with monkeypatch.context() as patched:
            patched.setattr(forward_batch, "LIST_ROWS", 0)
            reference = ForwardBatch.build(plan, block_size=4, device=torch.device("cpu"), attention=backend)
        _assert_same(built, reference)
        for group, reference_group in zip(built.attn_metadata.groups, reference.attn_metadata.groups, strict=True):
            _assert_same(group, reference_group)
            assert torch.equal(group.view(None).mask, reference_group.view(None).mask)
