"""Attention with torch's scaled_dot_product_attention over the paged KV cache (any device).

Per forward, sequences are split into two groups -- single-token decodes and multi-token
(prefill/chunk/verify) sequences -- so one long prefill does not pad every decode to its length.
For each group the backend gathers every sequence's context K/V from its slots into a padded
``[b, Hkv, max_context, D]`` tensor, pads the queries to ``[b, H, max_query, D]`` and calls SDPA
once with a boolean mask:

    visible(q, kv) = kv_position <= q_position  (and kv_position > q_position - window, if sliding)

Padding query rows see key 0 only (never a fully masked row, so no NaN) and are dropped on output.
GQA uses SDPA's ``enable_gqa`` (torch >= 2.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from servelm.model.attention.base import Attention
from servelm.model.forward_batch import ForwardBatch


@dataclass
class _Group:
    """Sequences attended in one SDPA call."""

    query_rows: torch.Tensor
    """[b, max_query] token row of each query (padding rows clamped to a valid row)."""
    query_valid: torch.Tensor
    """[b, max_query] bool, False on padding."""
    valid_rows: torch.Tensor
    """[num_valid] token rows of the valid queries, in query_rows[query_valid] order."""
    kv_slots: torch.Tensor
    """[b, max_context] slot of each context position (0 past the context; masked)."""
    query_positions: torch.Tensor
    """[b, max_query] position of each query."""
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """sliding_window -> [b, 1, max_query, max_context] bool mask, built on first use."""

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        cached = self.masks.get(sliding_window)
        if cached is not None:
            return cached
        max_context = self.kv_slots.shape[1]
        kv_positions = torch.arange(max_context, device=self.kv_slots.device)[None, None, :]
        q_positions = self.query_positions[:, :, None]
        visible = kv_positions <= q_positions
        if sliding_window is not None:
            visible &= kv_positions > q_positions - sliding_window
        visible |= (~self.query_valid[:, :, None]) & (kv_positions == 0)
        self.masks[sliding_window] = visible[:, None]
        return self.masks[sliding_window]


@dataclass
class TorchNativeMetadata:
    groups: list[_Group]


class TorchNativeAttention:
    """The portable reference backend: SDPA over gathered, padded context."""

    name = "torch_native"

    def build_metadata(self, batch: ForwardBatch) -> TorchNativeMetadata:
        device = batch.input_ids.device
        query_starts: list[int] = []
        total = 0
        for n in batch.query_lens:
            query_starts.append(total)
            total += n
        decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
        others = [i for i, n in enumerate(batch.query_lens) if n != 1]
        groups = [self._group(batch, members, query_starts, device) for members in (decodes, others) if members]
        return TorchNativeMetadata(groups=groups)

    @staticmethod
    def _group(batch: ForwardBatch, members: list[int], query_starts: list[int],
               device: torch.device) -> _Group:
        query_lens = torch.tensor([batch.query_lens[i] for i in members], dtype=torch.int64)
        starts = torch.tensor([batch.start_positions[i] for i in members], dtype=torch.int64)
        row_starts = torch.tensor([query_starts[i] for i in members], dtype=torch.int64)
        context_lens = starts + query_lens
        max_query, max_context = int(query_lens.max()), int(context_lens.max())
        offsets = torch.arange(max_query)[None, :]
        query_valid = offsets < query_lens[:, None]
        query_rows = torch.where(query_valid, row_starts[:, None] + offsets, row_starts[:, None])
        query_positions = starts[:, None] + offsets
        block_size = batch.block_size
        kv_positions = torch.arange(max_context)[None, :]
        kv_valid = kv_positions < context_lens[:, None]
        table = batch.block_table.cpu()[torch.tensor(members)]
        block_index = torch.clamp(kv_positions // block_size, max=table.shape[1] - 1).expand(len(members), -1)
        kv_slots = table.gather(1, block_index) * block_size + kv_positions % block_size
        kv_slots = torch.where(kv_valid, kv_slots, torch.zeros_like(kv_slots))
        return _Group(
            query_rows=query_rows.to(device),
            query_valid=query_valid.to(device),
            valid_rows=query_rows[query_valid].to(device),
            kv_slots=kv_slots.to(device),
            query_positions=query_positions.to(device),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (rope applied) -> [T, H * D]."""
        batch.kv_cache.write(layer.layer_id, batch.slot_mapping, k, v)
        k_cache, v_cache = batch.kv_cache.layer(layer.layer_id)
        metadata: TorchNativeMetadata = batch.attn_metadata
        out = q.new_empty(q.shape[0], layer.num_heads, v.shape[-1])
        for group in metadata.groups:
            q_padded = q[group.query_rows].transpose(1, 2)                       # [b, H, Q, D]
            k_context = k_cache[group.kv_slots].to(q.dtype).transpose(1, 2)       # [b, Hkv, C, D]
            v_context = v_cache[group.kv_slots].to(q.dtype).transpose(1, 2)       # [b, Hkv, C, D]
            attended = F.scaled_dot_product_attention(
                q_padded, k_context, v_context, attn_mask=group.mask(layer.sliding_window),
                scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
            out[group.valid_rows] = attended.transpose(1, 2)[group.query_valid]  # [num_valid, H, D]
        return out.reshape(q.shape[0], -1)
