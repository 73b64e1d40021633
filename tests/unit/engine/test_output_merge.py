"""Outputs that queue up in the front end while its consumer is busy are yielded as one delta
(servelm.engine.outputs.merge_outputs, AsyncEngine.generate): the concatenation of what the
consumer sees is unchanged, the finished output still comes last, and an engine error still raises."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq

from servelm.config import EngineConfig
from servelm.engine.async_engine import AsyncEngine, EngineDeadError, _Replica
from servelm.engine.frontdoor import ModelInfo
from servelm.engine.outputs import RequestOutput, TokenLogprob, merge_outputs
from servelm.sampling.params import SamplingParams


def delta(tokens: list[int], text: str, total: int, finish: str | None = None,
          logprobs: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, text, finish_reason=finish, num_prompt_tokens=2,
                         num_output_tokens=total, num_cached_tokens=1,
                         logprobs=[TokenLogprob(t, -0.5, [(t, -0.5)]) for t in tokens] if logprobs else None)


def test_merge_joins_tokens_text_and_logprobs_and_keeps_the_later_totals() -> None:
    merged = merge_outputs(delta([5], "a", 1, logprobs=True), delta([6, 7], "bc", 3, "stop", logprobs=True))
    assert merged.new_token_ids == [5, 6, 7] and merged.new_text == "abc"
    assert merged.num_output_tokens == 3 and merged.finish_reason == "stop"
    assert merged.logprobs is not None and [entry.token_id for entry in merged.logprobs] == [5, 6, 7]
    assert merge_outputs(delta([5], "a", 1), delta([6], "b", 2)).logprobs is None


def engine_without_process() -> AsyncEngine:
    """An AsyncEngine whose one replica's PUSH socket connects to nowhere (sends queue up)."""
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"ipc:///tmp/servelm-test-merge-{os.getpid()}")
    replica = _Replica(0, process=None, push=push, pull=None)  # type: ignore[arg-type]
    return AsyncEngine(EngineConfig(), [replica], socket_dir="", model_info=ModelInfo(context_length=64))


async def consume(engine: AsyncEngine, queued: list[RequestOutput | Exception]) -> list[RequestOutput]:
    stream = engine.generate("r", [1, 2], SamplingParams(max_tokens=4))
    first = asyncio.ensure_future(stream.__anext__())
    while "r" not in engine._queues:
        await asyncio.sleep(0)
    for item in queued:   # everything arrives before the consumer runs again
        engine._queues["r"].put_nowait(item)
    seen = [await first]
    async for output in stream:
        seen.append(output)
    return seen


def test_a_consumer_behind_gets_one_delta_for_what_queued_up() -> None:
    engine = engine_without_process()
    queued = [delta([5], "a", 1), delta([6], "b", 2), delta([7], "c", 3), delta([8], "d", 4, "length")]
    seen = asyncio.run(consume(engine, queued))
    assert len(seen) == 1
    assert seen[0].new_token_ids == [5, 6, 7, 8] and seen[0].new_text == "abcd"
    assert seen[0].finish_reason == "length" and seen[0].num_output_tokens == 4
    assert not engine._queues and not engine._owners


def test_an_error_behind_queued_outputs_comes_after_them() -> None:
    engine = engine_without_process()
    error = EngineDeadError("engine process exited")
    seen: list[RequestOutput] = []

    async def run() -> None:
        stream = engine.generate("r", [1, 2], SamplingParams(max_tokens=4))
        first = asyncio.ensure_future(stream.__anext__())
        while "r" not in engine._queues:
            await asyncio.sleep(0)
        for item in (delta([5], "a", 1), delta([6], "b", 2), error):
            engine._queues["r"].put_nowait(item)
        seen.append(await first)
        async for output in stream:
            seen.append(output)

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    assert [output.new_token_ids for output in seen] == [[5, 6]]
