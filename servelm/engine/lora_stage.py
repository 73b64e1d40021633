"""The LoRA stage: which adapters the running requests hold, and unloaded adapters' release.

The scheduler asks ``adapter_slot`` for a request's runner slot at admission (installing the
adapter; --max-loras-per-batch bounds the distinct adapters running). An adapter unloaded while
requests still use it keeps its weights until the last of them ends: after each update and each
finish this stage releases the unloaded adapters nobody holds any more.
"""

from __future__ import annotations

from typing import Any

from servelm.engine.outputs import RequestOutput
from servelm.engine.request import Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.stage import Stage
from servelm.lora.adapter import LoRAAdapterError
from servelm.lora.manager import LoRAManager


class AdapterSlots:
    """The scheduler's hook: the runner slot of a LoRA request being admitted."""

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager

    def __call__(self, request: Request, running_adapters: set[str]) -> int | str | None:
        """The slot; None when every slot holds a running adapter (it waits); or the error
        message it ends with."""
        assert request.adapter_id is not None
        try:
            return self.manager.acquire(request.adapter_id, running_adapters)
        except LoRAAdapterError as error:  # dropped from memory, then its files changed
            return f"the LoRA adapter could not be read again from disk: {error}"


class LoRAStage(Stage):
    """Releases unloaded adapters once no queued or running request holds them."""

    def __init__(self, manager: LoRAManager, scheduler: Scheduler) -> None:
        self.manager = manager
        self.scheduler = scheduler

    def adapters_in_use(self) -> set[str]:
        """adapter_ids held by unfinished (queued or running) requests."""
        return {r.adapter_id for r in self.scheduler.requests.values() if r.adapter_id is not None}

    def running_adapters(self) -> set[str]:
        return {r.adapter_id for r in self.scheduler.running if r.adapter_id is not None}

    def release_unused(self) -> None:
        if self.manager.has_unloaded:
            self.manager.release_unused(self.adapters_in_use())

    def after_update(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        self.release_unused()
        return []

    def on_finish(self, request: Request, output: RequestOutput) -> None:
        self.release_unused()

    def stats(self) -> dict[str, Any]:
        return {"lora_adapters": self.manager.describe()}
