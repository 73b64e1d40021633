"""servelm: an LLM inference and serving engine with an OpenAI-compatible API.

Public Python API: ``Engine`` (offline batches) and ``SamplingParams``.

``Engine`` and ``GenerationResult`` are imported on first use (PEP 562): ``servelm serve`` imports
this package first, and torch, which the engine needs, would otherwise cost every server start
seconds before it can start its engine process (servelm.engine.launch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servelm.sampling.params import BeamParams, SamplingParams

if TYPE_CHECKING:
    from servelm.engine.offline import Engine, GenerationResult

__version__ = "0.1.0"
__all__ = ["BeamParams", "Engine", "GenerationResult", "SamplingParams", "__version__"]

_OFFLINE_NAMES = ("Engine", "GenerationResult")


def __getattr__(name: str) -> Any:
    if name in _OFFLINE_NAMES:
        from servelm.engine import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'servelm' has no attribute {name!r}")
