"""BatchPlan -> ForwardBatch: positions, slots and logits rows."""

from __future__ import annotations

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
