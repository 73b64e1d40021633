"""Decode steps through torch.compile (``--enable-torch-compile``, ``--torch-compile-max-bs``).

What is compiled: the forward of every decoder layer (``model.model.layers``), with inductor, for
steps where every sequence computes exactly one token and there are at most ``max_bs`` sequences.
Prefill, prompt chunks, speculative verification, larger decode batches and steps with LoRA
adapter rows (their per-step row groups would be a graph each) run the same layers eager, so a
long prompt never triggers a compile and the compiled graphs stay small.

Inside a compiled layer, attention (KV write, context gather, SDPA) runs eager: each layer's
``Attention`` module is excluded from tracing, because its metadata is per-step Python state
(sequence lengths, block tables) that would force a recompile every step. The compiled regions
are the norms, the QKV/O/MLP projections, q/k norms, RoPE and the residual adds around it.

Shapes: the token dimension is dynamic, so one graph per layer kind serves batches 2..max_bs and
batch 1 gets its own (torch specialises sizes 0 and 1). ``warm_up`` compiles both at start-up with
dummy one-token sequences in block 0 (they write finite values into slots no request owns yet,
and every slot is written before a request reads it), so no request pays the compile time.

Numerics (``INDUCTOR_OPTIONS``): inductor by default computes a fused chain of bf16 ops in float32 and
rounds once at the end, where eager rounds every op's output to bf16; and it folds a residual add
into the GEMM before it (``h + x @ W.T`` becomes one addmm, adding before rounding). Either makes a
compiled bf16 model round differently from the eager one. ``emulate_precision_casts`` keeps every
rounding eager makes, and ``pattern_matcher=False`` turns off the pass that folds the add (no inductor
option disables that one pattern alone). What still differs: the float32 sum of squares of an RMSNorm
is summed in another order than the eager fused kernel's (layers/fused.py), which moves a
normalised value across a bf16 rounding boundary in a few rows per thousand.

Invariants:
- Greedy outputs equal eager mode's for float32 models, and logits are bit-identical to eager's for
  the tiny bf16 models (tests/unit/model/test_compile.py); quantized models are refused in
  ``EngineConfig`` (inductor's last-bit differences flip the int8 rounding of the activations, so
  greedy tokens change).
- The wrapped layers keep their parameters: eager and compiled paths share every weight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from servelm.model.attention import Attention
from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan

logger = logging.getLogger(__name__)

_DYNAMO_CACHE_SIZE = 64
"""Graphs dynamo may keep per code object. All layers share one forward code object, and the
variants (sliding/global layer, first layer to fill the rope cache, batch 1 / batch >= 2) add up to
about 8, dynamo's default limit; past it dynamo silently falls back to eager."""

INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True, "pattern_matcher": False}
"""Inductor config for our graphs only (``torch.compile(options=...)``, not process-wide): round in
bf16 where eager rounds (see the module docstring). Measured on Qwen2.5-Coder-0.5B bf16 decode: no
change in step time (noisy, shared machine; benchmarks/RESULTS.md)."""


class DecodeDispatch:
    """A layer's ``forward``: the compiled one for small decode steps, the eager one otherwise."""

    def __init__(self, eager: Any, compiled: Any, max_bs: int) -> None:
        self.eager = eager
        self.compiled = compiled
        self.max_bs = max_bs

    def __call__(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = batch.num_tokens
        if num_tokens == batch.num_sequences and num_tokens <= self.max_bs and not batch.lora:
            return self.compiled(hidden, batch)
        return self.eager(hidden, batch)


def compile_decode_layers(model: nn.Module, max_bs: int) -> int:
    """Wrap each decoder layer's forward in a DecodeDispatch; returns the number of layers."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, _DYNAMO_CACHE_SIZE)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"--enable-torch-compile: {type(model).__name__} has no model.layers to compile")
    for module in model.modules():
        if isinstance(module, Attention):
            module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager, dynamic=True, fullgraph=False, options=INDUCTOR_OPTIONS)
        layer.forward = DecodeDispatch(eager, compiled, max_bs)
    return len(layers)


def warm_up(execute: Any, max_bs: int) -> float:
    """Compile the batch-1 and batch-2 graphs now with dummy decodes in block 0; returns seconds."""
    start_s = time.monotonic()
    for num_sequences in sorted({1, min(2, max_bs)}):
        plan = BatchPlan([SequencePlan(token_ids=[0], start_position=0, block_ids=[0])
                          for _ in range(num_sequences)])
        execute(plan)
    return time.monotonic() - start_s
