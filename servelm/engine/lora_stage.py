"""The LoRA stage: which adapters the running requests hold, and unloaded adapters' release.

A request naming an adapter (``lora_name``) gets its ``Request.lora`` here when it is added
(unknown: 404). The scheduler asks ``AdapterSlots`` for its runner slot at admission (installing
the adapter; --max-loras-per-batch bounds the distinct adapters running). An adapter unloaded while
requests still use it keeps its weights until the last of them ends: after each update and each
finish this stage releases the unloaded adapters nobody holds any more.
"""

from __future__ import annotations

from typing import Any

from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import LoRAState, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.stage import Refusal, Refuses, Stage
from servelm.lora.adapter import LoRAAdapterError
from servelm.lora.manager import AdapterNotFoundError, LoRAManager

NOT_ENABLED = "LoRA is not enabled: start the server with --enable-lora"
LORA_OFF = Refuses(lambda submission: submission.lora_name is not None, NOT_ENABLED)
"""The stage of a server without --enable-lora: it refuses requests that name an adapter."""


class AdapterSlots:
    """The scheduler's hook: the runner slot of a LoRA request being admitted."""

    def __init__(self, manager: LoRAManager, max_adapters: int) -> None:
        self.manager = manager
        self.max_adapters = max_adapters
        """--max-loras-per-batch: most distinct adapters among the running requests (so in any
        step); a request for a further adapter waits."""

    def __call__(self, request: Request, running_adapters: set[str]) -> int | str | None:
        """The slot; None while it must wait (--max-loras-per-batch other adapters run, or every
        slot holds a running adapter); or the error message it ends with."""
        assert request.lora is not None
        adapter_id = request.lora.adapter_id
        if adapter_id not in running_adapters and len(running_adapters) >= self.max_adapters:
            return None
        try:
            return self.manager.acquire(adapter_id, running_adapters)
        except LoRAAdapterError as error:  # dropped from memory, then its files changed
            return f"the LoRA adapter could not be read again from disk: {error}"


class LoRAStage(Stage):
    """Releases unloaded adapters once no queued or running request holds them."""

    def __init__(self, manager: LoRAManager, scheduler: Scheduler) -> None:
        self.manager = manager
        self.scheduler = scheduler

    def adapters_in_use(self) -> set[str]:
        """adapter_ids held by unfinished (queued or running) requests."""
        return {r.lora.adapter_id for r in self.scheduler.requests.values() if r.lora is not None}

    def running_adapters(self) -> set[str]:
        return {r.lora.adapter_id for r in self.scheduler.running if r.lora is not None}

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        """A request naming an adapter runs with it (its ``adapter_id`` roots its prefix-cache
        entries; its slot comes at admission); an unknown name is a 404."""
        if submission.lora_name is None:
            return None
        try:
            request.lora = LoRAState(self.manager.resolve(submission.lora_name))
        except AdapterNotFoundError as not_found:
            return Refusal(str(not_found), 404)
        return None

    def load(self, name: str, path: str) -> dict[str, Any]:
        """Register and load an adapter: {"success", "message", "status"} (400 naming the reason)."""
        try:
            loaded = self.manager.load(name, path, self.running_adapters())
        except LoRAAdapterError as error:
            return {"success": False, "status": 400, "message": str(error)}
        return {"success": True, "status": 200,
                "message": f"LoRA adapter {name!r} loaded in {loaded.load_time_s:.3f} s",
                "load_time_s": loaded.load_time_s}

    def unload(self, name: str) -> dict[str, Any]:
        """Unregister an adapter; requests using it run to the end first (then its weights go)."""
        try:
            draining = self.manager.unload(name, self.adapters_in_use())
        except AdapterNotFoundError as error:
            return {"success": False, "status": 404, "message": str(error)}
        note = " (its running requests finish first)" if draining else ""
        return {"success": True, "status": 200, "message": f"LoRA adapter {name!r} unloaded{note}"}

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
