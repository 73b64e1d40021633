"""The stage seam (engine/stage.py): a feature defined here, in a test, plugs into the step through
``LLMEngine(extra_stages=...)`` alone, with no change to engine.py, and each of its hooks runs at
its point of the step."""

from __future__ import annotations

from typing import Any

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import FinishReason, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.stage import Hooks, Refusal, Stage, StepCore
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner

EOS = 96


class TokenBudget(Stage):
    """A feature the engine does not know: each group may generate at most ``budget`` tokens in
    all; a request over it ends with "length" before its next schedule. It also owns request ids
    starting with ``quota:`` (answering their abort itself), and reports figures."""

    def __init__(self, scheduler: Scheduler, budget: int) -> None:
        self.scheduler = scheduler
        self.budget = budget
        self.used: dict[str, int] = {}
        self.events: list[str] = []
        self.is_closed = False

    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        self.events.append("before_schedule")
        outputs = []
        for request in list(self.scheduler.running):
            if self.used.get(request.group, 0) >= self.budget:
                self.scheduler.finish(request, FinishReason.LENGTH)
                outputs.append(core.output_of(request))
                outputs[-1].kv_transfer_params = {"cut_at": self.used[request.group]}
        return outputs

    def before_update(self, output: SchedulerOutput, results: list[StepResult]) -> None:
        self.events.append("before_update")

    def after_update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        self.events.append("after_update")
        for item, result in zip(output.scheduled, results, strict=True):
            group = item.request.group
            self.used[group] = self.used.get(group, 0) + len(result.token_ids)
        return []

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        output.kv_transfer_params = {"tokens_used": self.used.get(request.group, 0)}

    def abort(self, request_id: str) -> RequestOutput | None:
        if not request_id.startswith("quota:"):
            return None
        return RequestOutput(request_id, [], "", finish_reason=FinishReason.ABORT.value)

    def stats(self) -> dict[str, Any]:
        return {"token_budget_groups": len(self.used)}

    def close(self) -> None:
        self.is_closed = True


def test_a_stage_defined_in_a_test_runs_in_the_step() -> None:
    runner = FakeRunner(num_blocks=64, block_size=4)
    built: list[TokenBudget] = []

    def make_budget(engine: LLMEngine) -> TokenBudget:  # collaborators through the constructor
        built.append(TokenBudget(engine.scheduler, budget=5))
        return built[-1]

    engine = LLMEngine(EngineConfig(), runner=runner, eos_token_ids=[EOS], context_length=512,
                       extra_stages=[make_budget])
    stage = built[0]
    assert engine.stages[-1] is stage

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert engine.add_request("a", [1, 2, 3], params, group="g") is None
    assert engine.add_request("b", [4, 5, 6, 7], params, group="h") is None
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert engine.add_request("c", [8, 9], short, group="k") is None
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    finished: dict[str, RequestOutput] = {}
    for _ in range(50):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            if output.is_finished:
                finished[output.request_id] = output
    assert set(finished) == {"a", "b", "c"}
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7])):
        # the stage cut each group at its budget; the tokens are the model's own
        assert tokens[request_id] == runner.reference(prompt, 5)
        assert finished[request_id].finish_reason == "length"
        assert finished[request_id].kv_transfer_params == {"cut_at": 5}
    assert tokens["c"] == runner.reference([8, 9], 3)  # ended by max_tokens: on_finish saw it
    assert finished["c"].kv_transfer_params == {"tokens_used": 3}
    steps = engine.num_steps
    assert stage.events[:4] == ["before_schedule", "before_update", "after_update", "before_schedule"]
    assert stage.events.count("before_update") == steps
    assert engine.stats()["token_budget_groups"] == 3

    aborted = engine.abort_request("quota:1")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert engine.abort_request("unknown") is None
    engine.shutdown()
    assert stage.is_closed


class Gate(Stage):
    """Admission hooks of a feature the engine does not know: prompts starting with token 0 are
    refused (422); requests of group "mine" are taken (this stage serves them, nothing queues)."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self.taken: list[str] = []

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        self.checked.append(request.request_id)
        return Refusal("no zeros here", 422) if request.prompt_token_ids[0] == 0 else None

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        if request.group != "mine":
            return False
        self.taken.append(request.request_id)
        return True


def test_a_stage_defined_in_a_test_refuses_and_takes_requests_at_admission() -> None:
    gate = Gate()
    engine = LLMEngine(EngineConfig(), runner=FakeRunner(num_blocks=64, block_size=4),
                       eos_token_ids=[EOS], context_length=512, extra_stages=[lambda engine: gate])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    refused = engine.add_request("zero", [0, 5, 6], params)
    assert refused is not None and refused.finish_reason == "error"
    assert refused.error == "no zeros here" and refused.error_status == 422
    assert engine.add_request("taken", [5, 6], params, group="mine") is None
    assert gate.taken == ["taken"] and not engine.has_unfinished()  # not queued: the stage has it
    assert engine.add_embedding_request("embed", [5, 6]) is not None  # the core's own check first
    assert gate.checked == ["zero", "taken"]
    assert engine.add_request("queued", [5, 6], params) is None
    assert list(engine.scheduler.requests) == ["queued"]


def test_only_overridden_hooks_are_called() -> None:
    class Quiet(Stage):
        def stats(self) -> dict[str, Any]:
            return {"quiet": True}

    hooks = Hooks([Quiet()])
    assert [len(hooks[name]) for name in ("before_schedule", "after_update", "on_finish", "stats")] \
        == [0, 0, 0, 1]
