"""--debug-tensor-dump-output-folder: every forward pass's intermediate tensors, for debugging a
model against a reference (transformers) one layer at a time.

Each forward pass of a rank writes ``<folder>/rank<r>/pass<NNNNN>.pt``, a dict of CPU tensors:
``input_ids`` and ``positions`` of the batch, the output of each module down to a decoder layer's
direct parts (``model.embed_tokens``, ``model.layers.<i>``, ``model.layers.<i>.self_attn``,
``model.layers.<i>.mlp``, ``model.norm``, ...), and the pass's float32 ``logits``. While dumping,
decoder layers run module by module (the flat decode path is off), so every pass has every layer.
It is slow and writes a lot: for debugging only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MAX_DEPTH = 4
"""Dumped module names have at most this many dotted parts (model.layers.0.mlp)."""


class _NoFlatPlan:
    """Stands in for a model's flat decode plan: never applies, so layers run one by one."""

    def applies(self, hidden: torch.Tensor, batch: Any) -> bool:
        return False


class TensorDumper:
    def __init__(self, folder: str, model: nn.Module, rank: int = 0) -> None:
        self.folder = Path(folder) / f"rank{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_passes = 0
        self._tensors: dict[str, torch.Tensor] | None = None
        self.names: list[str] = []
        for name, module in model.named_modules():
            if "held_layers" in module.__dict__ or hasattr(module, "held_layers"):
                module.__dict__["decode_plan"] = _NoFlatPlan()
            if not name or name.count(".") >= MAX_DEPTH or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                continue
            module.register_forward_hook(self._hook(name))
            self.names.append(name)
        logger.warning("dumping every forward pass's tensors to %s (--debug-tensor-dump-output-folder)",
                       self.folder)

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self._tensors is None:
                return
            if isinstance(output, tuple):
                output = next((item for item in output if isinstance(item, torch.Tensor)), None)
            if isinstance(output, torch.Tensor):
                self._tensors[name] = output.detach().to("cpu", copy=True)
        return hook

    def begin(self, batch: Any) -> None:
        self._tensors = {"input_ids": batch.input_ids.detach().cpu().clone(),
                         "positions": batch.positions.detach().cpu().clone()}

    def end(self, logits: torch.Tensor) -> None:
        if self._tensors is None:
            return
        self._tensors["logits"] = logits.detach().float().cpu().clone()
        torch.save(self._tensors, self.folder / f"pass{self.num_passes:05d}.pt")
        self.num_passes += 1
        self._tensors = None
