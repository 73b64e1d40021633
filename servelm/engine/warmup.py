"""Start-up warm-up: the engine runs its model through the shapes serving meets before the server
reports ready (SGLang sends itself a warm-up request; ``--skip-server-warmup`` skips both).

Why: the first time a shape runs, oneDNN creates its GEMM primitives, the attention backends and
the C++ kernels touch their code and buffers for the first time, and the allocator's arenas grow.
Without a warm-up the first user pays for it: the first long prompt's TTFT was ~615 ms against
~530 ms for later ones (Gemma 3 270M, 1,019 tokens, issue 16).

What runs (``warm_up``), all through ``Runner.execute`` on plans built here:
- a full ``--chunked-prefill-size`` chunk, then a second one attending to the first (prefill
  attention over cached K/V) whose last row gets greedy (argmax-only: the LM-head screen's) logits;
- decode steps at batch sizes 1, 2, 4, ... and ``--max-running-requests`` (at most 32), argmax-only,
  and at the smallest and largest also through the full LM head (sampling, logprobs).

Invariants:
- Nothing of it is visible to users: it never goes through the scheduler (no request, no metric,
  no step counted), its KV blocks are taken from the pool and given back (their contents are
  garbage that any later request overwrites before reading: only the prefix cache hands out
  written blocks, and the warm-up never inserts into it).
- It runs once, in the engine process, before the "ready" message; an embedding model (pooling
  task) skips it.
- The LM-head screen forgets the warm-up's rows (``LMHeadScreen.forget_rows``): they would turn it
  off for good, and the server would run the full head where an in-process engine screens.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

from servelm.model.forward_batch import BatchPlan, SequencePlan

if TYPE_CHECKING:
    from servelm.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 512
"""Warm-up chunk when chunked prefill is off (--chunked-prefill-size -1): the default chunk."""
MAX_DECODE_BATCH = 32
"""Largest decode batch warmed up (batch sizes double from 1): larger ones are rare at start."""


def warm_up(engine: LLMEngine) -> float | None:
    """Run the warm-up plans on ``engine``'s runner; returns the seconds taken, or None when there
    was nothing to warm (embedding task) or no room for it (a pool too small for two chunks)."""
    if engine.task != "generate":
        return None
    runner = engine.runner
    config = engine.config
    chunk = config.scheduler.max_chunk_tokens or DEFAULT_CHUNK_TOKENS
    chunk = min(chunk, (engine.context_length - 1) // 2,
                engine.block_pool.partition_size * runner.block_size // 2 - runner.block_size)
    if chunk < 1:
        return None
    num_blocks = -(-(2 * chunk + 1) // runner.block_size)
    block_ids = engine.block_pool.allocate(num_blocks)
    if block_ids is None:
        return None
    start_s = time.monotonic()
    try:
        vocab_size = runner.vocab_size
        token_ids = [(7 * index + 11) % vocab_size for index in range(2 * chunk + 1)]
        # a prompt's first chunk (no logits), then its last (one greedy row, argmax-only)
        runner.execute(BatchPlan([SequencePlan(token_ids=token_ids[:chunk], start_position=0,
                                               block_ids=block_ids, num_logits=0)]))
        runner.execute(BatchPlan([SequencePlan(token_ids=token_ids[chunk:2 * chunk], start_position=chunk,
                                               block_ids=block_ids)], argmax_rows=[0]))
        largest = min(MAX_DECODE_BATCH, config.scheduler.max_running_requests)
        batch_size = 1
        while batch_size <= largest:
            # every sequence writes the same slot: its K/V is garbage either way
            plan = BatchPlan([SequencePlan(token_ids=[token_ids[2 * chunk]], start_position=2 * chunk,
                                           block_ids=block_ids) for _ in range(batch_size)])
            plan.argmax_rows = list(range(batch_size))
            runner.execute(plan)
            if batch_size in (1, largest):   # and the full LM head (sampling, logprobs)
                plan.argmax_rows = []
                runner.execute(plan)
            batch_size = min(2 * batch_size, largest) if batch_size < largest else largest + 1
    finally:
        engine.block_pool.release(block_ids)
        _forget_screened_rows(runner)
    return time.monotonic() - start_s


def _forget_screened_rows(runner: object) -> None:
    """The LM-head screen (model/gguf/lm_head_screen.py) turns itself off for good when too many
    of its last rows took the full head; the warm-up's rows (garbage K/V) would count as such."""
    screen = getattr(runner, "lm_head_screen", None)
    if screen is not None:
        screen.forget_rows()


def warm_up_for_serving(engine: LLMEngine) -> None:
    """The engine process's call before it reports ready: warm up unless --skip-server-warmup."""
    if engine.config.server.skip_server_warmup:
        logger.info("start-up warm-up skipped (--skip-server-warmup)")
        return
    seconds = warm_up(engine)
    if seconds is None:
        logger.info("start-up warm-up: nothing to warm (embedding model or a KV pool too small)")
    else:
        logger.info("start-up warm-up: prefill chunks and decode batches ran in %.2f s", seconds)


def freeze_start_up_objects() -> int:
    """The engine process's call once the model is loaded and warmed: collect the start-up's garbage,
    then move every object left (the model's modules, weights' Python objects, kernels, the server's
    code: ~250,000 for Qwen2.5-Coder 0.5B GGUF) into the collector's permanent generation
    (``gc.freeze``), as SGLang and vLLM do. They live as long as the process, and a full collection
    walked them all: tens of ms, the running requests' next token stalled for it. Returns how many
    were frozen. Objects made later (requests) are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
