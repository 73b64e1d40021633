"""Causal attention of multi-token sequences (prefill, chunks, verify) on CPU as two oneDNN GEMMs
per tile, skipping the key columns a tile cannot see.

torch's CPU SDPA computes every (query, key) pair of the padded ``[Q, C]`` block its mask covers,
masked or not (``is_causal`` measured no faster than an explicit mask), and its float32 GEMMs are
MKL's, which take a slow path on the AMD EPYC dev box (see ``layers/linear.py:dense_linear``).
Here each sequence's queries are cut into tiles of at most ``TILE_QUERIES`` rows; a tile reads
only the key columns some query of it can see (from ``first query - window + 1``, or 0, up to its
last query), so the causal upper triangle and, on sliding layers, everything left of the window
are never computed. Per tile and KV head the query heads sharing that KV head are stacked into one
``[G * n, D]`` operand (GQA without expanding K/V) and the tile runs

    scores = (q * scale) @ K.T   (oneDNN)   -> hidden columns -inf -> softmax -> probs @ V   (oneDNN)

(the middle step one C++ call, ``fused.causal_softmax``, where the fused ops are built).

Invariants:
- Every query sees at least its own position, so no softmax row is fully masked.
- A tile's ``[G * n, columns]`` scores stay under ``MAX_SCORE_ELEMENTS`` (tiles shrink on long
  contexts), so memory does not grow with the square of the context.
- Softmax runs in float32 whatever the compute dtype; the GEMMs run in the compute dtype.
- The tiling (per group, sliding window) is built once per forward from CPU tensors and reused by
  every layer with that window; layers only slice the gathered context and call the GEMMs.

Measured (1 thread, CPU time, load ~9 on the 2-core dev box; Gemma 3 270M shapes, 4 query heads
on 1 KV head, head_dim 256, float32, second 512-token chunk of a 1,019-token prompt against 1,018
context columns, sliding window 512): SDPA with the view's mask 25 ms; SDPA in 128-query tiles
17 ms; oneDNN GEMMs (untiled) ~11.5 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.model.layers import fused

TILE_QUERIES = 128
"""Most query rows per tile: smaller tiles skip more masked columns, larger ones make bigger GEMMs."""

MAX_SCORE_ELEMENTS = 1 << 22
"""Cap on one tile's ``[G * n, columns]`` scores (16 MiB of float32)."""

_ONEDNN = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
"""oneDNN's bf16 inner product exists only on CPUs with AVX-512 (BW or BF16) or AMX: on an AVX2-only
CPU it raises "could not create a primitive descriptor", so bf16 operands take ``@`` there."""


@dataclass(slots=True)
class Tile:
    """Queries of one sequence attended together, and the context columns they read."""

    row_start: int
    """First token row of the tile's queries (in the forward's packed rows)."""
    num_queries: int
    column_start: int
    """First column of the group's gathered context ``[b * columns]`` the tile reads."""
    num_columns: int
    bias: torch.Tensor | None
    """[num_queries, num_columns] float32, -inf where a query must not see a column, else 0; None:
    every query sees every column. Added to the scores: 8x faster than ``masked_fill_`` with a
    bool mask broadcast over the heads (0.06 against 0.50 ms for [4, 128, 639], one thread)."""
    query_position: int
    """Position of the tile's first query."""
    key_position: int
    """Position of the key in the tile's first column."""
    window: int | None
    """The layer's sliding window (None: global)."""
    is_positional: bool = True
    """``bias`` is the causal (and window) mask of the positions, which ``fused.causal_softmax``
    recomputes; False: a mask of its own (a draft tree's ancestors), added as ``bias``."""


def build_tiles(row_starts: list[int], query_lens: list[int], starts: list[int], firsts: list[int],
                group_columns: int, window: int | None, group_size: int) -> list[Tile]:
    """Tiles of every sequence of a group. ``firsts[i]``: position of sequence i's first gathered
    column (its columns are ``i * group_columns ..``); ``starts[i]``: position of its first query."""
    tiles: list[Tile] = []
    for index, (row_start, num_queries, start, first) in enumerate(
            zip(row_starts, query_lens, starts, firsts)):
        context = start + num_queries
        step = max(1, min(TILE_QUERIES, MAX_SCORE_ELEMENTS // max(1, group_size * context)))
        for offset in range(0, num_queries, step):
            n = min(step, num_queries - offset)
            q_first, q_last = start + offset, start + offset + n - 1
            k_first = first if window is None else max(first, q_first - window + 1)
            k_end = q_last + 1
            q_positions = torch.arange(q_first, q_last + 1)[:, None]
            k_positions = torch.arange(k_first, k_end)[None, :]
            hidden = k_positions > q_positions
            if window is not None:
                hidden |= k_positions <= q_positions - window
            bias = (torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
                    if bool(hidden.any()) else None)
            tiles.append(Tile(row_start + offset, n, index * group_columns + k_first - first,
                              k_end - k_first, bias, q_first, k_first, window))
    return tiles


def _matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for contiguous 2-D operands (oneDNN on CPU)."""
    if _ONEDNN and x.device.type == "cpu" and (_ONEDNN_BF16 or x.dtype != torch.bfloat16):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight.T


FUSED_SOFTMAX = True
"""The tile's float32 copy, mask, softmax and rounding back as one call (layers/fused.py's
``causal_softmax``, 0.6x the time of the four torch ops); False: the torch ops (benchmarks/step_ab.py
--change prefill_softmax)."""

BF16_MM_V = True
"""bf16: ``probs @ V`` through ``torch.mm`` on V as it lies in the context. The float32 path (and
this one switched off) copies V transposed per tile for oneDNN's linear: the copy was 6-10% of the
prefill attention (benchmarks/step_ab.py --change prefill_v_mm); both give the same bits in bf16."""


def _probs_times_v(probs: torch.Tensor, v_head: torch.Tensor) -> torch.Tensor:
    """``probs [G * n, C] @ v_head [C, Dv]``. float32 stays on oneDNN's linear (torch.mm's float32
    GEMM is MKL's slow path on AMD, see layers/linear.py)."""
    if BF16_MM_V and probs.dtype == torch.bfloat16:
        return torch.mm(probs, v_head)
    return _matmul_t(probs, v_head.t().contiguous())


def supports(q: torch.Tensor) -> bool:
    """Whether ``attend`` serves these queries here (CPU, float32 or bfloat16)."""
    return _ONEDNN and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def attend(q: torch.Tensor, k_context: torch.Tensor, v_context: torch.Tensor, tiles: list[Tile],
           scale: float, out: torch.Tensor) -> None:
    """q ``[T, H, D]``; k/v_context ``[b * columns, Hkv, D]`` gathered for the group; writes the
    attended rows ``[n, H, Dv]`` of every tile into ``out`` ``[T, H, Dv]``."""
    num_heads, num_kv_heads = q.shape[1], k_context.shape[1]
    group_size = num_heads // num_kv_heads
    for tile in tiles:
        n, rows = tile.num_queries, slice(tile.row_start, tile.row_start + tile.num_queries)
        columns = slice(tile.column_start, tile.column_start + tile.num_columns)
        q_tile = q[rows]                                                     # [n, H, D]
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
            q_heads = (q_tile[:, heads].transpose(0, 1) * scale).reshape(group_size * n, -1)
            k_head = k_context[columns, kv_head].contiguous()                 # [C, D]
            scores = _matmul_t(q_heads, k_head)                              # [G * n, C]
            if FUSED_SOFTMAX and tile.is_positional and fused.applies(scores):
                probs = fused.causal_softmax(scores, n, tile.query_position, tile.key_position, tile.window)
            else:
                scores = scores.float()
                if tile.bias is not None:
                    scores.view(group_size, n, -1).add_(tile.bias)
                probs = torch.softmax(scores, dim=-1).to(q.dtype)
            attended = _probs_times_v(probs, v_context[columns, kv_head])      # [G * n, Dv]
            out[rows, heads] = attended.view(group_size, n, -1).transpose(0, 1)
