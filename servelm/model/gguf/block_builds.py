"""Which build of the GGUF block kernel serves a model on this machine: measured, never assumed.

A CPU with AVX512-VNNI can run both builds of the block kernel (gguf_kernel.py): the AVX-512 one,
which reads the int8 codes, and the AVX2 one, which reads the codes packed at their bit width
(4-6 bits per weight) with compact scales. Which is faster at one row, the decode step's call,
depends on the CPU: on AMD Zen 4, which runs 512-bit instructions as two 256-bit halves, the AVX2
build took 0.72-0.91x the AVX-512 build's time on Qwen2.5-Coder 0.5B's shapes (benchmarks/RESULTS.md,
session 24); on Zen 5 the AVX-512 build led. So where more than one build loads, ``choose_block_build``
times one row through every decoder linear of the model (its own weights, in the order a decode
step reads them, so each comes from memory as in serving) on each build, interleaved
(servelm/model/timing.py), and takes the faster. The choice is cached like the route table
(servelm/model/routes.py, keyed by the CPU, threads, the builds, the model's shapes and dtype), so a
second start, or another rank of the same machine, reads it; ``servelm tune`` measures it again.

Only the block route's build is chosen here. The other routes (the rows kernel, the int8 GEMM, the
dense copy) are built whatever the block kernel's build is, and the route table then ranks them
against the chosen build at every row count. The LM head is not timed: its calls go through the
screen or the rows kernel, whose builds follow their own rules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from servelm.model.cpp_kernel import CppKernel
from servelm.model.gguf import gguf_kernel
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
from servelm.model.routes import RouteTable, machine_key
from servelm.model.timing import time_candidates

logger = logging.getLogger(__name__)

CELL = "one-row pass"
"""The cached table's one cell: the builds' module names, fastest first."""
MIN_ROUNDS = 5
"""Passes of each build at least (interleaved); more while ``BUDGET_S`` lasts."""
BUDGET_S = 1.0
"""Seconds the timing may take past ``MIN_ROUNDS`` (a 0.5B model's pass is ~20 ms a build)."""
MIN_TIMED_BYTES = 64 << 20
"""Decoder weight bytes (int8 codes) below which the builds are not timed and the preferred one (the
first of ``gguf_kernel.KERNELS`` this CPU runs) serves: such a model's pass reads its weights from
the cache, not memory, and takes microseconds, which noise decides (the tests' tiny models: a
choice that differed between two loads of one model would change its float32 rounding)."""


@dataclass(frozen=True)
class BuildChoice:
    """The block kernel's build that serves, and why (for the start-up log)."""

    kernel: CppKernel | None
    module: ModuleType | None
    note: str

    def status(self) -> str:
        return self.kernel.status() if self.kernel is not None else gguf_kernel.kernel_status()


def _loaded(kernels: Sequence[CppKernel]) -> list[tuple[CppKernel, ModuleType]]:
    return [(kernel, module) for kernel in kernels if (module := kernel.load()) is not None]


def _packs(module: ModuleType, activations: str) -> bool:
    return GGUFBlockLinearMethod(module, torch.float32, activations).packs


def _one_row_pass(module: ModuleType, weights: Sequence[BlockWeight], activations: str,
                  dtype: torch.dtype) -> Callable[[], None]:
    """One row through every weight on ``module``, as the block route calls it (gguf_linear.py
    ``block_call``: packed codes and compact scales where the build takes them)."""
    method = GGUFBlockLinearMethod(module, torch.float32, activations)
    rows = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype)
            for k in {weight.shape[1] for weight in weights}}
    calls = []
    for weight in weights:
        if method.packs:
            weight.with_packed()
        kernel, codes, scales, offsets = method.block_call(weight)
        calls.append((kernel, rows[weight.shape[1]], codes, scales, offsets, weight.block))
    round_out = dtype == torch.bfloat16

    def run() -> None:
        for kernel, x, codes, scales, offsets, block in calls:
            kernel(x, codes, scales, offsets, block, round_out)
    return run


def choose_block_build(weights: Sequence[BlockWeight], activations: str, dtype: torch.dtype,
                       fresh: bool = False, cache_dir: Path | None = None,
                       flags: set[str] | None = None) -> BuildChoice:
    """The build of the block kernel to serve ``weights`` (the model's decoder linears, in call
    order) with rows in ``dtype``: the only one that loads, the preferred one for a model under
    ``MIN_TIMED_BYTES``, else the faster one-row pass of those that load (cached; ``fresh``:
    measured again). A weight's packed and compact copies made for a build that loses are dropped
    again."""
    loaded = _loaded(gguf_kernel.candidates(flags))
    weights = [weight for weight in weights if weight.shape[1] % 64 == 0]   # what the block route takes
    if len(loaded) < 2 or not weights:
        kernel, module = loaded[0] if loaded else (None, None)
        return BuildChoice(kernel, module, "the only build" if loaded else "no build")
    if sum(weight.shape[0] * weight.shape[1] for weight in weights) < MIN_TIMED_BYTES:
        kernel, module = loaded[0]
        return BuildChoice(kernel, module, f"{kernel.description}, preferred: the decoder weights fit the cache "
                                           "(not timed)")
    key = {**machine_key(flags), "choice": "GGUF block kernel build", "activations": activations,
           "dtype": str(dtype).removeprefix("torch."), "builds": [module.__name__ for _, module in loaded],
           "weights": sorted({f"{weight.shape[1]}x{weight.shape[0]} {weight.kind}" for weight in weights}),
           "count": len(weights)}
    table = RouteTable(key) if fresh else RouteTable.load(key, cache_dir)
    by_name = {module.__name__: (kernel, module) for kernel, module in loaded}
    order = table.cells.get(CELL)
    if order and order[0] in by_name:
        source = f"cached in {table.path(cache_dir)}"
    else:
        before = [(weight.packed, weight.compact) for weight in weights]
        times = time_candidates({name: _one_row_pass(module, weights, activations, dtype)
                                 for name, (_, module) in by_name.items()}, min_rounds=MIN_ROUNDS,
                                budget_s=BUDGET_S)
        order = sorted(times, key=times.__getitem__)
        table.cells[CELL] = order
        table.times_us[CELL] = {name: round(us, 1) for name, us in times.items()}
        table.save(cache_dir)
        source = f"measured, saved to {table.path(cache_dir)}"
        if not _packs(by_name[order[0]][1], activations):   # the packing build lost: its copies go
            for weight, (packed, compact) in zip(weights, before):
                weight.packed, weight.compact = packed, compact
    kernel, module = by_name[order[0]]
    times_us = table.times_us.get(CELL, {})
    timing = ", ".join(f"{by_name[name][0].description} {times_us[name] / 1000:.2f} ms"
                       for name in order if name in times_us)
    note = f"{kernel.description}, the fastest one-row pass over {len(weights)} linears ({timing}; {source})"
    logger.info("GGUF block kernel build: %s", note)
    return BuildChoice(kernel, module, note)
