"""The GGUF route table: which route each linear shape takes at each row class, measured here.

For every distinct GGUF linear of the loaded model (``LinearShape``: K, N, GGUF type, role) with two
or more routes whose kernels are built (gguf_linear.py ``GGUFBlockLinearMethod.available``), and
each row class of ``ROW_CLASSES``, the routes are timed on a synthetic weight of that shape
(servelm/model/timing.py) and ranked fastest first. The quality rules are not measured: the layers
apply them to the ranking (gguf/gguf_routes.py ``allowed``), so a fast int8 route still never
takes generation rows. After every shape's cells, a layer holding the dense copy also has its
longer prompt chunks timed in one oneDNN call and cut into calls of ``DENSE_CALL_ROWS`` rows
(``RouteTable.split_cell_name``; ``LayerRoutes.dense_rows``).

The table is keyed by what decides it (``table_key``: CPU model and flags, threads, the kernels'
build keys, torch's version, the model's shapes and dtypes) and kept as JSON under
``~/.cache/servelm/routes/``. At start-up the missing cells are measured within
``STARTUP_BUDGET_S``; cells left over take the defaults (earlier sessions' constants,
``gguf_routes.default_ranking``), the log says so, and the next start (or ``servelm tune MODEL``,
which has no budget) measures the rest. A shape with a single route has no route cells timed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import contextlib
import copy
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from servelm.files import atomic_write_text
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_linear import dense_calls
from servelm.model.gguf.gguf_routes import ROW_CLASSES, LinearShape, Ranking, Route, complete, offered
from servelm.model.threads import ThreadGovernor
from servelm.model.timing import time_candidates

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.path.expanduser("~/.cache/servelm/routes"))
STARTUP_BUDGET_S = 10.0
"""Seconds of start-up the measurement may add: on 2 cores Qwen2.5-Coder 0.5B's 7 shapes at every row class
(62 cells with the AVX2 int8 GEMM's prompt rows: 8 s on a Zen 3; 5 s measured 36-46 of them, and the defaults
then kept dense float32 copies for the rest: 1.95 GiB of copies on the first start instead of 1.4-1.6) fit;
over it the defaults serve and the next start goes on."""
MEASURE_MAX_OUTPUTS = 8192
"""Outputs of the synthetic weight a shape is timed on (the LM head's 150-260k are cut to this):
every route's time grows linearly in N past a few thousand outputs, so the ranking holds."""
COPY_MARGIN = {Route.BLOCK: 0.0, Route.TILES: 0.0, Route.PACKED: 0.02, Route.ROWS: 0.03, Route.INT8: 0.03, Route.DENSE: 0.2,
               Route.AMX: 0.02}
"""How much faster a route must be to rank above one that needs a smaller copy of the weight (the
block kernel reads the blocks themselves; the rows and int8 copies cost ~1 byte per weight, the
packed route's 0.5-0.63, the dense one 2-4): a copy a layer keeps for a few percent is memory a server
could use for KV blocks. The dense copy's 20%: on 2 Zen 3 cores its float32 GEMM led the block kernel's
tiles by 7-16% at 512 generation rows only, on every layer of Qwen2.5-Coder 0.5B (1.43 GB of copies
for batches of 129-512 decodes), by 7-33% at 48-512 rows on Gemma 3's. Once a layer keeps a copy for
some cell, its other cells rank that route without the margin (``MeasuredRanking.holding``)."""
MEASURE_MIN_BYTES = 96 << 20
"""Bytes of weight copies a shape's timing cycles through (``cold_copies``): more than the
last-level cache, as in serving, where a step reads every layer's weights once."""
MEASURE_MAX_COPIES = 64
"""Clones of a small shape's weight at most (``cold_copies``)."""
MEASUREMENT = 4
"""The measuring method's version, in the table's key: 4 times the rows kernel's prefetch first
(``PREFETCH_CELL``) and every cell with the faster set (3's cells were timed with non-temporal prefetches,
1.7-2.8x slow at one row on an Intel Xeon with AMX); 3 keeps no cell timed while other processes kept
the engine's cores busy (2 kept them: a 2-thread table measured beside a busy core ranked a Gemma 3
QKV's dense copy first at one row, 7.1 ms against 5.0 for calls that take 0.09-0.12 ms quiet, which
sent every one-row step off the flat decode); 2 times cold copies with the model's code range (1, a
single hot copy with 8-bit codes, ranked routes reading more bytes too high)."""

DENSE_CALL_ROWS = ROW_CLASSES[-1]
"""Rows per call a prompt chunk of more rows may be cut into on the dense copy (gguf_linear.py
``dense_calls``), where ``DENSE_SPLIT_ROWS`` rows in such calls measured faster than in one by
``DENSE_SPLIT_MARGIN``: on an Intel Xeon with AMX (2 threads) oneDNN's bf16 GEMM ran 1,019 x 2,048 x 640 at
~780 GFLOP/s and two calls of ~510 rows at ~1,400, while the wider outputs (640 x 4,096) lost ~15% cut."""
DENSE_SPLIT_ROWS = 2 * DENSE_CALL_ROWS
"""The prompt chunk the cut is measured at (the default chunk is at most 512 rows per request, a
request alone or several requests' chunks together take more)."""
DENSE_SPLIT_MARGIN = 0.05
"""How much faster the cut calls must be to be taken (the timing's noise on a shared VM)."""

PREFETCH_CELL = "rows kernel prefetch"
"""The table's cell timing one row on the rows kernel with its codes prefetched non-temporal (``nta``) and
into every cache level (``t0``) (gguf_rows.cpp ``set_nta_prefetch``; times only, ``RouteTable.nta_prefetch``):
measured first, and the faster set on the kernel before any route cell is timed. Non-temporal lines made
one-row steps 5-16% faster on an AMD Zen 4 VM; on an Intel Xeon with AMX (session 47) the same calls took
1.7-2.8x as long as with T0 prefetches."""

HEAD_ROW_CLASSES = tuple(rows for rows in ROW_CLASSES if rows <= 128)
"""The LM head's rows are logits rows: one per running stream (plus verify and logprob rows)."""


@dataclass
class RouteTable:
    """Ranked routes per (shape, rows' dtype, row class), keyed by what decides them."""

    key: dict[str, Any]
    cells: dict[str, list[str]] = field(default_factory=dict)
    """``cell_name(...)`` -> route names fastest first (only the routes built here)."""
    times_us: dict[str, dict[str, float]] = field(default_factory=dict)
    """The same cells -> each route's median microseconds per call (on ``MEASURE_MAX_OUTPUTS`` outputs)."""
    busy: dict[str, float] = field(default_factory=dict)
    """Cells timed while other processes kept this process's cores busy -> those cores (``measure_shape``):
    not kept, not saved; the defaults serve them until a later measurement."""

    @staticmethod
    def cell_name(shape: LinearShape, x_bf16: bool, rows: int) -> str:
        return f"{shape.name} {'bf16' if x_bf16 else 'f32'} {rows}"

    @staticmethod
    def split_cell_name(shape: LinearShape, x_bf16: bool) -> str:
        """The cell timing ``DENSE_SPLIT_ROWS`` rows on the dense copy in one call (``whole``) and in
        calls of ``DENSE_CALL_ROWS`` (``cut``)."""
        return f"{RouteTable.cell_name(shape, x_bf16, DENSE_SPLIT_ROWS)} dense calls"

    def nta_prefetch(self) -> bool:
        """Whether the rows kernel prefetches a one-group call's codes non-temporal: where ``PREFETCH_CELL``
        measured that faster, or (the earlier constant) where the cell was not measured."""
        times = self.times_us.get(PREFETCH_CELL, {})
        return times["nta"] < times["t0"] if "nta" in times and "t0" in times else True

    def ranking(self, fallback: Ranking) -> MeasuredRanking:
        """The table as a ``Ranking`` (a call of m rows takes the smallest measured class >= m;
        ``fallback`` where the cell was not measured)."""
        return MeasuredRanking(self, fallback)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]

    def path(self, cache_dir: Path | None = None) -> Path:
        return (cache_dir or CACHE_DIR) / f"routes_{self.digest()}.json"

    def save(self, cache_dir: Path | None = None) -> None:
        path = self.path(cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        # two ranks of one machine may save the same table at once (a shared temporary name let one
        # rename the other's file away)
        atomic_write_text(path, json.dumps({"key": self.key, "cells": self.cells, "times_us": self.times_us},
                                           indent=1))

    @classmethod
    def load(cls, key: dict[str, Any], cache_dir: Path | None = None) -> RouteTable:
        """The cached table for ``key`` (its file is named by the key's hash), or an empty one."""
        table = cls(key)
        try:
            data = json.loads(table.path(cache_dir).read_text())
        except (OSError, ValueError):
            return table
        if data.get("key") != key:   # a hash collision or a hand-edited file: measure again
            return table
        table.cells, table.times_us = data.get("cells", {}), data.get("times_us", {})
        return table


@dataclass(frozen=True)
class MeasuredRanking:
    """A ``Ranking`` from a table: each cell's routes by measured time, a route that needs a copy of the
    weight counted ``1 + COPY_MARGIN`` times as slow, except the routes in ``held`` (copies the layer
    keeps anyway: ``holding``). A cell without times keeps its stored order; an unmeasured cell takes
    ``fallback``."""

    table: RouteTable
    fallback: Ranking
    held: frozenset[Route] = frozenset()

    def __call__(self, shape: LinearShape, x_bf16: bool, rows: int) -> tuple[Route, ...]:
        classes = HEAD_ROW_CLASSES if shape.is_head else ROW_CLASSES
        row_class = next((c for c in classes if c >= rows), classes[-1])
        name = self.table.cell_name(shape, x_bf16, row_class)
        cell = self.table.cells.get(name)
        if not cell:
            return self.fallback(shape, x_bf16, rows)
        times = self.table.times_us.get(name, {})
        if all(route in times for route in cell):
            cell = sorted(cell, key=lambda route: times[route] * (
                1 + (0.0 if Route(route) in self.held else COPY_MARGIN[Route(route)])))
        return complete([Route(name) for name in cell])

    def holding(self, held: frozenset[Route]) -> MeasuredRanking:
        """This ranking with the copies of ``held`` paid for (no margin)."""
        return MeasuredRanking(self.table, self.fallback, held)

    def dense_call_rows(self, shape: LinearShape, x_bf16: bool) -> int:
        """``DENSE_CALL_ROWS`` where the table measured a prompt chunk faster on the dense copy in calls
        of that many rows, else 0 (one call; also where not measured)."""
        times = self.table.times_us.get(self.table.split_cell_name(shape, x_bf16), {})
        if "whole" in times and "cut" in times and times["cut"] * (1 + DENSE_SPLIT_MARGIN) < times["whole"]:
            return DENSE_CALL_ROWS
        return 0


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_build_keys(method: Any) -> dict[str, str]:
    """The kernels ``method`` holds, by the loaded module's name: a CppKernel's module is named
    ``servelm_<name>_<build key>`` (cpp_kernel.py), so a rebuild for another source, flags or
    instruction set (an AVX2 build of the block kernel) is another key."""
    return {name: getattr(module, "__name__", type(module).__name__)
            for name, module in (("block", method.kernel), ("rows", method.rows_kernel), ("int8", method.i8_kernel))
            if module is not None}


def machine_key(cpu_flags: set[str] | None = None) -> dict[str, Any]:
    """What decides any timing on this machine: the CPU, its flags, the threads, torch's version."""
    if cpu_flags is None:
        from servelm.model.loader import cpu_flags as read_flags
        cpu_flags = read_flags()
    return {"cpu": cpu_model_name(), "cpu_flags": sorted(cpu_flags), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def table_key(method: Any, shapes: Iterable[LinearShape], model_dtype: torch.dtype,
              cpu_flags: set[str] | None = None) -> dict[str, Any]:
    """What decides the table: a different value re-measures, the same reuses."""
    return {**machine_key(cpu_flags), "kernels": kernel_build_keys(method), "measurement": MEASUREMENT,
            "model_dtype": str(model_dtype).removeprefix("torch."),
            "dense_dtype": str(method.dense_dtype).removeprefix("torch."), "activations": method.activations,
            "shapes": sorted(shape.name for shape in set(shapes))}


def synthetic_weight(shape: LinearShape, block: int, has_offsets: bool,
                     code_range: tuple[int, int] = (-127, 127)) -> BlockWeight:
    """A random BlockWeight of ``shape`` (outputs cut to ``MEASURE_MAX_OUTPUTS``) with codes in
    ``code_range`` (the model's: a build reading codes packed at their bit width reads as many)."""
    generator = torch.Generator().manual_seed(0)
    n, k = min(shape.out_features, MEASURE_MAX_OUTPUTS), shape.in_features
    codes = torch.randint(code_range[0], code_range[1] + 1, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, k // block, generator=generator) * 1e-2
    offsets = torch.rand(n, k // block, generator=generator) * -1e-2 if has_offsets else None
    return BlockWeight(codes, scales, offsets, block, shape.kind)


def cold_copies(method: Any, weight: BlockWeight, shape: LinearShape,
                working_bytes: int = MEASURE_MIN_BYTES) -> list[nn.Module]:
    """A module holding ``weight`` and the copies of every route ``available`` for ``shape``
    (``prepare_all``), then clones of it up to ``working_bytes`` in all (at most
    ``MEASURE_MAX_COPIES``): a timing that cycles through them reads each from memory where
    ``working_bytes`` exceeds the cache, as a step reading every layer of such a model once does
    (one copy read again and again stays in the cache, and the routes reading more bytes per weight
    then look faster than they are); a model smaller than the cache is timed in it."""
    layer = nn.Module()
    held = method.prepare_all(layer, weight, shape)
    copies = min(MEASURE_MAX_COPIES, -(-working_bytes // max(held, 1)))
    return [layer] + [copy.deepcopy(layer) for _ in range(copies - 1)]


def dense_cold_copies(method: Any, weight: BlockWeight, working_bytes: int = MEASURE_MIN_BYTES) -> list[torch.Tensor]:
    """``weight``'s dense copy (the dense route's, ``method.dense_dtype``), then copies of it up to
    ``working_bytes`` in all (at most ``MEASURE_MAX_COPIES``; ``cold_copies``' reason) with no other
    route's copy: what timing the dense copy's calls alone reads."""
    dense = weight.dequantize(dtype=method.dense_dtype)
    copies = min(MEASURE_MAX_COPIES, -(-working_bytes // max(dense.nbytes, 1)))
    return [dense] + [dense.clone() for _ in range(copies - 1)]


class BusyWindow:
    """How many cores other processes took from this one over a timing window (``ThreadGovernor``'s reading
    from the window's start to ``others``), and whether that was enough to cost a thread: a timing made
    then ranks its candidates by which suffers least from a lost core, so it is not kept."""

    def __init__(self) -> None:
        self.probe = ThreadGovernor(torch.get_num_threads()) if ThreadGovernor.supported() else None
        self.before = self.probe.sample() if self.probe is not None else None

    def busy_cores(self) -> float | None:
        """Others' cores over the window (0.1-1 s: a cell's alone is a few of /proc's 10 ms ticks) where they
        cost this process a thread, else None."""
        if self.probe is None or not self.before:
            return None
        others = self.probe.others_cores(self.before, self.probe.sample(), slack_ticks=2)
        return others if self.probe.target(others) < self.probe.max_threads else None


def measure_shape(method: Any, shape: LinearShape, block: int, has_offsets: bool, model_dtype: torch.dtype,
                  table: RouteTable, deadline: float, code_range: tuple[int, int] = (-127, 127),
                  working_bytes: int = MEASURE_MIN_BYTES, row_cells: bool = True, dense_calls_cell: bool = True
                  ) -> bool:
    """Time the routes built for ``shape`` at each row class not yet in ``table``; False where the
    deadline came first (the cells measured so far are kept). Cells timed while other processes kept
    a core of this process busy (``ThreadGovernor``'s reading over the shape's cells: fewer threads than
    torch's would run at full speed; an OpenMP op then waits at its barrier for the thread that lost
    its core, and the times rank the routes by which suffers least) are not kept: ``table.busy`` names
    them."""
    available = sorted(method.available(shape, block), key=lambda route: route.value)
    x_bf16 = model_dtype == torch.bfloat16
    classes = HEAD_ROW_CLASSES if shape.is_head else ROW_CLASSES
    def timed(rows: int) -> list[Route]:   # the routes offered to a call of ``rows``
        return [route for route in available if offered(route, shape, rows)]

    # a cell is measured again where it lacks a route built now (a route added since it was measured)
    todo = [rows for rows in classes
            if not {route.value for route in timed(rows)} <= set(table.times_us.get(table.cell_name(shape, x_bf16, rows), ()))]
    if len(available) < 2 or not row_cells:   # nothing to rank (the dense copy's calls may still be timed)
        todo = []
    split = table.split_cell_name(shape, x_bf16)
    split_todo = (dense_calls_cell and Route.DENSE in available and not shape.is_head
                  and split not in table.times_us)
    if not todo and not split_todo:
        return True
    weight = synthetic_weight(shape, block, has_offsets, code_range)
    layers = cold_copies(method, weight, shape, working_bytes) if todo else []
    run = method.run_route
    window = BusyWindow()
    measured: dict[str, dict[str, float]] = {}
    finished = True
    for rows in todo:
        if time.perf_counter() > deadline:
            finished = False
            break
        x = torch.randn(rows, shape.in_features, generator=torch.Generator().manual_seed(rows)).to(model_dtype)
        measured[table.cell_name(shape, x_bf16, rows)] = time_candidates(
            {route.value: (lambda route=route, turn=itertools.cycle(layers): run(route, next(turn), x, None,
                                                                                 shape.is_head))
             for route in timed(rows)})
    if split_todo and time.perf_counter() > deadline:
        finished = False
    elif split_todo:
        x = torch.randn(DENSE_SPLIT_ROWS, shape.in_features, generator=torch.Generator().manual_seed(1)).to(
            method.dense_dtype)
        # the route cells' copies where they were made, else the dense copy's alone (the second pass)
        turn = itertools.cycle([layer.gguf_dense for layer in layers] or dense_cold_copies(method, weight, working_bytes))
        measured[split] = time_candidates({name: (lambda rows=rows: dense_calls(x, next(turn), rows))
                                           for name, rows in (("whole", 0), ("cut", DENSE_CALL_ROWS))})
    busy = window.busy_cores()   # over the shape's whole window
    for name, times in measured.items():
        if busy is not None:
            table.busy[name] = busy
            continue
        if name != split:   # the dense calls' cell is times only (``MeasuredRanking.dense_call_rows``)
            table.cells[name] = sorted(times, key=lambda route: times[route] * (1 + COPY_MARGIN[Route(route)]))
        table.times_us[name] = {route: round(us, 1) for route, us in times.items()}
    return finished


def set_prefetch(method: Any, specs: list[ShapeSpec], model_dtype: torch.dtype, table: RouteTable,
                 deadline: float, working_bytes: int = MEASURE_MIN_BYTES) -> None:
    """Where the rows kernel takes the setting: ``PREFETCH_CELL`` measured if the table lacks it (one row of
    the model's largest layer on the copy the rows kernel reads, the bit-width one where built, else the byte
    copy; cold copies cycled, ``cold_copies``; each way set before each call; not kept where other processes
    kept a core of this process busy meanwhile, ``BusyWindow``), then the table's choice set on the kernel
    (``RouteTable.nta_prefetch``): before any cell is timed, since their times depend on it."""
    kernel = method.rows_kernel
    if kernel is None or not hasattr(kernel, "set_nta_prefetch"):
        return
    if PREFETCH_CELL not in table.times_us and time.perf_counter() <= deadline:
        _measure_prefetch(method, kernel, specs, model_dtype, table, working_bytes)
    kernel.set_nta_prefetch(table.nta_prefetch())


def _measure_prefetch(method: Any, kernel: Any, specs: list[ShapeSpec], model_dtype: torch.dtype, table: RouteTable,
                      working_bytes: int) -> None:
    held = [(spec, method.available(spec.shape, spec.block)) for spec in specs if not spec.shape.is_head]
    held = [(spec, routes) for spec, routes in held if {Route.ROWS, Route.PACKED} & routes]
    if not held:
        return
    spec, routes = max(held, key=lambda pair: pair[0].shape.in_features * pair[0].shape.out_features)
    route = Route.PACKED if Route.PACKED in routes else Route.ROWS
    weight = synthetic_weight(spec.shape, spec.block, spec.has_offsets, spec.code_range)
    turn = itertools.cycle(cold_copies(method, weight, spec.shape, working_bytes))
    x = torch.randn(1, spec.shape.in_features, generator=torch.Generator().manual_seed(1)).to(model_dtype)

    def call(nta: bool) -> None:
        kernel.set_nta_prefetch(nta)
        method.run_route(route, next(turn), x, None, False)

    window = BusyWindow()
    times = time_candidates({"nta": lambda: call(True), "t0": lambda: call(False)})
    busy = window.busy_cores()
    if busy is not None:
        table.busy[PREFETCH_CELL] = busy
    else:
        table.times_us[PREFETCH_CELL] = {name: round(us, 1) for name, us in times.items()}


@dataclass(frozen=True)
class ShapeSpec:
    """A distinct GGUF linear of the model, as the table needs it."""

    shape: LinearShape
    block: int
    has_offsets: bool
    code_range: tuple[int, int] = (-127, 127)
    """The least and greatest code of the model's weight (``synthetic_weight``)."""


def build_table(method: Any, specs: list[ShapeSpec], model_dtype: torch.dtype, budget_s: float | None,
                cache_dir: Path | None = None, fresh: bool = False,
                working_bytes: int = MEASURE_MIN_BYTES) -> tuple[RouteTable, str]:
    """The model's table (cached cells reused unless ``fresh``, missing ones measured within
    ``budget_s``; None: no limit) and a sentence on where it came from, for the log.
    ``working_bytes``: the bytes a step reads (``cold_copies``; the model's blocks, at most
    ``MEASURE_MIN_BYTES``)."""
    started = time.perf_counter()
    key = table_key(method, (spec.shape for spec in specs), model_dtype)
    table = RouteTable(key) if fresh else RouteTable.load(key, cache_dir)
    before = {name: dict(times) for name, times in table.times_us.items()}
    deadline = float("inf") if budget_s is None else started + budget_s
    set_prefetch(method, specs, model_dtype, table, deadline, min(working_bytes, MEASURE_MIN_BYTES))
    complete_table = True
    for row_cells in (True, False):   # every shape's route cells first, then the dense copy's calls
        for spec in specs:
            if not measure_shape(method, spec.shape, spec.block, spec.has_offsets, model_dtype, table, deadline,
                                 spec.code_range, min(working_bytes, MEASURE_MIN_BYTES), row_cells=row_cells,
                                 dense_calls_cell=not row_cells):
                complete_table = False
                break
        if not complete_table:
            break
    measured = sum(1 for name, times in table.times_us.items() if before.get(name) != times)   # new or again
    cached = len(table.times_us) - measured
    if measured:
        table.save(cache_dir)
    seconds = time.perf_counter() - started
    if not table.cells and complete_table and not table.busy:
        return table, "nothing to measure (one route per shape on this machine)"
    source = (f"{cached} cells from {table.path(cache_dir)}, {measured} measured in {seconds:.1f} s"
              if cached else f"{measured} cells measured in {seconds:.1f} s"
              + (f", saved to {table.path(cache_dir)}" if measured else ""))
    if PREFETCH_CELL in table.times_us:
        source += f"; rows kernel prefetch: {'non-temporal' if table.nta_prefetch() else 'T0'} (measured faster)"
    if table.busy:
        source += (f"; {len(table.busy)} cells were timed while other processes kept up to "
                   f"{max(table.busy.values()):.1f} of this process's cores busy: not kept, they take the defaults "
                   "(earlier sessions' constants) until a later start (or `servelm tune MODEL`) measures them quiet")
    if not complete_table:
        source += (f"; over the {budget_s:.0f} s start-up budget: the cells left take the defaults (earlier "
                   "sessions' constants) until the next start or `servelm tune MODEL` measures them")
    return table, source


def format_report(report: dict[str, Any]) -> list[str]:
    """``route_summary``'s table as short lines: one per shape, its route at each row class
    (``generation/prompt`` initials where the two differ)."""
    routes: dict[str, dict[str, dict[str, str]]] = report["routes"]
    width = max((len(name) for name in routes), default=4)
    lines = [f"{'rows':<{width}} " + " ".join(f"{rows:>6}" for rows in report["row_classes"])]
    for name in sorted(routes):
        cells = []
        for rows in report["row_classes"]:
            cell = routes[name][str(rows)]
            generation, prompt = cell["generation"], cell["prompt"]
            cells.append(f"{generation if generation == prompt else generation[0] + '/' + prompt[0]:>6}")
        lines.append(f"{name:<{width}} " + " ".join(cells))
    cut = report.get("dense_call_rows", {})
    if cut:
        lines.append(f"dense copy in calls of {max(cut.values())} rows for longer prompt chunks: {', '.join(sorted(cut))}")
    return lines


def route_summary(routes_by_shape: dict[LinearShape, Any], x_bf16: bool, source: str) -> dict[str, Any]:
    """The chosen routes as plain data (``ModelRunner.routes_summary``, /get_server_info)."""
    return {"source": source, "row_classes": list(ROW_CLASSES),
            "routes": {shape.name: {str(rows): {"generation": routes.pick(rows, x_bf16, False).value,
                                                "prompt": routes.pick(rows, x_bf16, True).value}
                                    for rows in ROW_CLASSES}
                       for shape, routes in routes_by_shape.items()},
            "dense_call_rows": {shape.name: routes.dense_rows for shape, routes in routes_by_shape.items()
                                if routes.dense_rows}}



def tune(config: Any) -> dict[str, Any] | None:
    """``servelm tune MODEL``: measure every cell of the model's route table again, with no budget,
    on the threads, dtype and quantization ``servelm serve`` would use with the same flags (the key
    must match serving's), and the block kernel's build (gguf/block_builds.py) too; saves them and
    returns the chosen routes and build (None: no GGUF blocks to route)."""
    from servelm.distributed.parallel import ParallelContext
    from servelm.model.gguf.gguf_weights import GGUF_MODES, apply_gguf_blocks, gguf_model_dtype, resolve_quantization
    from servelm.model.attention import Attention, prefill_routes
    from servelm.model.loader import DTYPES, build_model, resolve_device, resolve_dtype
    from servelm.model.source import resolve_model_source
    from servelm.model.threads import configure_engine_threads

    configure_engine_threads(config.runtime.num_threads)
    source = resolve_model_source(config.model)
    device = resolve_device(config.model.device)
    gguf_path = getattr(source, "gguf_path", None)
    quantization, reason = resolve_quantization(config.model.quantization, gguf_path, ParallelContext.single(),
                                                device, False, config.model.dtype)
    dtype = (gguf_model_dtype(config.model.dtype, device)[0] if quantization in GGUF_MODES
             else resolve_dtype(config.model.dtype, source.hf_config, device))
    model = build_model(source.hf_config, dtype, device, ParallelContext.single())
    attention = None
    if device.type == "cpu":   # the prefill attention's table too (attention/prefill_routes.py)
        kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else DTYPES[config.cache.kv_cache_dtype]
        shapes = prefill_routes.model_shapes([m for m in model.modules() if isinstance(m, Attention)], dtype,
                                             kv_dtype)
        attention = prefill_routes.build_routing(shapes, None, fresh=True).summary(shapes)
    if quantization not in GGUF_MODES:
        logger.info("no GGUF routes to tune: quantization %s (%s) runs no GGUF block routes", quantization, reason)
        return {"prefill_attention": attention} if attention else None
    summary = apply_gguf_blocks(model, gguf_path, GGUF_MODES[quantization], check=False, route_budget_s=None,
                                fresh_routes=True)
    report = {**summary["routes"], "kernel_build": summary["kernel_build"]}
    return {**report, "prefill_attention": attention} if attention else report


@contextlib.contextmanager
def forced_route(route: Route) -> Iterator[None]:
    """For benchmarks and tests: GGUF models loaded inside take ``route`` first at every row count
    instead of the measured table (``LayerRoutes.resolve`` still applies the quality rules, and the
    route is held only where its kernel is built), e.g. benchmarks/quant_quality.py ``gguf+route=block``."""
    original = RouteTable.ranking

    def ranking(self: RouteTable, fallback: Ranking) -> Ranking:
        return lambda shape, x_bf16, rows: complete([route])

    RouteTable.ranking = ranking  # type: ignore[method-assign]
    try:
        yield
    finally:
        RouteTable.ranking = original  # type: ignore[method-assign]
