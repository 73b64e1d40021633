"""What the MoE layers routed, pass by pass: the expert distribution recorder, the routing totals
/metrics exports, and EPLB (expert placement rebalanced from the measured load).

The runner calls ``ExpertLoad.after_pass()`` after every forward pass; it takes each MoE block's
routing of that pass (``RoutedExpertsBlock.pass_expert_ids``, kept while ``is_recording``: one
``[T, k]`` tensor per call, several on a pipeline stage that runs micro-batches) and feeds:

- the recorder (--expert-distribution-recorder-mode), between ``start`` and ``stop``: a ring
  of the last ``buffer_size`` passes, each pass the rows per layer and logical expert (``stat``,
  summed at dump time, and ``per_pass``) or every token's chosen experts per layer (``per_token``);
- the totals since start (rows per layer and logical expert; under EP rows per layer and
  expert-parallel rank: a rank with whole experts, or a group of ranks sharing its experts'
  columns when --ep-size is below --tp-size, counting each row where it is computed);
- EPLB (--enable-eplb): the rows since the last rebalance; every ``num_iterations`` passes
  rank 0 of each stage plans a placement per layer of its stage (``moe_parallel.rebalance``) and
  broadcasts it to its stage's ranks, and every rank moves its experts (``apply_placement``).
  Whether to move is decided once for the model: the stages' leaders sum their layers'
  balancedness over the pipeline (``all_reduce_stages``).

Pipeline parallelism (--pp-size > 1): every stage's ranks count their own stage's layers (a stage
may have none). The engine process holds the last stage's rank 0; ``StagedExpertLoad`` there asks
the other stages' leaders for an ``ExpertLoadSnapshot`` over the executor's command sockets and
merges them in layer order, so the totals, the dump and the recorder's start/stop cover every stage.

Invariants: every rank executes the same passes (model/runner.py), so each rank's ``after_pass``
count, and so the pass of a rebalance and its collectives, are the same on all ranks of every
stage; the placement applied is the stage leader's (broadcast), so a stage's ranks agree on it by
construction. Routing is replicated under TP, so a stage leader's counts are the whole batch's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from servelm.distributed.parallel import ParallelContext
from servelm.model.layers.moe_parallel import PLACED_EXPERTS, ExpertPlacement, rebalance

DEFAULT_BUFFER_PASSES = 1000
"""Passes the recorder keeps when --expert-distribution-recorder-buffer-size is unset (SGLang's)."""
ACTIONS = ("start", "stop", "dump")


@dataclass(frozen=True)
class EplbSettings:
    """--enable-eplb's schedule."""

    num_iterations: int
    """Forward passes between two rebalances."""
    min_balancedness: float
    """Rebalance only when the window's mean balancedness (mean / max rows per rank) is below this."""
    num_redundant: int


@dataclass(frozen=True)
class ExpertLoadSnapshot:
    """One stage's counts (all of them, or several stages' merged: ``merge_snapshots``); what a
    pipeline stage's leader sends the engine process."""

    layer_ids: list[int]
    expert_rows: torch.Tensor
    """``[L, E]`` rows routed to each (layer, logical expert) since start."""
    rank_rows: torch.Tensor
    """``[L, ep]`` rows each expert-parallel rank (or group) computed per layer since start."""
    num_passes: int
    num_rebalances: int
    placements: list[tuple[int, ...]]
    """Each expert-parallel layer's slot -> logical expert."""
    recorder_mode: str | None
    is_recording: bool
    num_recorded: int
    """Passes the recorder keeps."""
    passes: list[Any] | None
    """The recorder's kept passes (None: not asked for): per pass ``[L, E]`` counts, or per layer
    each token's experts (per_token)."""


class ExpertRecorder:
    """The passes recorded between ``start`` and ``stop`` (see the module docstring)."""

    def __init__(self, mode: str, buffer_size: int | None) -> None:
        self.mode = mode
        size = buffer_size or DEFAULT_BUFFER_PASSES
        self.passes: deque[Any] = deque(maxlen=None if size == -1 else size)
        self.is_recording = False

    def add(self, counts: torch.Tensor, expert_ids: list[torch.Tensor]) -> None:
        if not self.is_recording:
            return
        self.passes.append([ids.tolist() for ids in expert_ids] if self.mode == "per_token" else counts)

    def start(self) -> None:
        """Start recording afresh (SGLang's start drops what an earlier recording kept)."""
        self.passes.clear()
        self.is_recording = True

    def stop(self) -> None:
        self.is_recording = False


class ExpertLoad:
    """The MoE blocks of one rank's model (its pipeline stage's; possibly none) and what their
    routing feeds (module docstring)."""

    def __init__(self, blocks: list[tuple[int, Any]], parallel: ParallelContext,
                 recorder: ExpertRecorder | None, eplb: EplbSettings | None) -> None:
        assert blocks or parallel.pp_size > 1, "a model without MoE layers has no expert load"
        self.layer_ids = [layer_id for layer_id, _ in blocks]
        self.blocks = [block for _, block in blocks]
        for block in self.blocks:
            block.is_recording = True
        self.parallel = parallel
        self.recorder = recorder
        self.eplb = eplb
        num_experts = self.blocks[0].num_experts if self.blocks else 0
        self.expert_rows = torch.zeros(len(blocks), num_experts, dtype=torch.int64)
        """Rows routed to each (layer, logical expert) since start."""
        self.rank_rows = torch.zeros(len(blocks), parallel.ep_size, dtype=torch.int64)
        """Rows each expert-parallel rank computed per layer since start."""
        self._window_expert_rows = torch.zeros_like(self.expert_rows)
        self._window_rank_rows = torch.zeros_like(self.rank_rows)
        self.num_passes = 0
        self.num_rebalances = 0

    @property
    def recorder_mode(self) -> str | None:
        return self.recorder.mode if self.recorder is not None else None

    def after_pass(self) -> None:
        expert_ids = [_take_pass(block) for block in self.blocks]
        counts = (torch.stack([torch.bincount(ids.reshape(-1).cpu(), minlength=self.expert_rows.shape[1])
                               for ids in expert_ids]) if expert_ids
                  else torch.zeros_like(self.expert_rows))                 # [L, E]
        rank_rows = torch.tensor([self._rows_per_rank(block, ids) for block, ids in zip(self.blocks, expert_ids)],
                                 dtype=torch.int64).reshape(self.rank_rows.shape)   # [L, ep]
        if self.recorder is not None:
            self.recorder.add(counts, expert_ids)
        self.expert_rows += counts
        self.rank_rows += rank_rows
        self._window_expert_rows += counts
        self._window_rank_rows += rank_rows
        self.num_passes += 1
        if self.eplb is not None and self.num_passes % self.eplb.num_iterations == 0:
            self.rebalance()

    def forget(self) -> None:
        """Drop what was counted so far (the compiled graphs' warm-up passes are no one's)."""
        for counts in (self.expert_rows, self.rank_rows, self._window_expert_rows, self._window_rank_rows):
            counts.zero_()
        self.num_passes = 0

    def _rows_per_rank(self, block: Any, expert_ids: torch.Tensor) -> list[int]:
        if isinstance(block.experts, PLACED_EXPERTS):
            return block.experts.placement.rows_per_rank(expert_ids.cpu())
        return [expert_ids.numel()]

    def rebalance(self) -> None:
        """EPLB: each stage's rank 0 plans its layers' placements from the window's rows and
        broadcasts them with the model-wide decision; every rank moves its experts. The window
        starts over."""
        assert self.eplb is not None
        num_slots = self.expert_rows.shape[1] + self.eplb.num_redundant
        plan = torch.zeros(1 + len(self.blocks) * num_slots, dtype=torch.int64)
        if self.parallel.tp_rank == 0 and self._is_unbalanced():
            plan[0] = 1
            plan[1:] = torch.tensor([e for load in self._window_expert_rows.tolist()
                                     for e in rebalance([float(n) for n in load], self.eplb.num_redundant,
                                                        self.parallel.ep_size).physical_to_logical],
                                    dtype=torch.int64)
        self.parallel.broadcast(plan, 0)
        self._window_expert_rows.zero_()
        self._window_rank_rows.zero_()
        if not plan[0]:
            return
        for block, slots in zip(self.blocks, plan[1:].view(len(self.blocks), num_slots).tolist()):
            block.experts.apply_placement(ExpertPlacement(tuple(slots), self.expert_rows.shape[1],
                                                          self.parallel.ep_size))
        self.num_rebalances += 1

    def _is_unbalanced(self) -> bool:
        """Stage leaders only: the mean balancedness of every stage's layers over the window is
        below the threshold (one decision for the model, the same on every stage)."""
        assert self.eplb is not None
        ratios = _layer_balancedness(self._window_rank_rows)
        summary = torch.tensor([float(ratios.sum()), float(ratios.numel())], dtype=torch.float64)
        self.parallel.all_reduce_stages(summary)
        return bool(summary[1] > 0 and summary[0] / summary[1] < self.eplb.min_balancedness)

    def placements(self) -> list[tuple[int, ...]]:
        """Each EP layer's slot -> logical expert (for the dump and tests)."""
        return [block.experts.placement.physical_to_logical for block in self.blocks
                if isinstance(block.experts, PLACED_EXPERTS)]

    def snapshot(self, with_passes: bool = False) -> ExpertLoadSnapshot:
        recorder = self.recorder
        return ExpertLoadSnapshot(
            layer_ids=list(self.layer_ids), expert_rows=self.expert_rows.clone(), rank_rows=self.rank_rows.clone(),
            num_passes=self.num_passes, num_rebalances=self.num_rebalances, placements=self.placements(),
            recorder_mode=self.recorder_mode, is_recording=recorder is not None and recorder.is_recording,
            num_recorded=len(recorder.passes) if recorder is not None else 0,
            passes=list(recorder.passes) if with_passes and recorder is not None else None)

    def control(self, action: str) -> ExpertLoadSnapshot | None:
        """Apply a recorder ``action`` to this rank (start, stop) or report (snapshot, dump: with
        the recorder's passes); what a pipeline stage's worker runs for the engine."""
        if action in ("start", "stop") and self.recorder is not None:
            getattr(self.recorder, action)()
            return None
        if action in ("snapshot", "dump"):
            return self.snapshot(with_passes=action == "dump")
        return None

    def totals(self) -> dict[str, Any]:
        """The routing since start, for engine stats and /metrics."""
        return totals_of(self.snapshot(), self.parallel.ep_size)

    def record(self, action: str) -> dict[str, Any]:
        """The recorder's start, stop or dump (``expert_distribution_call``'s answer)."""
        snapshot = self.control(action) or self.snapshot()
        return recorder_answer(snapshot, action)


class StagedExpertLoad:
    """The engine process's view under --pp-size > 1: rank 0's ExpertLoad (the last stage) and the
    other stages' leaders, reached through ``ask(action)`` (the executor sends the action to every
    rank and returns the other stages' leaders' snapshots, first stage first; None for start/stop)."""

    def __init__(self, own: ExpertLoad, ask: Callable[[str], list[ExpertLoadSnapshot]]) -> None:
        self.own = own
        self.ask = ask

    @property
    def recorder_mode(self) -> str | None:
        return self.own.recorder_mode

    def merged(self, action: str = "snapshot") -> ExpertLoadSnapshot:
        """Every stage's counts, in layer order (``action``: snapshot, or dump with the passes)."""
        others = self.ask(action)
        return merge_snapshots([*others, self.own.snapshot(with_passes=action == "dump")])

    def totals(self) -> dict[str, Any]:
        return totals_of(self.merged(), self.own.parallel.ep_size)

    def placements(self) -> list[tuple[int, ...]]:
        return self.merged().placements

    def record(self, action: str) -> dict[str, Any]:
        if action in ("start", "stop"):
            self.ask(action)
            self.own.control(action)
        return recorder_answer(self.merged("dump" if action == "dump" else "snapshot"), action)


def _take_pass(block: Any) -> torch.Tensor:
    """The block's ``[T, k]`` routing of the pass that just ran (its calls concatenated, in plan
    order), and forget it; ``[0, 1]`` when it ran none."""
    calls, block.pass_expert_ids = block.pass_expert_ids, []
    if not calls:
        return torch.zeros(0, 1, dtype=torch.int64)
    return calls[0] if len(calls) == 1 else torch.cat(calls)


def balancedness(rank_rows: torch.Tensor) -> float:
    """Mean over layers of mean / max rows per rank (1.0: every rank computed as many rows)."""
    return float(_layer_balancedness(rank_rows).mean())


def _layer_balancedness(rank_rows: torch.Tensor) -> torch.Tensor:
    """``[L]``: per layer mean / max rows per rank (1.0: balanced; no row counts as 0)."""
    rows = rank_rows.double()
    if rows.numel() == 0:
        return rows.new_zeros(rows.shape[0])
    return rows.mean(dim=1) / rows.max(dim=1).values.clamp(min=1)


def merge_snapshots(snapshots: list[ExpertLoadSnapshot]) -> ExpertLoadSnapshot:
    """Several stages' snapshots (first stage first) as one: layers concatenated in order, each
    recorded pass's layers joined (every stage records the same passes). Stages with no MoE layer
    add nothing but their pass count."""
    parts = [snapshot for snapshot in snapshots if snapshot.layer_ids]
    assert parts, "no stage has a MoE layer"
    passes: list[Any] | None = None
    if all(part.passes is not None for part in parts):
        per_stage = [part.passes or [] for part in parts]
        assert len({len(kept) for kept in per_stage}) == 1, "stages recorded different passes"
        passes = [(sum((list(layers) for layers in stage_passes), []) if parts[0].recorder_mode == "per_token"
                   else torch.cat(list(stage_passes))) for stage_passes in zip(*per_stage)]
    last = snapshots[-1]
    return replace(last, layer_ids=[layer for part in parts for layer in part.layer_ids],
                   expert_rows=torch.cat([part.expert_rows for part in parts]),
                   rank_rows=torch.cat([part.rank_rows for part in parts]),
                   num_passes=max(snapshot.num_passes for snapshot in snapshots),
                   num_rebalances=max(snapshot.num_rebalances for snapshot in snapshots),
                   placements=[placement for part in parts for placement in part.placements], passes=passes)


def totals_of(snapshot: ExpertLoadSnapshot, ep_size: int) -> dict[str, Any]:
    """/metrics' and the engine stats' ``moe``."""
    return {"layers": snapshot.layer_ids, "expert_rows": snapshot.expert_rows.tolist(),
            "ep_rank_rows": snapshot.rank_rows.tolist() if ep_size > 1 else None,
            "balancedness": balancedness(snapshot.rank_rows) if ep_size > 1 else None,
            "eplb_rebalances": snapshot.num_rebalances, "num_passes": snapshot.num_passes}


def recorder_answer(snapshot: ExpertLoadSnapshot, action: str) -> dict[str, Any]:
    """{"success", "message"} for start and stop; for dump also the recording: ``stat`` one
    ``[layer][expert]`` row count summed over the kept passes, ``per_pass`` one such table per
    pass, ``per_token`` per pass per layer each token's experts; and the placements."""
    assert action in ACTIONS, action
    if action == "start":
        return {"success": True, "message": f"recording ({snapshot.recorder_mode})"}
    if action == "stop":
        return {"success": True, "message": f"stopped after {snapshot.num_recorded} passes"}
    kept = snapshot.passes or []
    dump: dict[str, Any] = {"success": True, "message": f"{len(kept)} passes", "mode": snapshot.recorder_mode,
                            "layers": snapshot.layer_ids, "num_passes": len(kept),
                            "is_recording": snapshot.is_recording}
    if snapshot.recorder_mode == "stat":
        dump["rows"] = (torch.stack(kept).sum(0).tolist() if kept else [[] for _ in snapshot.layer_ids])
    elif snapshot.recorder_mode == "per_pass":
        dump["passes"] = [counts.tolist() for counts in kept]
    else:
        dump["passes"] = kept
    dump["placements"] = snapshot.placements
    return dump


def build_expert_load(model: torch.nn.Module, parallel: ParallelContext, config: Any,
                      has_experts: bool) -> ExpertLoad | None:
    """The model's ExpertLoad where a flag asks for one (--enable-eplb, a recorder mode,
    --enable-expert-distribution-metrics); None otherwise. ``has_experts``: the model (not only
    this pipeline stage) has MoE layers. ValueError naming the flag when it has none (or, with
    --ep-size > 1, for expert parallelism itself)."""
    from servelm.model.architectures.moe_block import RoutedExpertsBlock

    blocks = [(int(name.split(".")[-2]), module) for name, module in model.named_modules()
              if isinstance(module, RoutedExpertsBlock)]
    observability, eplb_flags = config.observability, config.parallel
    wanted = [flag for flag, is_set in (
        ("--enable-eplb", eplb_flags.enable_eplb),
        ("--expert-distribution-recorder-mode", observability.expert_distribution_recorder_mode is not None),
        ("--enable-expert-distribution-metrics", observability.enable_expert_distribution_metrics)) if is_set]
    if parallel.ep_size > 1:
        wanted.append("--ep-size")
    if wanted and not (blocks or (parallel.pp_size > 1 and has_experts)):
        raise ValueError(f"{', '.join(wanted)}: {type(model).__name__} has no mixture-of-experts layer")
    if wanted in ([], ["--ep-size"]):
        return None
    mode = observability.expert_distribution_recorder_mode
    recorder = (ExpertRecorder(mode, observability.expert_distribution_recorder_buffer_size)
                if mode is not None else None)
    eplb = (EplbSettings(eplb_flags.eplb_rebalance_num_iterations,
                         eplb_flags.eplb_min_rebalancing_utilization_threshold,
                         eplb_flags.ep_num_redundant_experts) if eplb_flags.enable_eplb else None)
    return ExpertLoad(blocks, parallel, recorder, eplb)
