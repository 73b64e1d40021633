"""The CPU plan of one forward pass (BatchPlan) and the device tensors built from it (ForwardBatch).

The scheduler produces a BatchPlan of plain Python lists; only this module turns it into tensors.
model/ never sees a Request: a SequencePlan is just tokens, positions and KV blocks.

Invariants of a SequencePlan:
- ``token_ids`` are the tokens whose K/V are computed and written this step, at positions
  ``start_position .. start_position + len(token_ids) - 1``.
- positions ``0 .. start_position - 1`` already hold valid K/V in ``block_ids``.
- ``block_ids`` cover at least ``start_position + len(token_ids)`` tokens; slot of position p is
  ``block_ids[p // block_size] * block_size + p % block_size``.
- ``num_logits`` trailing positions get logits (0 for a non-final prefill chunk, 1 to sample one
  token, k+1 to verify k speculative tokens, len(token_ids) for prompt logprobs).
- ``is_pooled`` (an embedding request): the whole prompt from position 0, no logits; the runner
  returns one pooled vector for it (``ModelRunner.pool``).
- ``tree`` (speculative draft trees, ``spec/tree.py``): positions ``tree.first_position ..`` of
  the sequence hold tree nodes rather than a chain. Their K/V still go to the linear slots (slot
  of linear position p as above), but a node's rope position is ``first_position + depth`` and it
  attends to positions before ``first_position`` plus its own ancestors (and itself) only.
  Without a tree nothing here changes (``ForwardBatch.trees`` stays None).
- ``images`` (vision-language models): the image spans (``servelm.multimodal.inputs.ImageSpan``,
  prompt positions) that overlap this step's tokens. The scheduler never cuts a span: a step
  computes all of a span's positions from its first computed one on. Rows at a span's positions
  take the image's encoded rows instead of token embeddings (``ForwardBatch.mm_rows``, filled by the
  runner), and query rows inside a span see every position of that span (both directions:
  ``ForwardBatch.images``, the attention backend's mask), on top of the causal (and window) rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from servelm.model.gguf.gguf_routes import PassRows
from servelm.model.layers.linear import LoRAGroup


LIST_ROWS = 64
"""Up to this many token rows a batch's positions and slots are computed in Python's lists and made
one tensor each (a decode step's few rows: the dozen small torch ops they replace cost ~10 us each,
cold, in a one-stream step); past it by torch's ops (a prompt's thousands of rows). The same values.
The torch_native backend's attention groups take the same limit for their query rows."""


@dataclass(slots=True)
class DraftTree:
    """Tree-shaped tail of a sequence: node j sits at linear position ``first_position + j``.

    Invariant: ``parents[j] < j`` (a parent comes first), -1 for a node hanging off the context
    (the positions before ``first_position``); so node 0 is always a root."""

    first_position: int
    parents: list[int]

    def depths(self) -> list[int]:
        depths: list[int] = []
        for node, parent in enumerate(self.parents):
            assert parent < node, "a tree node's parent comes before it"
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths

    def ancestor_mask(self) -> torch.Tensor:
        """``[nodes, nodes]`` bool: [i, j] when node j is node i or one of its ancestors."""
        num_nodes = len(self.parents)
        mask = torch.eye(num_nodes, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                mask[node] |= mask[parent]
        return mask


@dataclass(slots=True)
class SequencePlan:
    """One sequence's share of a forward pass."""

    token_ids: list[int]
    """Tokens computed this step."""
    start_position: int
    """Position of token_ids[0]; equals the number of tokens already in the KV cache."""
    block_ids: list[int]
    """KV blocks of the whole sequence, in order."""
    num_logits: int = 1
    """How many trailing positions of token_ids get logits."""
    is_pooled: bool = False
    """The sequence is a whole prompt whose pooled hidden state is returned (embeddings)."""
    lora_slot: int = 0
    """Adapter slot whose LoRA deltas apply to this sequence's rows (0: the base model)."""
    tree: DraftTree | None = None
    """Tree-shaped tail (a speculative draft tree); None: causal chain, the usual case."""
    images: list[Any] = field(default_factory=list)
    """ImageSpans (servelm.multimodal.inputs) overlapping ``token_ids``' positions, in order."""
    mrope_positions: Any = None
    """``[3, len(token_ids)]`` int64 M-RoPE positions (Qwen2-VL: temporal, height, width) of a
    sequence with images; None: its linear positions on all three axes."""


@dataclass(slots=True)
class BatchPlan:
    """Every sequence computed in one forward pass, in output order."""

    sequences: list[SequencePlan] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) block ids whose K/V is copied before the forward writes anything:
    copy-on-write of a partial block shared by two beams (engine/beam.py)."""
    slot_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) slots whose K/V is copied before the forward writes anything: the
    accepted path of a verified draft tree moved to the sequence's contiguous positions."""
    argmax_rows: list[int] = field(default_factory=list)
    """Logits rows of which the caller reads only the argmax (greedy, no logprobs, no logit
    processors, no grammar; set by the engine's executor): the runner may return such a row with
    only the vocabulary entries that can be the argmax filled and ``-inf`` elsewhere
    (servelm.model.gguf.lm_head_screen)."""
    argmax_tokens: dict[int, int] = field(default_factory=dict)
    """Set by an in-process runner: the argmax of those of ``argmax_rows`` that the LM-head screen took
    (logits row -> token id, ``torch.argmax``'s answer on the row), so the sampler does not search
    their rows again; empty where the runner gave none (a remote runner's stay behind)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.sequences)

    @property
    def num_pooled(self) -> int:
        return sum(1 for s in self.sequences if s.is_pooled)


@dataclass(slots=True)
class ImageRows:
    """``count`` consecutive batch rows from ``row`` that take rows ``first .. first + count - 1``
    of ``span``'s encoded image."""

    row: int
    span: Any
    first: int
    count: int


@dataclass
class ForwardBatch:
    """Device tensors of one forward pass, built once from a BatchPlan by ``ForwardBatch.build``.

    Token rows are the plan's tokens concatenated in sequence order ("packed" layout, no padding).
    Layers read ``positions``; attention layers write K/V at ``slot_mapping`` in ``kv_cache`` and
    read ``attn_metadata``, which the attention backend derived from this batch.
    """

    input_ids: torch.Tensor
    """[num_tokens] int64 token ids."""
    positions: torch.Tensor
    """[num_tokens] int64 position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 KV slot each token's K/V is written to."""
    logits_indices: torch.Tensor
    """[num_logits] int64 token rows that get logits, in plan order."""
    block_table: torch.Tensor
    """[num_sequences, max_blocks] int64 block ids, padded with 0 (never read past context_lens)."""
    query_lens: list[int]
    """Tokens computed this step, per sequence."""
    start_positions: list[int]
    """Tokens already in the cache, per sequence."""
    block_size: int
    kv_cache: Any = None
    """KVCache the attention layers write to and read from (None: a model run without cache)."""
    attention: Any = None
    """Attention backend (servelm.model.attention) that interprets ``attn_metadata``."""
    attn_metadata: Any = None
    rope_cache: dict[Any, Any] = field(default_factory=dict)
    """Rotary cos/sin of this batch's positions, shared by the layers with the same rope."""
    lora: list[LoRAGroup] = field(default_factory=list)
    """Token rows per adapter slot (base rows in none), for the linear layers' LoRA deltas."""
    trees: list[DraftTree | None] | None = None
    """Per sequence, its draft tree; None when no sequence of the batch has one."""
    rows: PassRows | None = None
    """Which token rows are generation rows (a sequence whose every row gets logits: decode, verify,
    prompt logprobs): they keep unrounded activations at every batch size and come out as a pass of
    only them computes them (GGUF routes, gguf/gguf_routes.py). None: every row a prompt row."""
    head_rows: PassRows | None = None
    """The same for the LM head's call on the ``logits_indices`` rows."""
    images: list[list[tuple[int, int]]] | None = None
    """Per sequence, the (first, end) positions of each image block that has query rows in this
    pass: its rows see the whole block (bidirectional; a model whose images attend both ways
    only, ``build(bidirectional_images=True)``: Gemma 3). None when no sequence has one."""
    image_rows: list[ImageRows] = field(default_factory=list)
    """The batch rows that take image features, per image piece (the runner encodes them)."""
    mm_rows: torch.Tensor | None = None
    """[n] int64 token rows whose embeddings ``mm_embeds`` replaces (set by the runner)."""
    mm_embeds: torch.Tensor | None = None
    """[n, hidden] the image features of ``mm_rows``, in their order."""
    mrope_positions: torch.Tensor | None = None
    """[3, num_tokens] int64 M-RoPE positions (``SequencePlan.mrope_positions``, else ``positions``
    on all three axes); None when no sequence has its own."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    @property
    def context_lens(self) -> list[int]:
        """Tokens in the cache after this step, per sequence."""
        return [s + n for s, n in zip(self.start_positions, self.query_lens)]

    @classmethod
    def build(cls, plan: BatchPlan, block_size: int, device: torch.device,
              kv_cache: Any = None, attention: Any = None, bidirectional_images: bool = False) -> ForwardBatch:
        """Turn the plan's lists into device tensors (and the backend's metadata, when given).
        ``bidirectional_images``: image placeholder rows attend to their whole image (Gemma 3);
        else causally, like text (Qwen2-VL)."""
        sequences = plan.sequences
        query_lens = [len(s.token_ids) for s in sequences]
        start_positions = [s.start_position for s in sequences]
        for s, n in zip(sequences, query_lens):
            assert n > 0, "a SequencePlan computes at least one token"
            assert 0 <= s.num_logits <= n, f"num_logits {s.num_logits} outside [0, {n}]"
            assert not s.is_pooled or (s.start_position == 0 and s.num_logits == 0), (
                "a pooled sequence is a whole prompt with no logits")
            assert len(s.block_ids) * block_size >= s.start_position + n, (
                f"{len(s.block_ids)} blocks cannot hold {s.start_position + n} tokens")
        num_sequences = len(sequences)
        flat_ids = [t for s in sequences for t in s.token_ids]
        max_blocks = max((len(s.block_ids) for s in sequences), default=1)
        block_table = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in sequences]
                                   or [[0]], dtype=torch.int64)
        query_starts: list[int] = []
        total = 0
        for n in query_lens:
            query_starts.append(total)
            total += n
        if total <= LIST_ROWS:   # a few rows (decode): the same values from Python's lists, one tensor each
            positions = torch.tensor([p for s, n in zip(sequences, query_lens)
                                      for p in range(s.start_position, s.start_position + n)], dtype=torch.int64)
            slots = torch.tensor([s.block_ids[p // block_size] * block_size + p % block_size
                                  for s, n in zip(sequences, query_lens)
                                  for p in range(s.start_position, s.start_position + n)], dtype=torch.int64)
        else:
            lens_t = torch.tensor(query_lens, dtype=torch.int64)
            starts_t = torch.tensor(start_positions, dtype=torch.int64)
            seq_index = torch.repeat_interleave(torch.arange(num_sequences), lens_t)
            query_start = torch.cumsum(lens_t, 0) - lens_t
            positions = starts_t[seq_index] + torch.arange(len(flat_ids)) - query_start[seq_index]
            slots = block_table[seq_index, positions // block_size] * block_size + positions % block_size
        has_tree = any(s.tree is not None for s in sequences)
        if has_tree:
            positions = _tree_positions(sequences, positions, query_starts)
        logits_rows = [row for start, n, s in zip(query_starts, query_lens, sequences)
                       for row in range(start + n - s.num_logits, start + n)]
        batch = cls(
            input_ids=torch.tensor(flat_ids, dtype=torch.int64).to(device),
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(device),
            block_table=block_table.to(device),
            query_lens=query_lens,
            start_positions=start_positions,
            block_size=block_size,
            kv_cache=kv_cache,
            attention=attention,
        )
        for slot in sorted({s.lora_slot for s in sequences} - {0}):
            rows = torch.tensor([row for s, start, n in zip(sequences, query_starts, query_lens) if s.lora_slot == slot
                                 for row in range(start, start + n)], dtype=torch.int64)
            first, last = int(rows[0]), int(rows[-1])
            span = (first, last + 1) if last - first + 1 == len(rows) else None
            batch.lora.append(LoRAGroup(slot, rows.to(device), span))
        if has_tree:
            batch.trees = [s.tree for s in sequences]
        if any(s.mrope_positions is not None for s in sequences):
            assert not has_tree, "M-RoPE sequences are not verified as draft trees"
            mrope = positions.unsqueeze(0).repeat(3, 1)
            for s, row_start, n in zip(sequences, query_starts, query_lens):
                if s.mrope_positions is not None:
                    assert tuple(s.mrope_positions.shape) == (3, n), "one M-RoPE column per token"
                    mrope[:, row_start:row_start + n] = s.mrope_positions
            batch.mrope_positions = mrope.to(device)
        if any(s.images for s in sequences):
            blocks_per_sequence: list[list[tuple[int, int]]] = []
            for s, row_start, n in zip(sequences, query_starts, query_lens):
                blocks = []
                for span in s.images:
                    first = max(span.offset, s.start_position)
                    end = min(span.offset + span.length, s.start_position + n)
                    if first >= end:
                        continue
                    assert end == span.offset + span.length, "an image span is never cut by a pass"
                    blocks.append((span.offset, span.offset + span.length))
                    batch.image_rows.append(ImageRows(row_start + first - s.start_position, span,
                                                      first - span.offset, end - first))
                blocks_per_sequence.append(blocks)
            if bidirectional_images:
                batch.images = blocks_per_sequence
        generation = [n <= s.num_logits for s, n in zip(sequences, query_lens)]
        batch.rows = PassRows.of(query_lens, generation)
        batch.head_rows = PassRows.of([s.num_logits for s in sequences], generation)
        if attention is not None:
            batch.attn_metadata = attention.build_metadata(batch)
        return batch


def _tree_positions(sequences: list[SequencePlan], positions: torch.Tensor,
                    row_starts: list[int]) -> torch.Tensor:
    """Rope positions of tree rows: ``first_position + depth`` (slots stay linear)."""
    positions = positions.clone()
    for sequence, row_start in zip(sequences, row_starts):
        tree = sequence.tree
        if tree is None:
            continue
        end = sequence.start_position + len(sequence.token_ids)
        assert tree.first_position + len(tree.parents) == end, "a tree runs to the sequence's end"
        depths = torch.tensor(tree.depths(), dtype=torch.int64) + tree.first_position
        first_row = max(tree.first_position, sequence.start_position) - sequence.start_position
        num_rows = len(sequence.token_ids) - first_row
        positions[row_start + first_row:row_start + first_row + num_rows] = depths[len(depths) - num_rows:]
    return positions
