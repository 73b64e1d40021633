"""The MoE routing figures in the engine: the routing totals in ``stats()`` (for /metrics under
--enable-expert-distribution-metrics) and the recorder's start / stop / dump calls.

The counting itself happens on the model side (servelm.model.expert_load), after every forward
pass; rank 0's runner lives in the engine process, and under tensor parallelism its routing is the
whole batch's, so its counts are the engine's. Under pipeline parallelism the executor's
``StagedExpertLoad`` adds the other stages' layers, asked from their ranks.
"""

from __future__ import annotations

from typing import Any, Protocol

from servelm.engine.stage import Stage
from servelm.model.expert_load import ACTIONS


class ExpertCounts(Protocol):
    """What the engine reads of the routing counts (model/expert_load.py: ``ExpertLoad``, or
    ``StagedExpertLoad`` over pipeline stages)."""

    @property
    def recorder_mode(self) -> str | None: ...

    def totals(self) -> dict[str, Any]: ...

    def record(self, action: str) -> dict[str, Any]: ...

    def placements(self) -> list[tuple[int, ...]]: ...


class ExpertLoadStage(Stage):
    """Reports ``moe``: rows per layer and expert (and per expert-parallel rank), EPLB rebalances."""

    def __init__(self, expert_load: ExpertCounts, is_exported: bool) -> None:
        self.expert_load = expert_load
        self.is_exported = is_exported

    def stats(self) -> dict[str, Any]:
        return {"moe": self.expert_load.totals()} if self.is_exported else {}


def expert_distribution_call(expert_load: ExpertCounts | None, action: str) -> dict[str, Any]:
    """Apply ``action`` to the recorder: {"success", "message"} (and the recording for dump)."""
    assert action in ACTIONS, action
    if expert_load is None or expert_load.recorder_mode is None:
        return {"success": False, "message": "no expert distribution recorder: start the server with "
                                             "--expert-distribution-recorder-mode stat, per_pass or per_token "
                                             "(on a mixture-of-experts model)"}
    return expert_load.record(action)
