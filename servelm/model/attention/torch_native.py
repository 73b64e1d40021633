"""Attention with torch's scaled_dot_product_attention over the paged KV cache (any device).

Per forward, sequences are split into two groups -- single-token decodes and multi-token
(prefill/chunk/verify) sequences -- so one long prefill does not pad every decode to its length.
For each group and each attention span (full, or one sliding window) the backend builds once per
forward a *view*: the slots of the context columns each sequence can see, and a boolean mask.
Every layer then gathers its K/V with one ``index_select`` over those flat slots into a padded
``[b, Hkv, columns, D]`` tensor and calls SDPA once per group:

    visible(q, kv) = kv_position <= q_position  (and kv_position > q_position - window, if sliding)

A non-causal layer (an encoder) gets its own view where every valid column is visible; its
sequences start at position 0 (asserted), so the context is exactly the sequence's own tokens.
With a ``position_bias`` (MPNet) its mask becomes a float mask: the bias of ``column - query
position`` where visible, -inf elsewhere, built once per forward and bias module on that view.
A sliding-window view starts each sequence at ``first_query_position - window + 1``: sliding layers
read only their window, so their cost does not grow with the context. Nothing here depends on the
pool size. Padding query rows see column 0 only (never a fully masked row, so no NaN) and are
dropped on output.

Draft trees (``ForwardBatch.trees``, speculative verification of a tree of drafts): a tree
sequence always goes to the multi-token group, and its view's mask rows over the tree's columns
are replaced by the tree's ancestor mask (a node sees the context before the tree, its ancestors
and itself); the prefill_gemm tiles of such a sequence take their bias from that mask. Batches
without a tree never reach this code.

Image blocks (``ForwardBatch.images``, vision-language models): a query row inside an image block
also sees every column of that block, later ones included (transformers' ``token_type_ids``
overlay): ``visible = (causal or same block) and window``. A multi-token group with an image block
always attends through SDPA with that mask (the prefill kernels are causal-only); decode groups
never hold one (an image is computed whole in the step that reaches it).

Decode groups fold GQA into the query dimension (``[b, Hkv, H/Hkv, D]`` against ``[b, Hkv, C, D]``):
exact for one query per sequence, and it avoids SDPA expanding K/V per query head. Multi-token
groups use SDPA's ``enable_gqa``. Measured on the 2-core dev box (32 x 128 context rows of
Gemma 3 270M): ``index_select`` on flat slots 0.08 ms, advanced indexing ``cache[slots_2d]`` 0.40 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from servelm.model.attention import paged_decode, prefill_attention, prefill_gemm, prefill_routes
from servelm.model.attention.base import Attention, PositionBias
from servelm.model import forward_batch
from servelm.model.forward_batch import DraftTree, ForwardBatch


BUCKET_RATIO = 2
BUCKET_MIN_COLUMNS = 256
"""SDPA and the GEMM tiles read a group's K/V gathered and padded to its longest context, so one
long sequence beside short ones made each of them pay its length (a 4,000-token prompt advancing a
token per step beside seven short decodes: 8 x 4,000 columns gathered per layer). A sequence whose
context is over ``BUCKET_RATIO`` x the shortest of its group and ``BUCKET_MIN_COLUMNS`` longer
starts a group of its own (one more attention call per layer). Decode groups on the paged decode
kernel are not cut: it reads each sequence's own span."""

SDPA_TILE_QUERIES = 256
"""A causal SDPA call of more query rows runs as tiles of this many (``_KVView.query_tiles``), each
over only the columns some query of the tile sees: SDPA computes every (query, column) pair its mask
covers, so a whole prompt of n tokens paid n^2 pairs for the n^2 / 2 a causal mask lets through.
Qwen2.5-Coder 0.5B's attention (14/2 heads, D 64, float32), 2 threads, AMD EPYC Zen 3 VM: a
4,096-token prompt 552 -> 294 ms a layer (128 rows a tile: 341, 512: 314), a 1,019-token one
31.4 -> 20.0 ms; Gemma 3's global shape (4/1 heads, D 256) 515.6 -> 267.6 (128: 288.6, 512: 300.4) and 28.7 ->
19.9. Each query row's softmax is over the same visible columns either way."""


def query_tile_bounds(mask: torch.Tensor, rows: int) -> list[tuple[int, int, int, int]]:
    """``mask``'s ``[b, 1, Q, C]`` queries in tiles of ``rows``: per tile (first query, end, first column,
    end), every column some query of the tile sees (in any sequence) inside [first, end)."""
    bounds = []
    for q0 in range(0, mask.shape[2], rows):
        q1 = min(mask.shape[2], q0 + rows)
        seen = mask[:, :, q0:q1].any(dim=2).any(dim=1).any(dim=0).nonzero()
        c0, c1 = (int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, mask.shape[3])
        bounds.append((q0, q1, c0, c1))
    return bounds


def tiled_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               bounds: list[tuple[int, int, int, int]], scale: float, enable_gqa: bool) -> torch.Tensor:
    """SDPA of q ``[b, H, Q, D]`` over k, v ``[b, Hkv, C, D]`` with ``mask`` ``[b, 1, Q, C]``, one call per
    tile of ``bounds`` (``query_tile_bounds``) on the columns it sees."""
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    for q0, q1, c0, c1 in bounds:
        out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, c0:c1], v[:, :, c0:c1],
                                                          attn_mask=mask[:, :, q0:q1, c0:c1], scale=scale,
                                                          enable_gqa=enable_gqa)
    return out


def prompt_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                enable_gqa: bool, tiles: Callable[[], list[tuple[int, int, int, int]]] | None) -> torch.Tensor:
    """SDPA of a multi-token call (q ``[b, H, Q, D]``, k, v ``[b, Hkv, C, D]``, ``mask`` ``[b, 1, Q, C]``):
    in query tiles (``tiled_sdpa`` over ``tiles()``) above ``SDPA_TILE_QUERIES`` rows where ``tiles`` is
    given (a causal mask, no position bias), else one call. The backend and the route timing
    (prefill_routes.py) both run it."""
    if tiles is not None and q.shape[2] > SDPA_TILE_QUERIES:
        return tiled_sdpa(q, k, v, mask, tiles(), scale, enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def context_buckets(members: list[int], context_lens: list[int]) -> list[list[int]]:
    """``members`` (sequence indexes) cut into groups of similar context length (``BUCKET_RATIO``);
    one group in the given order when no cut is needed, none when ``members`` is empty."""
    if not members:
        return []
    ordered = sorted(members, key=lambda i: context_lens[i])
    buckets: list[list[int]] = [[]]
    for index in ordered:
        first = buckets[-1][0] if buckets[-1] else None
        if first is not None and (context_lens[index] > BUCKET_RATIO * context_lens[first]
                                  and context_lens[index] - context_lens[first] > BUCKET_MIN_COLUMNS):
            buckets.append([])
        buckets[-1].append(index)
    return buckets if len(buckets) > 1 else [members]


@dataclass
class _KVView:
    """The context columns one group reads for one attention span."""

    slots: torch.Tensor
    """[b * columns] flat slot of each column (0, masked, past a sequence's span)."""
    num_columns: int
    build_mask: Callable[[], torch.Tensor]
    """Makes ``mask`` on first use: the prefill_attention and paged_decode kernels never read it, and
    a 1,019-token prompt's four masks (two chunks, sliding and global) took ~2 ms, one thread."""
    biased: dict[PositionBias, torch.Tensor] = field(default_factory=dict)
    """position_bias -> [b, H, max_query, columns] float mask (non-causal views only)."""
    firsts: list[int] = field(default_factory=list)
    """Position of each sequence's first column."""
    spans: torch.Tensor | None = None
    """[b] int64 valid columns of each sequence (a decode's query sees all of them)."""
    tiles: dict[int, list[prefill_gemm.Tile]] = field(default_factory=dict)
    """query heads per KV head -> the view's prefill_gemm tiles (causal multi-token views)."""
    sequences: torch.Tensor | None = None
    """[b, 4] the prefill_attention kernel's rows for this view (built on first use)."""
    built_mask: torch.Tensor | None = None
    query_tile_bounds: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    """tile rows -> ``query_tiles``' bounds (built on first use, shared by the view's layers)."""

    @property
    def mask(self) -> torch.Tensor:
        """[b, 1, max_query, columns] bool: which columns each query sees."""
        if self.built_mask is None:
            self.built_mask = self.build_mask()
        return self.built_mask

    def query_tiles(self, rows: int) -> list[tuple[int, int, int, int]]:
        """The view's queries in tiles of ``rows``: per tile (first query, end, first column, end) with
        every column some query of the tile sees (over all the group's sequences) inside [first, end)."""
        bounds = self.query_tile_bounds.get(rows)
        if bounds is None:
            bounds = self.query_tile_bounds[rows] = query_tile_bounds(self.mask, rows)
        return bounds

    def biased_mask(self, position_bias: PositionBias, query_positions: torch.Tensor) -> torch.Tensor:
        """The bias where the mask is True, -inf elsewhere; columns are positions (start 0)."""
        cached = self.biased.get(position_bias)
        if cached is None:
            relative = torch.arange(self.num_columns)[None, None, :] - query_positions[:, :, None]
            bias = position_bias(relative.to(self.mask.device))                # [b, H, Q, C]
            cached = self.biased[position_bias] = bias.masked_fill(~self.mask, float("-inf"))
        return cached


@dataclass
class _Group:
    """Sequences attended in one SDPA call."""

    query_rows: torch.Tensor
    """[b * max_query] token row of each query (padding rows clamped to a valid row)."""
    query_valid: torch.Tensor
    """[b, max_query] bool, False on padding."""
    valid_rows: torch.Tensor
    """[num_valid] token rows of the valid queries, in query_rows order."""
    valid_index: torch.Tensor | None
    """[num_valid] positions of the valid queries in query_rows; None when all are valid."""
    is_identity: bool
    """query_rows is 0..T-1 and all valid: q and out need no gather or scatter."""
    num_sequences: int
    max_query: int
    # CPU tensors the views are built from
    table: torch.Tensor
    """[b, max_blocks] block ids."""
    starts: torch.Tensor
    """[b] position of each sequence's first query."""
    context_lens: torch.Tensor
    """[b] tokens in the cache after this step."""
    query_positions: torch.Tensor
    """[b, max_query] position of each query."""
    block_size: int
    device: torch.device
    row_starts: list[int] = field(default_factory=list)
    """First token row of each sequence."""
    query_lens: list[int] = field(default_factory=list)
    """Queries of each sequence."""
    views: dict[tuple[int | None, bool], _KVView] = field(default_factory=dict)
    """(sliding_window, is_causal) -> view, built on first use."""
    trees: list[DraftTree | None] | None = None
    """Per sequence, its draft tree (None: no sequence of the group has one)."""
    images: list[list[tuple[int, int]]] | None = None
    """Per sequence, its image blocks' (first, end) positions (None: no sequence of the group has one)."""

    def view(self, sliding_window: int | None, is_causal: bool = True) -> _KVView:
        key = (sliding_window, is_causal)
        cached = self.views.get(key)
        if cached is None:
            if sliding_window is not None and self._window_hides_nothing(sliding_window, is_causal):
                cached = self.views[key] = self.view(None, is_causal)
            else:
                cached = self.views[key] = self._build_view(sliding_window, is_causal)
        return cached

    def _window_hides_nothing(self, window: int, is_causal: bool) -> bool:
        """A decode group whose every query sits at a position below ``window``: the window's view
        (first column 0, ``kv > q - window`` always true) is the full view, so sliding layers share
        it (Gemma 3: 15 of 18 layers slide over 512; one view built per step instead of two)."""
        return (is_causal and self.max_query == 1 and self.trees is None
                and int(self.context_lens.max()) <= window)

    def _build_view(self, window: int | None, is_causal: bool = True) -> _KVView:
        if window is None:
            first = torch.zeros_like(self.starts)
        else:
            first = torch.clamp(self.starts - window + 1, min=0)
        spans = self.context_lens - first
        num_columns = int(spans.max())
        columns = torch.arange(num_columns)[None, :]
        kv_valid = columns < spans[:, None]                                    # [b, C]
        kv_positions = torch.where(kv_valid, first[:, None] + columns, first[:, None])
        block_index = kv_positions // self.block_size
        slots = self.table.gather(1, block_index) * self.block_size + kv_positions % self.block_size
        slots = torch.where(kv_valid, slots, torch.zeros_like(slots))
        return _KVView(slots=slots.reshape(-1).to(self.device), num_columns=num_columns,
                       build_mask=lambda: self._build_mask(window, is_causal, first, kv_valid, kv_positions),
                       firsts=first.tolist(), spans=spans.to(self.device))

    def _build_mask(self, window: int | None, is_causal: bool, first: torch.Tensor, kv_valid: torch.Tensor,
                    kv_positions: torch.Tensor) -> torch.Tensor:
        """The view's ``[b, 1, Q, C]`` mask from its columns' validity and positions ``[b, C]``."""
        columns = torch.arange(kv_valid.shape[1])[None, :]
        q_positions = self.query_positions[:, :, None]                        # [b, Q, 1]
        if is_causal:
            visible = kv_valid[:, None, :] & (kv_positions[:, None, :] <= q_positions)
            if self.images is not None:
                visible |= kv_valid[:, None, :] & self._same_image(kv_positions)
        else:
            assert not bool(self.starts.any()), "a non-causal sequence is computed whole, from 0"
            visible = kv_valid[:, None, :] & self.query_valid[:, :, None]
        if window is not None:
            visible &= kv_positions[:, None, :] > q_positions - window
        if self.trees is not None:
            assert is_causal, "draft trees are verified by causal decoders"
            self._apply_trees(visible, kv_positions, first, window)
        visible |= (~self.query_valid[:, :, None]) & (columns[:, None, :] == 0)
        return visible[:, None].to(self.device)

    def _same_image(self, kv_positions: torch.Tensor) -> torch.Tensor:
        """``[b, Q, C]``: the query and the column lie in one image block of their sequence."""
        assert self.images is not None
        q_positions = self.query_positions                                    # [b, Q]
        same = torch.zeros(q_positions.shape[0], q_positions.shape[1], kv_positions.shape[1], dtype=torch.bool)
        for index, blocks in enumerate(self.images):
            for first, end in blocks:
                in_query = (q_positions[index] >= first) & (q_positions[index] < end) & self.query_valid[index]
                in_column = (kv_positions[index] >= first) & (kv_positions[index] < end)
                same[index] |= in_query[:, None] & in_column[None, :]
        return same

    def _apply_trees(self, visible: torch.Tensor, kv_positions: torch.Tensor, first: torch.Tensor,
                     window: int | None) -> None:
        """Overwrite the tree sequences' rows of ``visible`` ``[b, Q, C]`` over their tree columns
        with the ancestor mask (and, on sliding layers, the window in rope positions)."""
        assert self.trees is not None
        for index, tree in enumerate(self.trees):
            if tree is None:
                continue
            start, num_queries = int(self.starts[index]), self.query_lens[index]
            assert window is None or start == tree.first_position, \
                "on sliding layers a tree's first query is its root"
            num_nodes = len(tree.parents)
            column = tree.first_position - int(first[index])
            row = max(0, tree.first_position - start)
            node = start + row - tree.first_position
            num_rows = num_queries - row
            rows = torch.zeros(num_rows, visible.shape[-1], dtype=torch.bool)
            rows[:, :column] = True                              # the context before the tree
            rows[:, column:column + num_nodes] = tree.ancestor_mask()[node:node + num_rows]
            if window is not None:
                depths = torch.tensor(tree.depths(), dtype=torch.int64) + tree.first_position
                kv_rope = kv_positions[index].clone()
                kv_rope[column:column + num_nodes] = depths
                q_rope = depths[node:node + num_rows]
                rows &= kv_rope[None, :] > q_rope[:, None] - window
            visible[index, row:row + num_rows] = rows

    def tiles(self, view: _KVView, window: int | None, group_size: int) -> list[prefill_gemm.Tile]:
        """The view's prefill_gemm tiles (built on first use, shared by the layers)."""
        cached = view.tiles.get(group_size)
        if cached is None:
            cached = view.tiles[group_size] = prefill_gemm.build_tiles(
                self.row_starts, self.query_lens, self.starts.tolist(), view.firsts,
                view.num_columns, window, group_size)
            if self.trees is not None:
                self._tree_tile_biases(view, cached)
        return cached

    def _tree_tile_biases(self, view: _KVView, tiles: list[prefill_gemm.Tile]) -> None:
        """A tree sequence's tiles take their bias from the view's mask (ancestors only)."""
        assert self.trees is not None
        mask = view.mask[:, 0].cpu()                                          # [b, Q, C]
        for tile in tiles:
            index = tile.column_start // view.num_columns
            if self.trees[index] is None:
                continue
            row = tile.row_start - self.row_starts[index]
            column = tile.column_start - index * view.num_columns
            seen = mask[index, row:row + tile.num_queries, column:column + tile.num_columns]
            tile.bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
            tile.is_positional = False

    @property
    def kv_slots(self) -> torch.Tensor:
        """[b, max_context] slot of each context position of the full view (for inspection)."""
        full = self.view(None)
        return full.slots.view(self.num_sequences, full.num_columns)


@dataclass
class TorchNativeMetadata:
    groups: list[_Group]


class TorchNativeAttention:
    """The portable reference backend: SDPA over gathered, padded context."""

    name = "torch_native"

    def __init__(self) -> None:
        paged_decode.load_kernel()  # at start-up: a first build takes a minute, never in a request
        for dtype in (torch.bfloat16, torch.float32):   # likewise (None where the CPU lacks the instructions)
            prefill_attention.load_kernel(dtype)
        self.prefill_routing = prefill_routes.PrefillRouting()
        """Which route multi-token causal calls take, per shape and query class (measured by the runner
        at start-up: ``prefill_routes.build_routing``; the constant order until then)."""

    def _prefill_route(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention,
                       max_query: int, no_trees: bool) -> str:
        """The first route of the measured ranking (prefill_routes.py) that computes this causal
        multi-token call here: the kernel needs q and pool of one dtype (bf16 or float32) and no draft
        trees, the GEMMs oneDNN."""
        for route in self.prefill_routing.order(layer.num_heads, layer.num_kv_heads, q.shape[-1], q.dtype,
                                                k_cache.dtype, max_query):
            if route == "sdpa":
                return route
            if route == "kernel" and no_trees and prefill_attention.supports(q, k_cache, v_cache):
                return route
            if route == "gemm" and prefill_gemm.supports(q):
                return route
        return "sdpa"

    def build_metadata(self, batch: ForwardBatch) -> TorchNativeMetadata:
        device = batch.input_ids.device
        query_starts: list[int] = []
        total = 0
        for n in batch.query_lens:
            query_starts.append(total)
            total += n
        trees = batch.trees
        if trees is None:
            decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
            others = [i for i, n in enumerate(batch.query_lens) if n != 1]
        else:  # a tree sequence always attends with its mask, never as a decode
            decodes = [i for i, n in enumerate(batch.query_lens) if n == 1 and trees[i] is None]
            others = [i for i, n in enumerate(batch.query_lens) if n != 1 or trees[i] is not None]
        table = batch.block_table.cpu()
        context_lens = [start + n for start, n in zip(batch.start_positions, batch.query_lens)]
        decode_kernel = device.type == "cpu" and paged_decode.load_kernel() is not None
        decode_lists = [decodes] if decodes and decode_kernel else context_buckets(decodes, context_lens)
        member_lists = decode_lists + context_buckets(others, context_lens)   # the kernel reads spans: no padding
        groups = [self._group(batch, table, members, query_starts, total, device) for members in member_lists]
        if trees is not None:
            for group, members in zip(groups, member_lists):
                if any(trees[i] is not None for i in members):
                    group.trees = [trees[i] for i in members]
        images = batch.images
        if images is not None:
            for group, members in zip(groups, member_lists):
                if group.max_query > 1 and any(images[i] for i in members):
                    group.images = [images[i] for i in members]
        return TorchNativeMetadata(groups=groups)

    @staticmethod
    def _group(batch: ForwardBatch, table: torch.Tensor, members: list[int], query_starts: list[int],
               num_tokens: int, device: torch.device) -> _Group:
        lens = [batch.query_lens[i] for i in members]
        max_query = max(lens)
        # up to the batch's LIST_ROWS query rows, from Python's lists (the ~15 small torch ops they
        # replace cost 5-10 us apiece in a one-stream step); a view's slots stay torch's: a list per
        # column costs more than the ops from a few hundred columns on
        if len(members) * max_query <= forward_batch.LIST_ROWS:
            return TorchNativeAttention._small_group(batch, table, members, query_starts, num_tokens, device, lens,
                                                     max_query)
        query_lens = torch.tensor(lens, dtype=torch.int64)
        starts = torch.tensor([batch.start_positions[i] for i in members], dtype=torch.int64)
        row_starts = torch.tensor([query_starts[i] for i in members], dtype=torch.int64)
        offsets = torch.arange(max_query)[None, :]
        query_valid = offsets < query_lens[:, None]
        query_rows = torch.where(query_valid, row_starts[:, None] + offsets, row_starts[:, None]).reshape(-1)
        all_valid = bool(query_valid.all())
        is_identity = all_valid and len(query_rows) == num_tokens and bool(
            torch.equal(query_rows, torch.arange(num_tokens)))
        valid_index = None if all_valid else torch.nonzero(query_valid.reshape(-1)).squeeze(1).to(device)
        return _Group(
            query_rows=query_rows.to(device),
            query_valid=query_valid,
            valid_rows=query_rows[query_valid.reshape(-1)].to(device),
            valid_index=valid_index,
            is_identity=is_identity,
            num_sequences=len(members),
            max_query=max_query,
            table=table[torch.tensor(members)],
            starts=starts,
            context_lens=starts + query_lens,
            query_positions=starts[:, None] + offsets,
            block_size=batch.block_size,
            device=device,
            row_starts=row_starts.tolist(),
            query_lens=query_lens.tolist(),
        )

    @staticmethod
    def _small_group(batch: ForwardBatch, table: torch.Tensor, members: list[int], query_starts: list[int],
                     num_tokens: int, device: torch.device, lens: list[int], max_query: int) -> _Group:
        """``_group``'s tensors from Python's lists (at most ``forward_batch.LIST_ROWS`` query rows): the same values."""
        starts = [batch.start_positions[i] for i in members]
        row_starts = [query_starts[i] for i in members]
        valid = [j < n for n in lens for j in range(max_query)]
        query_rows = [start + j if j < n else start for start, n in zip(row_starts, lens) for j in range(max_query)]
        all_valid = all(valid)
        valid_rows = [row for row, is_valid in zip(query_rows, valid) if is_valid]
        return _Group(
            query_rows=torch.tensor(query_rows, dtype=torch.int64).to(device),
            query_valid=torch.tensor(valid, dtype=torch.bool).view(len(members), max_query),
            valid_rows=torch.tensor(valid_rows, dtype=torch.int64).to(device),
            valid_index=None if all_valid else torch.tensor([index for index, is_valid in enumerate(valid) if is_valid],
                                                            dtype=torch.int64).to(device),
            is_identity=all_valid and query_rows == list(range(num_tokens)),
            num_sequences=len(members),
            max_query=max_query,
            table=table[torch.tensor(members)],
            starts=torch.tensor(starts, dtype=torch.int64),
            context_lens=torch.tensor([start + n for start, n in zip(starts, lens)], dtype=torch.int64),
            query_positions=torch.tensor([start + j for start in starts for j in range(max_query)],
                                         dtype=torch.int64).view(len(members), max_query),
            block_size=batch.block_size,
            device=device,
            row_starts=row_starts,
            query_lens=lens,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch, position_bias: PositionBias | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (rope applied) -> [T, H * D]."""
        batch.kv_cache.write(layer.layer_id, batch.slot_mapping, k, v)
        k_cache, v_cache = batch.kv_cache.layer(layer.layer_id)
        metadata: TorchNativeMetadata = batch.attn_metadata
        num_heads, num_kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, q.shape[-1]
        out = q.new_empty(q.shape[0], num_heads, v.shape[-1])
        for group in metadata.groups:
            b, max_query = group.num_sequences, group.max_query
            view = group.view(layer.sliding_window, layer.is_causal)
            columns = view.num_columns
            route = (self._prefill_route(q, k_cache, v_cache, layer, max_query, group.trees is None)
                     if max_query > 1 and layer.is_causal and position_bias is None and group.images is None
                     else "sdpa")   # an image block attends both ways: SDPA with the block mask
            if route == "kernel":
                if view.sequences is None:
                    view.sequences = prefill_attention.plan(group.row_starts, group.query_lens,
                                                            group.starts.tolist(), view.firsts)
                prefill_attention.attend(q, k_cache, v_cache, view.slots.view(b, columns), view.sequences,
                                         layer.sliding_window, layer.scale, out)
                continue
            if route == "gemm":
                tiles = group.tiles(view, layer.sliding_window, num_heads // num_kv_heads)
                prefill_gemm.attend(q, k_cache.index_select(0, view.slots).to(q.dtype),
                                    v_cache.index_select(0, view.slots).to(q.dtype), tiles,
                                    layer.scale, out)
                continue
            q_rows = q if group.is_identity else q.index_select(0, group.query_rows)
            if (max_query == 1 and layer.is_causal and position_bias is None and view.spans is not None
                    and group.trees is None
                    and v_cache.shape[-1] == head_dim and paged_decode.supports(q, k_cache)):
                rows = paged_decode.attend(q_rows, k_cache, v_cache, view.slots.view(b, columns),
                                           view.spans, layer.scale)             # [b, H, Dv]
                if group.is_identity:
                    out = rows
                else:
                    out.index_copy_(0, group.valid_rows, rows)
                continue
            mask = view.mask
            if position_bias is not None:  # non-causal, so every sequence starts at 0
                mask = view.biased_mask(position_bias, group.query_positions)
            k_context = k_cache.index_select(0, view.slots).view(b, columns, num_kv_heads, -1)
            v_context = v_cache.index_select(0, view.slots).view(b, columns, num_kv_heads, -1)
            k_context = k_context.to(q.dtype).transpose(1, 2)                 # [b, Hkv, C, D]
            v_context = v_context.to(q.dtype).transpose(1, 2)                 # [b, Hkv, C, Dv]
            if max_query == 1:
                # [b, Hkv, H/Hkv, D]: query heads of one KV head share its keys and the mask
                q_padded = q_rows.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
                if position_bias is not None:  # [b, H, 1, C] -> per folded query head
                    mask = mask.view(b, num_kv_heads, num_heads // num_kv_heads, columns)
                attended = F.scaled_dot_product_attention(q_padded, k_context, v_context,
                                                          attn_mask=mask, scale=layer.scale)
                rows = attended.reshape(b, num_heads, -1)                      # [b, H, Dv]
            else:
                q_padded = q_rows.view(b, max_query, num_heads, head_dim).transpose(1, 2)
                tiles = ((lambda: view.query_tiles(SDPA_TILE_QUERIES))
                         if layer.is_causal and position_bias is None else None)
                attended = prompt_sdpa(q_padded, k_context, v_context, mask, layer.scale,
                                       num_heads != num_kv_heads, tiles)          # [b, H, Q, Dv]
                rows = attended.transpose(1, 2).reshape(b * max_query, num_heads, -1)
            if group.is_identity:
                out = rows.reshape(out.shape)
            elif group.valid_index is None:
                out.index_copy_(0, group.valid_rows, rows)
            else:
                out.index_copy_(0, group.valid_rows, rows.index_select(0, group.valid_index))
        return out.reshape(q.shape[0], -1)
