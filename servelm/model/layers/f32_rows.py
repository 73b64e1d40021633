"""The float32 few-rows linear (f32_rows.cpp, AVX2 + FMA) and where it beats oneDNN, measured here.

A float32 dense linear with few rows (decode steps, MoE experts' few rows each) is bound by reading
the weight, and oneDNN's linear streamed it at 6-10 GB/s on a 2-core AMD EPYC Zen 3 (the 622 MB
Qwen3 LM head took 97 ms at 8 rows). f32_rows.cpp reads each weight row once for all rows, on the
plain row-major weight (no copy). It is a candidate only where built (the CPU has AVX2 and FMA, a
compiler is present) and only up to ``MAX_ROWS`` rows; for each distinct float32 weight shape of
the model (``DenseShape``) and each row class of ``ROW_CLASSES`` it is timed against oneDNN at
start-up (``build_routes``, in the route-table cache of model/routes.py) and a call takes the
kernel where it won the smallest class >= its rows. Only speed is measured: both compute the same
float32 dot products, in another summation order (tests/unit/model/test_f32_rows.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from servelm.model.cpp_kernel import CppKernel

logger = logging.getLogger(__name__)

KERNEL = CppKernel.beside(__file__, "f32_rows.cpp", "f32_rows", "float32 few-rows linear (AVX2+FMA)",
                          ("avx2", "fma"))
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags

ROW_CLASSES = (1, 2, 4, 8, 16, 32)
MAX_ROWS = ROW_CLASSES[-1]
"""More rows never take the kernel: it has no blocking over rows beyond L1/L2 reuse, and oneDNN's
GEMM reaches the FMA peak there."""
STARTUP_BUDGET_S = 3.0
"""Seconds of start-up the measurement may add (2 cores: a Qwen3-MoE's 4 shapes x 6 classes ~2 s)."""
TIMING_BUDGET_S = 0.05
"""Seconds one cell's interleaved rounds may take after their first three (model/timing.py)."""
MEASURE_MAX_OUTPUTS = 16384
"""Outputs a shape is timed on (an LM head's 150k are cut to this: both routes' times grow linearly in N)."""
MIN_WEIGHT_BYTES = 1 << 20
"""Weights smaller than this keep oneDNN unmeasured: they sit in cache, a call is its overhead, and
timing them at every start of a tiny model (the test suite's) is noise that cost seconds per start
and could pick different routes on different tensor-parallel ranks."""
MEASURE_MIN_BYTES = 96 << 20
"""Weight bytes a measurement cycles through at most (copies of a small shape): more than the
last-level cache, as in serving a model that size, where a step reads every layer's weights once."""


def row_class(rows: int) -> int:
    return next((c for c in ROW_CLASSES if c >= rows), ROW_CLASSES[-1])


@dataclass(frozen=True, slots=True)
class DenseShape:
    """A float32 weight ``[out_features, in_features]`` of the model."""

    out_features: int
    in_features: int

    @property
    def name(self) -> str:
        return f"f32 {self.in_features}x{self.out_features}"


@dataclass(frozen=True, slots=True)
class DenseRoutes:
    """Which row classes of one shape take the kernel (the rest oneDNN)."""

    kernel: ModuleType
    kernel_classes: frozenset[int]

    def takes_kernel(self, rows: int) -> bool:
        return rows <= MAX_ROWS and row_class(rows) in self.kernel_classes

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = self.kernel.linear(x, weight, bias)
        return out


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


class _Synthetic:
    """Random weights of ``shape`` (copies up to ``MEASURE_MIN_BYTES``, used in turn) and ``rows`` x rows."""

    def __init__(self, shape: DenseShape, rows: int, weights: list[torch.Tensor], kernel: ModuleType) -> None:
        self.x = torch.randn(rows, shape.in_features, generator=torch.Generator().manual_seed(rows))
        self.weights, self.kernel, self.next = weights, kernel, 0

    def _weight(self) -> torch.Tensor:
        self.next = (self.next + 1) % len(self.weights)
        return self.weights[self.next]

    def run_kernel(self) -> torch.Tensor:
        out: torch.Tensor = self.kernel.linear(self.x, self._weight(), None)
        return out

    def run_onednn(self) -> torch.Tensor:
        return onednn(self.x, self._weight())


def synthetic_weights(shape: DenseShape, working_bytes: int) -> list[torch.Tensor]:
    """A random weight of ``shape`` (outputs cut to ``MEASURE_MAX_OUTPUTS``) and copies of it up to
    ``working_bytes`` (the bytes a step reads: a model smaller than the cache is timed in cache)."""
    n = min(shape.out_features, MEASURE_MAX_OUTPUTS)
    first = torch.randn(n, shape.in_features, generator=torch.Generator().manual_seed(0))
    copies = max(1, -(-working_bytes // first.nbytes))
    return [first] + [first.clone() for _ in range(copies - 1)]


def table_key(shapes: Iterable[DenseShape], kernel: ModuleType) -> dict[str, Any]:
    from servelm.model.loader import cpu_flags
    from servelm.model.routes import cpu_model_name
    return {"table": "float32 dense", "cpu": cpu_model_name(), "cpu_flags": sorted(cpu_flags()),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": {"f32_rows": getattr(kernel, "__name__", type(kernel).__name__)},
            "shapes": sorted(shape.name for shape in set(shapes))}


def build_routes(shapes: Iterable[DenseShape], budget_s: float | None = STARTUP_BUDGET_S,
                 cache_dir: Path | None = None, fresh: bool = False,
                 kernel: ModuleType | None = None, working_bytes: int = MEASURE_MIN_BYTES
                 ) -> tuple[dict[DenseShape, DenseRoutes], str]:
    """Each shape's routes (cached cells reused unless ``fresh``, missing ones measured within
    ``budget_s``; None: no limit; a cell not measured takes oneDNN) and where they came from;
    ``working_bytes``: see ``synthetic_weights``.
    Empty where the kernel is not built (``kernel``: the module to time, default ``load_kernel()``)."""
    from servelm.model.routes import RouteTable
    from servelm.model.timing import time_candidates
    kernel = kernel if kernel is not None else load_kernel()
    if kernel is None or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return {}, f"oneDNN everywhere ({kernel_status() if kernel is None else 'no oneDNN linear to time'})"
    # the largest weights first: where a budget runs out, the cells left are the cheapest ones
    shapes = sorted(set(shapes), key=lambda shape: (-shape.out_features * shape.in_features, shape.name))
    started = time.perf_counter()
    deadline = float("inf") if budget_s is None else started + budget_s
    table = RouteTable(table_key(shapes, kernel)) if fresh else RouteTable.load(table_key(shapes, kernel), cache_dir)
    cached, complete = len(table.cells), True
    for shape in shapes:
        todo = [rows for rows in ROW_CLASSES if f"{shape.name} {rows}" not in table.cells]
        weights = synthetic_weights(shape, working_bytes) if todo and time.perf_counter() < deadline else []
        for rows in todo:
            if time.perf_counter() > deadline:
                complete = False
                break
            synthetic = _Synthetic(shape, rows, weights, kernel)
            times = time_candidates({"kernel": synthetic.run_kernel, "onednn": synthetic.run_onednn},
                                    budget_s=TIMING_BUDGET_S)
            name = f"{shape.name} {rows}"
            table.cells[name] = sorted(times, key=times.__getitem__)
            table.times_us[name] = {route: round(us, 1) for route, us in times.items()}
    measured = len(table.cells) - cached
    if measured:
        table.save(cache_dir)
    source = (f"{cached} cells cached, {measured} measured in {time.perf_counter() - started:.1f} s "
              f"({table.path(cache_dir)})")
    if not complete:
        source += f"; over the {budget_s:.0f} s budget: the cells left take oneDNN until the next start"
    routes = {shape: DenseRoutes(kernel, frozenset(rows for rows in ROW_CLASSES
                                                   if table.cells.get(f"{shape.name} {rows}", ["onednn"])[0] == "kernel"))
              for shape in shapes}
    return routes, source


def route_lines(routes: dict[DenseShape, DenseRoutes]) -> str:
    """``f32 1024x151936: 1:kernel 2:kernel ...`` per shape, for the start-up log."""
    return "; ".join(f"{shape.name}: " + " ".join(f"{rows}:{'kernel' if rows in r.kernel_classes else 'onednn'}"
                                                  for rows in ROW_CLASSES)
                     for shape, r in routes.items())


def _float32_cpu(weight: Any) -> bool:
    """A 2-D float32 weight on the CPU."""
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu" \
        and weight.dim() == 2


def _shape(weight: Any) -> DenseShape:
    """A weight's (or an expert stack's one expert's) ``[out, in]``."""
    return DenseShape(int(weight.shape[-2]), int(weight.shape[-1]))


def dense_weights(model: torch.nn.Module) -> list[tuple[Any, str, DenseShape]]:
    """The model's float32 CPU weights that ``dense_linear`` computes with oneDNN: (module, which,
    shape) for unquantized linears (``which`` "linear"), the LM head ("head") and stacked MoE experts
    ("gate_up" / "down", one expert's shape)."""
    from servelm.model.layers.embedding import LMHead
    from servelm.model.layers.linear import LinearBase, UnquantizedLinearMethod
    from servelm.model.layers.moe import FusedMoE
    found: list[tuple[Any, str, DenseShape]] = []
    for module in model.modules():
        if isinstance(module, LinearBase) and type(module.linear_method) is UnquantizedLinearMethod \
                and _float32_cpu(module.weight):
            found.append((module, "linear", _shape(module.weight)))
        elif isinstance(module, LMHead) and module.linear_method is None and module.fp32_weight is None \
                and _float32_cpu(module.weight):
            found.append((module, "head", _shape(module.weight)))
        elif isinstance(module, FusedMoE) and module.expert_layers is None and _float32_cpu(module.gate_up_proj[0]):
            found.append((module, "gate_up", _shape(module.gate_up_proj)))
            found.append((module, "down", _shape(module.down_proj)))
    return [(module, which, shape) for module, which, shape in found
            if 4 * shape.out_features * shape.in_features >= MIN_WEIGHT_BYTES]


def apply_dense_routes(model: torch.nn.Module, budget_s: float | None = STARTUP_BUDGET_S,
                       fresh: bool = False) -> dict[str, Any] | None:
    """Give each float32 dense weight of ``model`` its measured routes (``build_routes``); the
    chosen routes as plain data (for /get_server_info), or None where the model has none."""
    weights = dense_weights(model)
    if not weights:
        return None
    working_bytes = sum(getattr(module, {"gate_up": "gate_up_proj", "down": "down_proj"}.get(which, "weight")).nbytes
                        for module, which, _ in weights)
    routes, source = build_routes((shape for _, _, shape in weights), budget_s, fresh=fresh,
                                  working_bytes=min(working_bytes, MEASURE_MIN_BYTES))
    logger.info("float32 dense routes (%s): %s", source, route_lines(routes) or "oneDNN")
    for module, which, shape in weights:
        chosen = routes.get(shape)
        if which == "gate_up":
            module.dense_routes = (chosen, module.dense_routes[1])
        elif which == "down":
            module.dense_routes = (module.dense_routes[0], chosen)
        else:
            module.dense_routes = chosen
    return {"source": source, "row_classes": list(ROW_CLASSES),
            "routes": {shape.name: {str(rows): "kernel" if rows in r.kernel_classes else "onednn"
                                    for rows in ROW_CLASSES} for shape, r in routes.items()}}
