"""The one interface an optional feature plugs into the engine step through.

``LLMEngine.step()`` is schedule -> execute -> update with the stages around it, and names no
feature::

    (submit: for stage: stage.check(request, message)     # refuse (a 4xx) or fill its state
             for stage: stage.on_add(request, message)    # start its work; True: it took it
             then the request joins the waiting queue unless a stage took it)
    for stage: outputs += stage.before_schedule(core)      # grammars ready, K/V arrived, drafts
    output = scheduler.schedule(); results = executor.execute(output)
    (nothing scheduled: the first stage that has something to wait for waits: wait_idle)
    for stage: stage.before_update(output, results)        # acceptance figures
    touched = scheduler.update(output, results)
    for stage: outputs += stage.after_update(output, results)   # beams step, tree K/V moves
    for each touched request (not internal): on_new_tokens -> detokenize -> its output
        -> on_finish(request, output) when it ended

Beam search, grammars, disaggregation, speculation, prompt sharing, LoRA and the hierarchical
cache are stages (the engine builds the list at construction, in that order of concern: a stage's
hook runs before the next stage's same hook). A feature that is off but asked for by a request
(LoRA without --enable-lora, a K/V transfer on a co-located server) is a ``Refuses`` stage that
only checks, so the engine names no feature at admission either. A stage receives its collaborators (scheduler, KV manager, runner)
through its constructor. Every hook has a no-op default, so a stage overrides only what it needs;
the engine calls only the overridden ones (``Hooks``), so an unused hook costs the step nothing.

Invariants:
- A stage never changes which requests the scheduler schedules except through request state the
  scheduler already reads (its own per-feature object on ``Request``, ``held_by``).
- Admission is two passes: every stage's ``check`` first (none starts work on a request another
  stage will refuse), then ``on_add``; the first ``on_add`` that takes the request (a beam search
  serves it from its own beams) ends the pass, and the request is not queued.
- ``on_finish`` runs once per request that ends inside the step or by ``abort``, after its last
  output is built (a stage may annotate that output, e.g. ``kv_transfer_params``).
- ``abort`` lets a stage answer for request ids it owns (a beam search's client requests); the
  first stage that returns an output wins and the scheduler is not asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import Request
from servelm.engine.scheduler_output import SchedulerOutput, StepResult


class StepCore(Protocol):
    """What a stage may ask of the engine during ``before_schedule``."""

    def apply(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        """Apply a step the model did not run (a decode server's arrived K/V and first tokens)
        with the normal update: stop rules, stages, detokenizer, outputs."""

    def output_of(self, request: Request) -> RequestOutput:
        """The request's next output (a request a stage just ended, say)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request cannot be served (its error output: ``reason`` with HTTP ``status``)."""

    reason: str
    status: int = 400


class Stage(Protocol):
    """An optional feature's hooks into the step; every hook defaults to doing nothing."""

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        """A request is being added: why this stage cannot serve it, or None. It may fill the
        request's own state for this feature (``Request.lora``), and must start nothing: a later
        stage may still refuse the request."""
        return None

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        """Every stage accepted the request: start this feature's work on it (a grammar's
        compile, a transfer; hold it back through ``Request.held_by``). True: this stage took
        the request (it is not queued, and later stages are not asked)."""
        return False

    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        """Before the scheduler runs: prepare request state it reads; returns outputs of requests
        this ended or advanced."""
        return []

    def before_update(self, output: SchedulerOutput, results: list[StepResult]) -> None:
        """The model's results, before the scheduler applies them (drafts still attached)."""
        return None

    def after_update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        """After the scheduler applied the results; returns outputs this stage answers for."""
        return []

    def on_new_tokens(self, request: Request) -> None:
        """A running request got tokens this step (before they are detokenized)."""
        return None

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        """The request ended; ``output`` is its last output."""
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request this stage owns (None: not one of its ids)."""
        return None

    def wait_idle(self) -> bool:
        """Nothing was scheduled: block briefly on what waiting requests wait for; True when this
        stage had something to wait for (the later stages are not asked)."""
        return False

    def stats(self) -> dict[str, Any]:
        """Live figures merged into the engine's stats (flat, so replicas' counts sum)."""
        return {}

    def close(self) -> None:
        """Release threads, sockets and files at shutdown."""
        return None


HOOKS = ("check", "on_add", "before_schedule", "before_update", "after_update", "on_new_tokens", "on_finish", "abort",
         "wait_idle", "stats", "close")


def _overrides(stage: Stage, name: str) -> bool:
    default = getattr(Stage, name)
    return any(name in vars(cls) and vars(cls)[name] is not default
               for cls in type(stage).__mro__ if cls is not Stage and cls is not object)


@dataclass
class Hooks:
    """The stages' overridden hooks, bound once at construction, in stage order."""

    stages: Sequence[Stage]
    by_name: dict[str, list[Callable[..., Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in HOOKS:
            self.by_name[name] = [getattr(stage, name) for stage in self.stages
                                  if _overrides(stage, name)]

    def __getitem__(self, name: str) -> list[Callable[..., Any]]:
        return self.by_name[name]


@dataclass(frozen=True)
class Refuses(Stage):
    """A feature that is off: refuses the requests that ask for it (``asks``), naming the flag."""

    asks: Callable[[SubmitRequest], bool]
    reason: str

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        return Refusal(self.reason) if self.asks(submission) else None
