"""The front door: the messages between the front end (AsyncEngine) and an engine process, the
model description the engine reports once, and the engine-client protocol the server codes against.

Transport (async_engine.py, engine_process.py): the front end PUSHes front-end messages to each
engine process and PULLs engine messages back, each pickled whole. Requests and their outputs
never travel any other way.

Invariants:
- An engine process's first message is ``EngineReady`` or ``EngineFailed``; the front end refuses
  an engine whose ``protocol_version`` differs from its own (a mismatched install is a clear error).
- Every request enters through one ``SubmitRequest``: generation and embedding share it (``params``
  None is an embedding), so admission, load balancing, crash records and aborts are one path.
- Every ``*Call`` carries a call id and is answered by exactly one ``CallResult`` with that id,
  between two engine steps.
- Bump ``PROTOCOL_VERSION`` whenever a message changes shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from servelm.disagg.spec import KVTransfer
from servelm.engine.outputs import RequestOutput
from servelm.multimodal.inputs import MultimodalInputs
from servelm.sampling.params import SamplingParams

PROTOCOL_VERSION = 2
"""2: SubmitRequest.mm_inputs (images)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about its model once it has loaded it (read by the server).

    Fields that only some set-ups have are None elsewhere (``embedding_size`` without an
    embedding model). The adapters loaded now change at run time, so they are not here
    (``EngineClient.lora_adapters``)."""

    context_length: int
    """Longest prompt + output, in tokens."""
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    """Token ids a request may use are [0, vocab_size); None: not reported (no check)."""
    task: str = "generate"
    """generate or embed (servelm.model.pooling.resolve_task): requests of the other are refused."""
    model_path: str | None = None
    served_model_name: str | None = None
    architecture: str | None = None
    description: str | None = None
    device: str | None = None
    dtype: str | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    kv_pool_tokens: int | None = None
    """Tokens the KV pool holds; a request that can never fit is refused (400). None: no check."""
    kv_cache_bytes: int | None = None
    load_time_s: float | None = None
    parallel: dict[str, Any] | None = None
    """The parallel layout (tp, pp, ranks, executor), as /get_server_info shows it."""
    data_parallel_size: int | None = None
    """Engine replicas behind the front end (--dp-size); None: one."""
    lora: dict[str, Any] | None = None
    """LoRA limits (max_loras_per_batch, max_lora_rank); None without --enable-lora."""
    embedding_size: int | None = None
    pooler: dict[str, Any] | None = None
    max_embedding_tokens: int | None = None
    takes_images: bool | None = None
    """The model takes images (a vision-language model: /props' ``modalities.vision``); None: not
    reported (an engine built around a test runner)."""
    disaggregation: dict[str, Any] = field(default_factory=dict)
    """The prefill/decode role's description (disaggregation_mode, ...); empty when co-located."""

    @property
    def is_generation(self) -> bool:
        return self.task == "generate"

    @classmethod
    def from_engine(cls, info: dict[str, Any]) -> ModelInfo:
        """From LLMEngine.model_info (the engine's own record; ``lora_adapters`` stays there)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in info.items() if key in names}
        values["eos_token_ids"] = tuple(info.get("eos_token_ids") or ())
        values["disaggregation"] = {key: value for key, value in info.items()
                                    if key.startswith("disaggregation_")}
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The flat description /get_model_info answers with (the shape SGLang's clients read)."""
        result = {key: value for key, value in dataclasses.asdict(self).items()
                  if value is not None and key != "disaggregation"}
        result["eos_token_ids"] = list(self.eos_token_ids)
        result["is_generation"] = self.is_generation
        result.update(self.disaggregation)
        return result


# -- front end -> engine ----------------------------------------------------------------------

@dataclass(frozen=True)
class SubmitRequest:
    """Add one request: a generation (``params``) or an embedding (``params`` None)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None
    priority: int = 0
    group: str = ""
    """The client request this one is part of (see Request.group); "" alone."""
    lora_name: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    kv_transfer: KVTransfer | None = None
    """Its part in a prefill/decode transfer (None: co-located)."""
    mm_inputs: MultimodalInputs | None = None
    """Its images (a vision-language model): the processor's spans over ``prompt_token_ids``,
    which are the expanded ids (``mm_inputs.prompt_token_ids``). None: text only."""

    @property
    def is_embedding(self) -> bool:
        return self.params is None

    @property
    def load_tokens(self) -> int:
        """What the balancer counts for it: prompt tokens plus the most it may generate."""
        budget = self.params.max_tokens if self.params is not None else 0
        return len(self.prompt_token_ids) + (budget or 0)


@dataclass(frozen=True)
class AbortRequest:
    """End a request early and free its KV (its consumer left)."""

    request_id: str


@dataclass(frozen=True)
class StatsCall:
    """Answer with the engine's live figures (LLMEngine.stats)."""

    call_id: int


@dataclass(frozen=True)
class FlushCacheCall:
    """Empty the prefix cache: {"success", "message"} (refused while requests run)."""

    call_id: int


@dataclass(frozen=True)
class LoadLoRACall:
    """Load an adapter: {"success", "status", "message", "load_time_s"}."""

    call_id: int
    name: str
    path: str


@dataclass(frozen=True)
class UnloadLoRACall:
    """Unload an adapter: {"success", "status", "message"}."""

    call_id: int
    name: str


@dataclass(frozen=True)
class ExpertDistributionCall:
    """The expert distribution recorder: ``action`` start, stop or dump (LLMEngine.expert_distribution)."""

    call_id: int
    action: str


@dataclass(frozen=True)
class Shutdown:
    """Stop stepping and exit."""


EngineCall = StatsCall | FlushCacheCall | LoadLoRACall | UnloadLoRACall | ExpertDistributionCall
FrontMessage = SubmitRequest | AbortRequest | EngineCall | Shutdown


# -- engine -> front end ----------------------------------------------------------------------

@dataclass(frozen=True)
class EngineReady:
    """The model is loaded and warmed up; requests may come."""

    model_info: ModelInfo
    lora_adapters: tuple[dict[str, Any], ...] = ()
    """The adapters loaded at start (--lora-paths)."""
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class EngineFailed:
    """Start-up failed; ``reason`` is for the user."""

    reason: str


@dataclass(frozen=True)
class StepOutputs:
    """The outputs of one engine step (or a request refused or aborted between steps)."""

    outputs: list[RequestOutput]


@dataclass(frozen=True)
class CallResult:
    """The answer to the call with ``call_id``."""

    call_id: int
    result: dict[str, Any]


EngineMessage = EngineReady | EngineFailed | StepOutputs | CallResult


# -- what the server codes against --------------------------------------------------------------

class EngineClient(Protocol):
    """The engine as the HTTP server sees it: AsyncEngine implements it (tests use fakes)."""

    @property
    def tokenizer(self) -> Any:
        """The front end's tokenizer (None with --skip-tokenizer-init)."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapters requests may name now ({"name", "path", ...})."""

    @property
    def is_alive(self) -> bool:
        """False once the engine process died (health checks then answer 503)."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, group: str = "", lora_name: str | None = None,
                 kv_transfer: KVTransfer | None = None,
                 mm_inputs: MultimodalInputs | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request."""

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        """Embed one input: its finished output (``embedding`` or ``error``)."""

    async def abort(self, request_id: str) -> None: ...

    async def get_server_info(self) -> dict[str, Any]: ...

    async def flush_cache(self) -> dict[str, Any]: ...

    async def expert_distribution(self, action: str) -> dict[str, Any]: ...

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]: ...

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]: ...

    async def health_generate(self) -> bool: ...

    async def shutdown(self) -> None: ...
