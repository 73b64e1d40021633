"""The MoE routing figures in the engine: the routing totals in ``stats()`` (for /metrics under
--enable-expert-distribution-metrics) and the recorder's start / stop / dump calls.

The counting itself happens on the model side (servelm.model.expert_load), after every forward
pass; rank 0's runner lives in the engine process, and under tensor parallelism its routing is the
whole batch's, so its counts are the engine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servelm.engine.stage import Stage

if TYPE_CHECKING:
    from servelm.model.expert_load import ExpertLoad

ACTIONS = ("start", "stop", "dump")


class ExpertLoadStage(Stage):
    """Reports ``moe``: rows per layer and expert (and per expert-parallel rank), EPLB rebalances."""

    def __init__(self, expert_load: ExpertLoad, is_exported: bool) -> None:
        self.expert_load = expert_load
        self.is_exported = is_exported

    def stats(self) -> dict[str, Any]:
        return {"moe": self.expert_load.totals()} if self.is_exported else {}


def expert_distribution_call(expert_load: ExpertLoad | None, action: str) -> dict[str, Any]:
    """Apply ``action`` to the recorder: {"success", "message"} (and the recording for dump)."""
    assert action in ACTIONS, action
    recorder = expert_load.recorder if expert_load is not None else None
    if expert_load is None or recorder is None:
        return {"success": False, "message": "no expert distribution recorder: start the server with "
                                             "--expert-distribution-recorder-mode stat, per_pass or per_token "
                                             "(on a mixture-of-experts model)"}
    if action == "start":
        recorder.start()
        return {"success": True, "message": f"recording ({recorder.mode})"}
    if action == "stop":
        recorder.stop()
        return {"success": True, "message": f"stopped after {len(recorder.passes)} passes"}
    return {"success": True, "message": f"{len(recorder.passes)} passes",
            **recorder.dump(expert_load.layer_ids), "placements": expert_load.placements()}
