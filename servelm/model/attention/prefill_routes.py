"""Which computation a multi-token causal attention call runs, measured on the machine at hand.

Three routes compute the causal attention of prompt rows (prefill, chunks) over the paged pool
(torch_native.py runs them):

- ``kernel``: prefill_attention.py's kernels, read in place from the pool: bf16 (prefill_attention.cpp,
  built only on CPUs with AVX512-BF16) or float32 (prefill_attention_f32.cpp, AVX2 and FMA);
- ``gemm``: prefill_gemm.py, the context gathered, then two oneDNN GEMMs per 128-query tile;
- ``sdpa``: the context gathered, torch's ``scaled_dot_product_attention`` with the view's mask.

Until session 13 the order was fixed (kernel where built, else gemm, else SDPA), from the Zen 5 and
Zen 3 measurements of benchmarks/RESULTS.md (SDPA 25 ms, GEMMs 11.5 ms for a 512-query chunk of
Gemma 3 270M). On another CPU the order need not hold: on Intel with AMX oneDNN's bf16 GEMMs (the
``gemm`` route, and torch's SDPA which calls them) run on AMX tiles that the hand-written AVX512-BF16
kernel does not use, and the issue's machine lost 0.56-0.61x to vLLM in prefill. A wrong order costs
a multiple of the attention, which is 20-50% of a prefill, on every prompt.

So for each distinct attention shape of the model (``PrefillShape``: query heads, KV heads, head
dim, compute and pool dtypes) and each query class of ``QUERY_CLASSES`` the routes valid there are
timed at start-up on synthetic tensors (a fresh prompt of that many tokens: context = queries) and
ranked fastest first; a call takes the ranking of the smallest class >= its longest sequence's
queries (the last above). The table lives beside the GGUF one (model/routes.py ``RouteTable``,
``~/.cache/servelm/routes/``), keyed by what decides it (``table_key``); cells not measured within
``STARTUP_BUDGET_S`` take ``DEFAULT_ORDER`` (the earlier constant order) until the next start or
``servelm tune``. Every route computes the same attention (tests/unit/model/test_prefill_routes.py);
only speed is measured, and a route that does not support a call (fp8 pool, draft trees, a pool
dtype the kernel does not read) is skipped at the call, whatever the ranking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from servelm.model.attention import prefill_attention, prefill_gemm
from servelm.model.timing import time_candidates

logger = logging.getLogger(__name__)

ROUTES = ("kernel", "gemm", "sdpa")
DEFAULT_ORDER = ROUTES
"""The order before measurement (and where a cell was not measured): the constant order of
sessions 6-12 (Zen 5 / Zen 3, benchmarks/RESULTS.md "Prefill attention")."""
QUERY_CLASSES = (16, 64, 256, 512)
"""Queries of one sequence measured one each: prompt chunks are up to 512 rows by default; the small
classes are a chunk's tail and short prompts, where the fixed costs (gather, tile set-up) weigh."""
STARTUP_BUDGET_S = 3.0
"""Seconds of start-up the measurement may add (2 cores, Gemma 3 270M's one shape, bf16: ~1 s)."""
TIMING_BUDGET_S = 0.1
"""Seconds one cell's interleaved rounds may take after their first three (model/timing.py)."""


@dataclass(frozen=True, slots=True)
class PrefillShape:
    """What decides the prefill attention's speeds (one per distinct layer shape of the model)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def name(self) -> str:
        dtype, kv = (str(d).removeprefix("torch.") for d in (self.dtype, self.kv_dtype))
        return f"attn {self.num_heads}/{self.num_kv_heads}x{self.head_dim} {dtype} kv {kv}"


def query_class(queries: int) -> int:
    return next((c for c in QUERY_CLASSES if c >= queries), QUERY_CLASSES[-1])


def cell_name(shape: PrefillShape, queries: int) -> str:
    return f"{shape.name} {queries}"


@dataclass
class PrefillRouting:
    """The backend's ranking per (shape, query class); ``DEFAULT_ORDER`` where a cell is missing."""

    cells: dict[str, list[str]] = field(default_factory=dict)
    source: str = "defaults (not measured)"
    _memo: dict[tuple, tuple[str, ...]] = field(default_factory=dict, repr=False)

    def order(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              kv_dtype: torch.dtype, queries: int) -> tuple[str, ...]:
        key = (num_heads, num_kv_heads, head_dim, dtype, kv_dtype, query_class(queries))
        cached = self._memo.get(key)
        if cached is None:
            shape = PrefillShape(num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
            cell = self.cells.get(cell_name(shape, key[-1]))
            cached = self._memo[key] = tuple(cell) + tuple(r for r in DEFAULT_ORDER if r not in cell) \
                if cell else DEFAULT_ORDER
        return cached

    def summary(self, shapes: Iterable[PrefillShape]) -> dict[str, Any]:
        """The route each shape's calls take per query class (the first of its ranking that is
        valid for the shape here), for /get_server_info and the start-up log."""
        out: dict[str, dict[str, str]] = {}
        for shape in shapes:
            valid = valid_routes(shape)
            out[shape.name] = {str(c): next((r for r in self.order(shape.num_heads, shape.num_kv_heads,
                                                                     shape.head_dim, shape.dtype,
                                                                     shape.kv_dtype, c) if r in valid), "sdpa")
                               for c in QUERY_CLASSES}
        return {"source": self.source, "query_classes": list(QUERY_CLASSES), "routes": out}


class _Synthetic:
    """A fresh prompt of ``n`` tokens of ``shape`` in a pool of ``n`` slots (slot i = position i)."""

    def __init__(self, shape: PrefillShape, n: int) -> None:
        generator = torch.Generator().manual_seed(n)
        h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.shape, self.n, self.scale = shape, n, d ** -0.5
        self.q = torch.randn(n, h, d, generator=generator).to(shape.dtype)
        self.k_cache = torch.randn(n, hkv, d, generator=generator).to(shape.kv_dtype)
        self.v_cache = torch.randn(n, hkv, d, generator=generator).to(shape.kv_dtype)
        self.slots = torch.arange(n)
        self.out = self.q.new_empty(n, h, d)

    def kernel(self) -> torch.Tensor:
        sequences = prefill_attention.plan([0], [self.n], [0], [0])
        prefill_attention.attend(self.q, self.k_cache, self.v_cache, self.slots.view(1, -1), sequences,
                                 None, self.scale, self.out)
        return self.out

    def gemm(self) -> torch.Tensor:
        shape = self.shape
        tiles = prefill_gemm.build_tiles([0], [self.n], [0], [0], self.n, None,
                                         shape.num_heads // shape.num_kv_heads)
        prefill_gemm.attend(self.q, self.k_cache.index_select(0, self.slots).to(shape.dtype),
                            self.v_cache.index_select(0, self.slots).to(shape.dtype), tiles, self.scale, self.out)
        return self.out

    def sdpa(self) -> torch.Tensor:
        """As the backend runs it: one call, or query tiles above ``SDPA_TILE_QUERIES`` rows."""
        from servelm.model.attention import torch_native
        shape, n = self.shape, self.n
        mask = torch.ones(n, n, dtype=torch.bool).tril_()[None, None]   # the view's mask, built per call too
        k = self.k_cache.index_select(0, self.slots).view(1, n, shape.num_kv_heads, -1).to(shape.dtype)
        v = self.v_cache.index_select(0, self.slots).view(1, n, shape.num_kv_heads, -1).to(shape.dtype)
        attended = torch_native.prompt_sdpa(
            self.q.view(1, n, shape.num_heads, -1).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
            self.scale, shape.num_heads != shape.num_kv_heads,
            lambda: torch_native.query_tile_bounds(mask, torch_native.SDPA_TILE_QUERIES))
        return attended.transpose(1, 2).reshape(n, shape.num_heads, -1)


def valid_routes(shape: PrefillShape) -> list[str]:
    """The routes that can compute a plain causal prefill of ``shape`` here (kernel built, oneDNN)."""
    probe = _Synthetic(shape, 1)
    valid = []
    if prefill_attention.supports(probe.q, probe.k_cache, probe.v_cache):
        valid.append("kernel")
    if prefill_gemm.supports(probe.q):
        valid.append("gemm")
    valid.append("sdpa")
    return valid


Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


def _default_timer(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    return time_candidates(candidates, budget_s=TIMING_BUDGET_S)


def table_key(shapes: Iterable[PrefillShape]) -> dict[str, Any]:
    """What decides the table (a different value measures again, the same reuses)."""
    from servelm.model.layers import fused
    from servelm.model.loader import cpu_flags
    from servelm.model.routes import cpu_model_name
    return {"table": "prefill attention", "cpu": cpu_model_name(), "cpu_flags": sorted(cpu_flags()),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": {"prefill_attention": getattr(prefill_attention.load_kernel(torch.bfloat16), "__name__", None),
                        "prefill_attention_f32": getattr(prefill_attention.load_kernel(torch.float32), "__name__",
                                                         None),
                        "fused": getattr(getattr(fused, "load_kernel", lambda: None)(), "__name__", None)},
            "shapes": sorted(shape.name for shape in set(shapes))}


def build_routing(shapes: Iterable[PrefillShape], budget_s: float | None = STARTUP_BUDGET_S,
                  cache_dir: Path | None = None, fresh: bool = False,
                  timer: Timer = _default_timer) -> PrefillRouting:
    """The model's prefill attention routing: cached cells reused (unless ``fresh``), missing ones
    measured within ``budget_s`` (None: no limit), the rest ``DEFAULT_ORDER``."""
    from servelm.model.routes import RouteTable
    shapes = sorted(set(shapes), key=lambda shape: shape.name)
    started = time.perf_counter()
    deadline = float("inf") if budget_s is None else started + budget_s
    table = RouteTable(table_key(shapes)) if fresh else RouteTable.load(table_key(shapes), cache_dir)
    cached = len(table.cells)
    complete = True
    for shape in shapes:
        valid = valid_routes(shape)
        if len(valid) < 2:
            continue
        for queries in QUERY_CLASSES:
            name = cell_name(shape, queries)
            if name in table.cells:
                continue
            if time.perf_counter() > deadline:
                complete = False
                break
            synthetic = _Synthetic(shape, queries)
            times = timer({route: getattr(synthetic, route) for route in valid})
            table.cells[name] = sorted(times, key=times.__getitem__)
            table.times_us[name] = {route: round(us, 1) for route, us in times.items()}
    measured = len(table.cells) - cached
    if measured:
        table.save(cache_dir)
    seconds = time.perf_counter() - started
    source = (f"{cached} cells cached, {measured} measured in {seconds:.1f} s ({table.path(cache_dir)})"
              if table.cells else "defaults (one route per shape here)")
    if not complete:
        source += f"; over the {budget_s:.0f} s budget: the cells left take the defaults until the next start"
    routing = PrefillRouting(dict(table.cells), source)
    logger.info("prefill attention routes (%s): %s", source,
                "; ".join(f"{name}: " + " ".join(f"{c}:{r}" for c, r in routes.items())
                          for name, routes in routing.summary(shapes)["routes"].items()))
    return routing


def model_shapes(layers: Iterable[Any], dtype: torch.dtype, kv_dtype: torch.dtype) -> list[PrefillShape]:
    """The distinct shapes of the model's causal attention layers (``Attention`` modules)."""
    return sorted({PrefillShape(layer.num_heads, layer.num_kv_heads, layer.head_dim, dtype, kv_dtype)
                   for layer in layers if layer.is_causal}, key=lambda shape: shape.name)
