"""servelm: an LLM inference and serving engine with an OpenAI-compatible API.

Public Python API: ``Engine`` (offline batches) and ``SamplingParams``.
"""

from servelm.engine.offline import Engine, GenerationResult
from servelm.sampling.params import BeamParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["BeamParams", "Engine", "GenerationResult", "SamplingParams", "__version__"]
