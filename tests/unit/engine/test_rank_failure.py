"""A failed tensor-parallel rank: every request ends with its error, then the engine stops."""

from __future__ import annotations

import pytest

from servelm.config import EngineConfig, SchedulerConfig
from servelm.distributed.errors import RankFailedError
from servelm.engine.engine import LLMEngine
from servelm.model.forward_batch import BatchPlan
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner


class RankDiesRunner(FakeRunner):
    """Runs ``num_ok_steps`` steps, then reports a dead rank (as MultiprocExecutor does)."""

    def __init__(self, num_ok_steps: int) -> None:
        super().__init__()
        self.num_ok_steps = num_ok_steps

    def execute(self, plan: BatchPlan):  # type: ignore[no-untyped-def]
        if self.num_ok_steps == 0:
            raise RankFailedError("tensor-parallel rank 1 (pid 4242) was killed by SIGKILL")
        self.num_ok_steps -= 1
        return super().execute(plan)


def test_a_dead_rank_ends_every_request_then_the_engine() -> None:
    engine = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_running_requests=1)),
                       runner=RankDiesRunner(num_ok_steps=2), eos_token_ids=[], context_length=64)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert engine.add_request("running", [1, 2, 3], params) is None
    assert engine.add_request("waiting", [4, 5], params) is None  # queued: one running at a time
    assert [len(o.new_token_ids) for o in engine.step() + engine.step()] == [1, 1]
    outputs = {output.request_id: output for output in engine.step()}
    assert set(outputs) == {"running", "waiting"}
    for output in outputs.values():
        assert output.finish_reason == "error" and output.is_finished
        assert output.error == "tensor-parallel rank 1 (pid 4242) was killed by SIGKILL"
    assert engine.has_unfinished()  # so the engine loop steps once more, and stops
    with pytest.raises(RankFailedError, match="rank 1"):
        engine.step()
