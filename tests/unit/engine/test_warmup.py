"""The start-up warm-up (servelm.engine.warmup): it runs the runner through prefill chunks and decode
batches, and leaves no trace a user could see: no cached prefix, no counted request or step, every
KV block back in the pool, and outputs exactly as without it."""

from __future__ import annotations

import logging

import pytest

from servelm.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.warmup import freeze_start_up_objects, warm_up, warm_up_for_serving

from .fake_runner import FakeRunner
from .test_engine_core import EOS, greedy, run_all


def make(chunk: int = 16, skip: bool = False, num_blocks: int = 64) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=4)
    config = EngineConfig(cache=CacheConfig(), scheduler=SchedulerConfig(chunked_prefill_size=chunk,
                                                                       max_running_requests=6),
                          server=ServerConfig(skip_server_warmup=skip))
    return LLMEngine(config, runner=runner, eos_token_ids=[EOS], context_length=512), runner


def warm_up_tokens(chunk: int) -> list[int]:
    """What ``warm_up`` computes first: its chunk-pair's tokens (chunk 16, vocab 97)."""
    return [(7 * index + 11) % 97 for index in range(2 * chunk)]


def test_warm_up_runs_chunks_and_decode_batches_and_leaves_nothing_behind() -> None:
    engine, runner = make()
    before = engine.stats()
    assert warm_up(engine) is not None
    # a chunk pair, decode batches 1, 2, 4, 6 (argmax-only), 1 and 6 again (full LM head)
    assert runner.num_forward_tokens == 2 * 16 + (1 + 2 + 4 + 6) + (1 + 6)
    assert runner.max_batch_tokens == 16
    assert engine.stats() == before                   # no step, no prompt token, no cached block
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert engine.prefix_cache is not None and engine.prefix_cache.num_blocks == 0
    # A user prompt equal to what the warm-up computed matches nothing, and the garbage K/V the
    # warm-up left in free blocks never reaches an output.
    prompt = warm_up_tokens(16)
    tokens, _, finished = run_all(engine, {"a": (prompt, greedy(5))})
    assert finished["a"].num_cached_tokens == 0
    assert tokens["a"] == runner.reference(prompt, 5)
    assert engine.stats()["num_prompt_tokens"] == len(prompt)


def test_skip_server_warmup_skips_it(caplog: pytest.LogCaptureFixture) -> None:
    engine, runner = make(skip=True)
    with caplog.at_level(logging.INFO, logger="servelm.engine.warmup"):
        warm_up_for_serving(engine)
    assert runner.num_forward_tokens == 0
    assert "skipped (--skip-server-warmup)" in caplog.text
    engine, runner = make()
    with caplog.at_level(logging.INFO, logger="servelm.engine.warmup"):
        warm_up_for_serving(engine)
    assert runner.num_forward_tokens > 0
    assert "start-up warm-up: prefill chunks and decode batches ran in" in caplog.text


def test_a_pool_too_small_for_two_chunks_warms_a_shorter_chunk() -> None:
    engine, runner = make(chunk=512, num_blocks=10)    # 40 slots: chunks of 16 tokens
    assert warm_up(engine) is not None
    assert runner.max_batch_tokens == 16
    assert engine.block_pool.num_free_blocks == 10


def test_the_flag_is_a_real_flag() -> None:
    from servelm import cli_args
    assert cli_args.parse_args(["--skip-server-warmup"]).server.skip_server_warmup
    assert not cli_args.parse_args([]).server.skip_server_warmup


def test_start_up_objects_leave_the_collectors_passes() -> None:
    """After the freeze a full collection walks none of the objects alive then (a cycle made before it
    stays; one made after it is collected as before)."""
    import gc

    class Node:
        other: object = None

    before = Node()
    before.other = before
    try:
        assert freeze_start_up_objects() > 0
        assert not any(obj is before for obj in gc.get_objects())
        after = Node()
        after.other = after
        del after
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
