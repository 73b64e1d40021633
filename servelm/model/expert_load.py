"""What the MoE layers routed, pass by pass: the expert distribution recorder, the routing totals
/metrics exports, and EPLB (expert placement rebalanced from the measured load).

The runner calls ``ExpertLoad.after_pass()`` after every forward pass; it reads each MoE block's
routing of that pass (``RoutedExpertsBlock.last_expert_ids``, kept while ``is_recording``) and feeds:

- the recorder (--expert-distribution-recorder-mode), between ``start()`` and ``stop()``: a ring
  of the last ``buffer_size`` passes, each pass the rows per layer and expert (``stat``, summed at
  dump time, and ``per_pass``) or every token's chosen experts per layer (``per_token``);
- the totals since start (rows per layer and expert; under EP rows per layer and rank);
- EPLB (--enable-eplb): the rows since the last rebalance; every ``num_iterations`` passes rank 0
  plans a placement per layer (``moe_parallel.rebalance``) and broadcasts it, and every rank
  moves its experts (``ExpertParallelMoE.apply_placement``).

Invariants: every tensor-parallel rank executes the same passes (model/runner.py), so each rank's
``after_pass`` count, and so the pass of a rebalance and its collectives, are the same on all
ranks; the placement applied is rank 0's (broadcast), so ranks agree on it by construction.
Routing is replicated under TP, so rank 0's counts are the whole batch's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from servelm.distributed.parallel import ParallelContext
from servelm.model.layers.moe_parallel import ExpertParallelMoE, ExpertPlacement, rebalance

DEFAULT_BUFFER_PASSES = 1000
"""Passes the recorder keeps when --expert-distribution-recorder-buffer-size is unset (SGLang's)."""


@dataclass(frozen=True)
class EplbSettings:
    """--enable-eplb's schedule."""

    num_iterations: int
    """Forward passes between two rebalances."""
    min_balancedness: float
    """Rebalance only when the window's mean balancedness (mean / max rows per rank) is below this."""
    num_redundant: int


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

    def dump(self, layer_ids: list[int]) -> dict[str, Any]:
        """The recording: ``stat`` one ``[layer][expert]`` row count summed over the kept passes,
        ``per_pass`` one such table per pass, ``per_token`` per pass per layer each token's experts."""
        dump: dict[str, Any] = {"mode": self.mode, "layers": layer_ids, "num_passes": len(self.passes),
                                "is_recording": self.is_recording}
        if self.mode == "stat":
            dump["rows"] = (torch.stack(list(self.passes)).sum(0).tolist() if self.passes
                            else [[] for _ in layer_ids])
        elif self.mode == "per_pass":
            dump["passes"] = [counts.tolist() for counts in self.passes]
        else:
            dump["passes"] = list(self.passes)
        return dump


class ExpertLoad:
    """The MoE blocks of one model and what their routing feeds (module docstring)."""

    def __init__(self, blocks: list[tuple[int, Any]], parallel: ParallelContext,
                 recorder: ExpertRecorder | None, eplb: EplbSettings | None) -> None:
        assert blocks, "a model without MoE layers has no expert load"
        self.layer_ids = [layer_id for layer_id, _ in blocks]
        self.blocks = [block for _, block in blocks]
        for block in self.blocks:
            block.is_recording = True
        self.parallel = parallel
        self.recorder = recorder
        self.eplb = eplb
        num_experts = self.blocks[0].num_experts
        self.expert_rows = torch.zeros(len(blocks), num_experts, dtype=torch.int64)
        """Rows routed to each (layer, logical expert) since start."""
        self.rank_rows = torch.zeros(len(blocks), parallel.ep_size, dtype=torch.int64)
        """Rows each expert-parallel rank computed per layer since start."""
        self._window_expert_rows = torch.zeros_like(self.expert_rows)
        self._window_rank_rows = torch.zeros_like(self.rank_rows)
        self.num_passes = 0
        self.num_rebalances = 0

    def after_pass(self) -> None:
        expert_ids = [block.last_expert_ids for block in self.blocks]
        if any(ids is None for ids in expert_ids):
            return   # a pass that ran no MoE layer (none here today)
        for block in self.blocks:
            block.last_expert_ids = None
        counts = torch.stack([torch.bincount(ids.reshape(-1).cpu(), minlength=self.expert_rows.shape[1])
                              for ids in expert_ids])          # [L, E]
        rank_rows = torch.tensor([self._rows_per_rank(block, ids) for block, ids in zip(self.blocks, expert_ids)],
                                 dtype=torch.int64)           # [L, ep]
        if self.recorder is not None:
            self.recorder.add(counts, expert_ids)
        self.expert_rows += counts
        self.rank_rows += rank_rows
        self._window_expert_rows += counts
        self._window_rank_rows += rank_rows
        self.num_passes += 1
        if self.eplb is not None and self.num_passes % self.eplb.num_iterations == 0:
            self.rebalance()

    def _rows_per_rank(self, block: Any, expert_ids: torch.Tensor) -> list[int]:
        if isinstance(block.experts, ExpertParallelMoE):
            return block.experts.placement.rows_per_rank(expert_ids.cpu())
        return [expert_ids.numel()]

    @staticmethod
    def balancedness(rank_rows: torch.Tensor) -> float:
        """Mean over layers of mean / max rows per rank (1.0: every rank computed as many rows)."""
        rows = rank_rows.double()
        most = rows.max(dim=1).values.clamp(min=1)
        return float((rows.mean(dim=1) / most).mean())

    def rebalance(self) -> None:
        """EPLB: rank 0 plans each layer's placement from the window's rows and broadcasts it with
        its decision; every rank moves its experts. The window starts over."""
        assert self.eplb is not None
        num_slots = self.expert_rows.shape[1] + self.eplb.num_redundant
        plan = torch.zeros(1 + len(self.blocks) * num_slots, dtype=torch.int64)
        if self.parallel.tp_rank == 0 and self.balancedness(self._window_rank_rows) < self.eplb.min_balancedness:
            plan[0] = 1
            plan[1:] = torch.tensor([e for load in self._window_expert_rows.tolist()
                                     for e in rebalance([float(n) for n in load], self.eplb.num_redundant,
                                                        self.parallel.ep_size).physical_to_logical])
        self.parallel.broadcast(plan, 0)
        self._window_expert_rows.zero_()
        self._window_rank_rows.zero_()
        if not plan[0]:
            return
        for block, slots in zip(self.blocks, plan[1:].view(len(self.blocks), num_slots).tolist()):
            block.experts.apply_placement(ExpertPlacement(tuple(slots), self.expert_rows.shape[1],
                                                          self.parallel.ep_size))
        self.num_rebalances += 1

    def totals(self) -> dict[str, Any]:
        """The routing since start, for engine stats and /metrics."""
        return {"layers": self.layer_ids, "expert_rows": self.expert_rows.tolist(),
                "ep_rank_rows": self.rank_rows.tolist() if self.parallel.ep_size > 1 else None,
                "balancedness": self.balancedness(self.rank_rows) if self.parallel.ep_size > 1 else None,
                "eplb_rebalances": self.num_rebalances, "num_passes": self.num_passes}

    def placements(self) -> list[tuple[int, ...]]:
        """Each EP layer's slot -> logical expert (for the dump and tests)."""
        return [block.experts.placement.physical_to_logical for block in self.blocks
                if isinstance(block.experts, ExpertParallelMoE)]


def build_expert_load(model: torch.nn.Module, parallel: ParallelContext, config: Any) -> ExpertLoad | None:
    """The model's ExpertLoad where a flag asks for one (--enable-eplb, a recorder mode,
    --enable-expert-distribution-metrics); None otherwise. ValueError naming the flag when the
    model has no MoE layer for it (or, with --ep-size > 1, for expert parallelism itself)."""
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
    if wanted and not blocks:
        raise ValueError(f"{', '.join(wanted)}: {type(model).__name__} has no mixture-of-experts layer")
    if 1 < parallel.ep_size < parallel.tp_size and wanted != ["--ep-size"]:
        raise ValueError(f"{', '.join(wanted)} with --ep-size smaller than --tp-size is not built yet "
                         "(issue 33): the counts per expert-parallel rank assume whole experts per rank")
    if wanted and parallel.pp_size > 1 and wanted != ["--ep-size"]:
        raise ValueError(f"{', '.join(wanted)} with --pp-size > 1 is not built yet (issue 33): the "
                         "engine process holds the last stage's MoE layers only")
    if wanted in ([], ["--ep-size"]):
        return None
    mode = observability.expert_distribution_recorder_mode
    recorder = (ExpertRecorder(mode, observability.expert_distribution_recorder_buffer_size)
                if mode is not None else None)
    eplb = (EplbSettings(eplb_flags.eplb_rebalance_num_iterations,
                         eplb_flags.eplb_min_rebalancing_utilization_threshold,
                         eplb_flags.ep_num_redundant_experts) if eplb_flags.enable_eplb else None)
    return ExpertLoad(blocks, parallel, recorder, eplb)
