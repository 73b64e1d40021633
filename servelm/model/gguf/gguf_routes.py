"""Which computation a GGUF block linear runs for a call: the routes, the quality rules, the rows' facts.

A route is one way to compute ``x @ W.T`` from a ``BlockWeight`` (gguf_linear.py runs them):

- ``block``: the block kernel (gguf_kernel's module API: ``block_linear_a16`` / ``block_linear`` /
  ``block_linear_float`` per activation mode, whatever instructions it was built for), on the codes.
- ``tiles``: the same codes through the AVX2 build's float-activation tiles (``packed_float``, or
  ``block_linear_float`` on int8 codes): activations unrounded, weight rows dequantized once per call
  into an L2-sized tile, then register-blocked float32 FMAs (rows from a dozen up: bound by FMAs, not
  bytes). A layer whose block route rounds its activations to 16 or 8 bits gets it beside that route.
- ``rows``: the rows kernel's GEMM (gguf_rows ``rows_gemm``) on a packed copy, bf16 activations.
- ``packed``: the same GEMM on a copy of the codes at their bit width (Q4_0/Q4_1/Q4_K nibbles, Q5_0 five
  bits): fewer bytes a call, more instructions to widen them (few rows: bound by memory, it wins).
- ``int8``: the int8 GEMM (gguf_i8gemm ``i8_gemm``) on its own copy, activations rounded to int8.
- ``amx``: the dense copy's product (weights bf16(code x scale + offset)) on Intel AMX tiles, widened per
  call from the rows kernel's copy (gguf_rows ``amx_gemm``: the bit-width copy where the type has one, else
  the byte copy), so that no weight is read at 2 bytes; ``AMX_FIRST_ROW`` to ``AMX_LAST_ROW`` rows, not the LM head.
- ``dense``: torch's GEMM (oneDNN) on a copy dequantized once at load (bf16 where the CPU has a
  native bf16 GEMM, else float32).

Which route is fastest is measured on the machine at hand (servelm/model/routes.py) and handed to
each layer as a ``RouteRanking``; which routes are *allowed* is a rule, never a measurement
(``allowed``): generation rows (decode, verify, logits rows) never take int8-rounded activations;
the KV projections (``I8_GEMM_SKIPPED``; a merged QKV's queries may on their own, ``I8_GEMM_LEAD``)
and the LM head never take the int8 GEMM; ``float``
activations (the exact mode) never do; a float32 model's rows up to ``F32_EXACT_ROWS`` keep a route
that does not round them to bf16 where one is held. In a pass that mixes prompt and generation rows,
the generation rows come out as a pass of only them computes them (gguf_linear.py ``apply``).

``PassRows`` is the per-pass fact the layers need (which rows are generation rows); it travels with
the forward batch (``ForwardBatch.rows`` / ``head_rows``), never in module or thread state.

``default_ranking`` is the ranking the Zen 5 measurements of earlier sessions gave (benchmarks/
RESULTS.md): used where no measurement was made (over the start-up budget, a cell not measured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch


class Route(str, Enum):
    BLOCK = "block"
    TILES = "tiles"
    ROWS = "rows"
    PACKED = "packed"
    INT8 = "int8"
    DENSE = "dense"
    AMX = "amx"


ROW_INDEPENDENT = frozenset({Route.BLOCK, Route.TILES, Route.ROWS, Route.PACKED, Route.AMX})
"""Routes whose result for a row does not depend on the other rows of the call (a row-by-row kernel);
a oneDNN GEMM's blocking and the int8 GEMM's may, so a mixed pass recomputes generation rows there."""

ROW_CLASSES = (1, 4, 8, 16, 32, 48, 64, 128, 512)
"""Row counts serving produces, measured one each: a call of m rows takes the measurement of the
smallest class >= m (the last for a larger prefill chunk)."""

MAX_ROWS_RESOLVED = ROW_CLASSES[-1]
"""Rows up to which a layer's routes are resolved one by one; more rows take this count's route."""

I8_GEMM_SKIPPED = ("qkv_proj", "k_proj", "v_proj")
"""Layers (by their module name's last part) that never take the int8 GEMM: the projections whose
results the KV cache keeps. Their prefill rows, rounded to int8, reach every later token's
attention; off the int8 GEMM Gemma 3 keeps 88% of benchmarks/quant_quality.py's greedy outputs
identical to float32 instead of 75% (a quality rule)."""

I8_GEMM_LEAD = ("qkv_proj",)
"""Merged layers (by their module name's last part) whose leading part, the query projection, may take
the int8 GEMM for prompt rows where its own shape's routes say so, while the rest (K and V, which the
cache keeps) takes the layer's own route for the call, the dense copy or the rows kernel's tiles after the
queries' (``GGUFBlockLinearMethod.run_lead``; the same K and V either way): queries are not cached. benchmarks/quant_quality.py, 288 prompts: Qwen2.5-Coder 0.5B 81% identical (81%
without), perplexity 47.38 (47.38); Gemma 3 270M 78% (77%), perplexity 30.00 (29.94) (a quality rule)."""

KERNEL_MAX_ROWS = {"int16": 16, "int8": 32, "float": 16}
"""Default (Zen 5, benchmarks/gguf_kernels.py) rows up to which the block kernel beat the dense copy
for float32 rows and the LM head."""
BF16_KERNEL_MAX_ROWS = {"int16": 4, "int8": 6, "float": 4}
"""Default (Zen 5, benchmarks/gguf_rows.py) rows up to which the block kernel beat a bf16 dense copy
for a bf16 model's layers."""
ROWS_KERNEL_LAST_ROW = 48
"""Default (Zen 5, benchmarks/gguf_rows.py) last row count at which the rows kernel beat the dense
bf16 copy for a layer (the LM head: every row count)."""
I8_GEMM_FIRST_ROW = 49
"""Default (Zen 5, benchmarks/gguf_rows.py) first row count at which prompt rows take the int8 GEMM."""

F32_EXACT_ROWS = KERNEL_MAX_ROWS
"""A quality rule: a float32 model's rows up to this many (per activation mode) never take a route
that rounds them to bf16 (the rows kernel, a bf16 dense copy) where the block kernel is held, so
its greedy tokens stay those of earlier releases (which ran these rows on the block kernel)."""


@dataclass(frozen=True, slots=True)
class LinearShape:
    """What decides a GGUF linear's speeds: inputs K, outputs N, the block type and its role."""

    in_features: int
    out_features: int
    kind: str
    """The GGUF type (Q8_0, Q4_K, ...): block size and offsets change the kernels' work."""
    is_head: bool
    """The LM head: float32 logits out, no int8 GEMM (its rows are generation rows)."""
    may_int8: bool
    """Whether prompt rows may take the int8 GEMM (not the head, the KV projections, ``float``)."""

    @property
    def name(self) -> str:
        role = "head" if self.is_head else ("layer" if self.may_int8 else "kv")
        return f"{role} {self.in_features}x{self.out_features} {self.kind}"


@dataclass(frozen=True, slots=True)
class PassRows:
    """Which rows of one forward pass (or of its LM head's call) are generation rows.

    Invariant: ``generation_rows`` is None unless the pass mixes generation and prompt rows."""

    num_rows: int
    """Rows of the pass: a call with as many computes every row of it."""
    generation_only: bool
    """Every row is a generation row (decode, verify, prompt logprobs): none takes int8."""
    generation_rows: torch.Tensor | None = None
    """[G] int64 indices of the generation rows of a mixed pass, else None."""

    @classmethod
    def of(cls, row_counts: list[int], generation: list[bool]) -> PassRows:
        """``row_counts[i]`` rows belong to sequence i, a generation sequence where ``generation[i]``."""
        if all(generation):
            return cls(sum(row_counts), True)
        if not any(generation):
            return cls(sum(row_counts), False)
        index: list[int] = []
        start = 0
        for count, is_generation in zip(row_counts, generation):
            if is_generation:
                index.extend(range(start, start + count))
            start += count
        return cls(start, False, torch.tensor(index, dtype=torch.long))

    def mixed_generation_rows(self, num_rows: int) -> torch.Tensor | None:
        """The generation rows' indices where a call of ``num_rows`` computes every row of a mixed pass."""
        return self.generation_rows if self.generation_rows is not None and num_rows == self.num_rows else None


GENERATION_ONLY = PassRows(0, True)
"""A pass of generation rows only (a mixed pass's generation rows recomputed alone)."""


TILES_FIRST_ROW = 12
"""Rows from which the ``tiles`` route runs its weight tiles (gguf_kernel_avx2.cpp ``kFloatTileRows``,
the module's ``FLOAT_TILE_ROWS``): fewer rows of int8 codes take the float row tiles, another
kernel, and fewer rows of packed codes dequantize a tile for a handful of rows. Below it the route
is not offered, so a one-row step keeps the block route's prepared call (the flat decode's)."""

HEAD_SCREEN_ROWS = 16
"""Logits rows up to which the LM head keeps off the ``tiles`` route: the greedy screen
(lm_head_screen.py, ``MAX_SCREEN_ROWS``) takes a step only where the full head's route there is the
int16 block kernel or the rows kernel, whose argmax it reproduces, and a table measuring the full
head alone (not the screen beside it) would otherwise hand those steps to the tiles."""


AMX_FIRST_ROW = 8
"""Rows from which the ``amx`` route is offered: it widens every weight of the call to bf16 (~0.08 ns a weight
on 2 threads of the Xeon of sessions 46-47), which only a batch's rows pay back against the dense copy's 2
bytes a weight (benchmarks/RESULTS.md "Session 47"); fewer rows keep the prepared decode calls of the other
routes."""
AMX_LAST_ROW = 128
"""Rows up to which the ``amx`` route is offered (batched decode and short prompt chunks): on the Xeon of
session 47 its cells won some layers' 512-row class in the table, yet a Gemma 3 prefill took 4-8% longer
with them than on the dense copy, whose GEMM a long chunk keeps busy."""


def offered(route: Route, shape: LinearShape, rows: int) -> bool:
    """Whether ``route`` is offered to a call of ``rows`` rows of this shape at all, before the quality
    rules (``allowed``) and so before any timing (model/routes.py): ``tiles`` from TILES_FIRST_ROW rows,
    on the LM head above HEAD_SCREEN_ROWS; ``amx`` from AMX_FIRST_ROW rows, never on the LM head (its
    greedy screens are chosen beside the full head's route) up to AMX_LAST_ROW; every other route always."""
    if route is Route.AMX:
        return AMX_FIRST_ROW <= rows <= AMX_LAST_ROW and not shape.is_head
    return route is not Route.TILES or (rows >= TILES_FIRST_ROW and not (shape.is_head and rows <= HEAD_SCREEN_ROWS))


def allowed(route: Route, shape: LinearShape, x_bf16: bool, rows: int, is_prompt: bool,
            held: frozenset[Route], activations: str, dense_bf16: bool) -> bool:
    """The quality rules: whether ``route`` may compute ``rows`` rows of this shape (``held``: the
    routes whose kernel is built and copy is kept; ``dense_bf16``: the dense copy is bf16), among the
    routes ``offered`` there."""
    if route not in held or not offered(route, shape, rows):
        return False
    if route is Route.INT8 and not (is_prompt and shape.may_int8):
        return False
    rounds_to_bf16 = route in (Route.ROWS, Route.PACKED, Route.AMX) or (route is Route.DENSE and dense_bf16)
    if not x_bf16 and rounds_to_bf16 and rows <= F32_EXACT_ROWS[activations] and Route.BLOCK in held:
        return False
    return True


Ranking = Callable[[LinearShape, bool, int], tuple[Route, ...]]
"""(shape, x is bf16, rows) -> routes fastest first; every route named once."""


def default_ranking(shape: LinearShape, x_bf16: bool, rows: int, activations: str = "int16",
                    dense_bf16: bool = True, int8_built: bool = True) -> tuple[Route, ...]:
    """Earlier sessions' constants (Zen 5) as a ranking: the int8 GEMM from ``I8_GEMM_FIRST_ROW``
    rows, the rows kernel for bf16 rows (a layer's up to ``ROWS_KERNEL_LAST_ROW``, the head's all),
    the block kernel up to ``KERNEL_MAX_ROWS`` (``BF16_KERNEL_MAX_ROWS`` for a bf16 model's layer
    beside a bf16 copy), then the dense copy, whose memory a head or a layer with the int8 copy
    (``int8_built``) spares by taking the rows kernel instead."""
    order: list[Route] = []
    if rows >= I8_GEMM_FIRST_ROW:
        order.append(Route.INT8)
    if x_bf16 and (shape.is_head or rows <= ROWS_KERNEL_LAST_ROW):
        order.append(Route.ROWS)
    limit = (BF16_KERNEL_MAX_ROWS if x_bf16 and dense_bf16 and not shape.is_head else KERNEL_MAX_ROWS)[activations]
    if rows <= limit:
        order.append(Route.BLOCK)
    spare_dense = shape.is_head or (shape.may_int8 and int8_built)
    order += [Route.ROWS, Route.DENSE] if spare_dense else [Route.DENSE, Route.ROWS]
    return complete(order)


def complete(order: list[Route] | tuple[Route, ...]) -> tuple[Route, ...]:
    """``order`` without repeats, then every route it does not name (block and tiles last: they need
    no copy)."""
    seen: list[Route] = []
    for route in (*order, Route.DENSE, Route.ROWS, Route.PACKED, Route.INT8, Route.AMX, Route.BLOCK, Route.TILES):
        if route not in seen:
            seen.append(route)
    return tuple(seen)


@dataclass(frozen=True, slots=True)
class LayerRoutes:
    """One GGUF layer's route for every call, resolved once at load from a ranking and the rules.

    ``by_rows[x_bf16][is_prompt][m]`` is the route of an m-row call (m = 1 .. ``MAX_ROWS_RESOLVED``;
    index 0 unused; more rows take the last). Invariant: every route it names is in ``held`` and
    allowed there (``allowed``); ``held`` is what the model's own dtype's calls chose (the copies
    the layer keeps) plus the block kernel where built (it needs no copy)."""

    shape: LinearShape
    held: frozenset[Route]
    by_rows: tuple[tuple[tuple[Route, ...], tuple[Route, ...]], tuple[tuple[Route, ...], tuple[Route, ...]]]
    dense_rows: int = 0
    """Rows per oneDNN call on the dense copy: a call of more rows is cut into even calls of at most
    this many (0: one call), where the table measured that faster (model/routes.py ``DENSE_CALL_ROWS``)."""

    def pick(self, rows: int, x_bf16: bool, is_prompt: bool) -> Route:
        return self.by_rows[x_bf16][is_prompt][min(rows, MAX_ROWS_RESOLVED)]

    def same_route_rows(self, x_bf16: bool, prompt_too: bool, routes: frozenset[Route] | None = None) -> int:
        """Most rows m such that every call of 1..m rows takes the 1-row generation route, or one of
        ``routes`` where given (and the prompt rows' too where ``prompt_too``): how far a prepared
        decode call reaches."""
        taken = routes or frozenset({self.by_rows[x_bf16][False][1]})
        last = 0
        for m in range(1, MAX_ROWS_RESOLVED + 1):
            if self.by_rows[x_bf16][False][m] not in taken or (prompt_too and self.by_rows[x_bf16][True][m] not in taken):
                break
            last = m
        return last

    @classmethod
    def resolve(cls, shape: LinearShape, available: frozenset[Route], ranking: Ranking, model_bf16: bool,
                activations: str, dense_bf16: bool) -> LayerRoutes:
        """Each call's route: the first allowed route of ``ranking`` among ``available`` (kernels
        built); the copies kept are those the model dtype's calls chose."""
        def table(x_bf16: bool, held: frozenset[Route]) -> tuple[tuple[Route, ...], tuple[Route, ...]]:
            sides = []
            for is_prompt in (False, True):
                side = [Route.BLOCK]
                for m in range(1, MAX_ROWS_RESOLVED + 1):
                    side.append(next(route for route in ranking(shape, x_bf16, m)
                                     if allowed(route, shape, x_bf16, m, is_prompt, held, activations, dense_bf16)))
                sides.append(tuple(side))
            return sides[0], sides[1]

        if not available - {Route.INT8}:
            available = available | {Route.DENSE}   # generation rows need a route without int8
        chosen = table(model_bf16, available)
        held = frozenset(chosen[0][1:]) | frozenset(chosen[1][1:]) | (available & {Route.BLOCK})
        holding = getattr(ranking, "holding", None)
        if holding is not None and held - {Route.BLOCK, Route.TILES}:
            # the copies kept now cost nothing more: every cell ranks their routes without the margin a
            # copy must win by (routes.py COPY_MARGIN); a cell then takes its first choice or a held
            # route, so no copy is added (and one no cell takes any more is dropped)
            ranking = holding(held)
            chosen = table(model_bf16, available)
            held = frozenset(chosen[0][1:]) | frozenset(chosen[1][1:]) | (available & {Route.BLOCK})
        # the other dtype (rare: a float32 residual's head) falls back along the ranking to a held route
        other = table(not model_bf16, held | (frozenset() if held - {Route.INT8} else {Route.DENSE}))
        by_rows = (other, chosen) if model_bf16 else (chosen, other)
        dense_rows = getattr(ranking, "dense_call_rows", None)
        return cls(shape, held, by_rows,
                   dense_rows(shape, model_bf16) if dense_rows is not None and Route.DENSE in held else 0)
