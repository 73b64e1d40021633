"""Typed engine configuration: one frozen dataclass per concern, combined into EngineConfig.

Invariants:
- Every field carries ``metadata["help"]`` (unit and why the default) and is the single source of
  the command-line option of the same name (``servelm.cli`` generates the parser from these
  fields; aliases from the seed documents map onto them there).
- ``__post_init__`` validates and raises ValueError naming the offending flag. Nothing rewrites a
  config after construction; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with CLI metadata: ``help`` text and optional ``choices``/``flags``."""
    metadata = {"help": help, **extra}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: weights, tokenizer, dtype and context."""

    model: str = opt(
        DEFAULT_MODEL,
        "Model to serve: a local Hugging Face directory, a .gguf file, a packaged short name "
        "(qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m, gemma3-270m) or a hub id.",
    )
    tokenizer: str | None = opt(None, "Tokenizer directory or .gguf file; defaults to the model's.")
    tokenizer_mode: str = opt("auto", "auto: fast tokenizer when available; slow: always the slow one.",
                              choices=["auto", "slow"])
    skip_tokenizer_init: bool = opt(False, "Load no tokenizer: requests give input_ids and get token ids back.")
    load_format: str = opt("auto", "Weight format: auto detects safetensors/pt/gguf; dummy makes random weights.",
                           choices=["auto", "safetensors", "pt", "gguf", "dummy"])
    dtype: str = opt("auto", "Weight and activation dtype. auto: float32 on CPU (fast, exact), the "
                     "checkpoint's dtype on CUDA.",
                     choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    context_length: int | None = opt(None, "Maximum context in tokens; defaults to the model config's.")
    hf_overrides: str | None = opt(None, "JSON object merged into the model's config.json fields.")
    served_model_name: str | None = opt(None, "Model name reported by /v1/models and accepted in requests.")
    revision: str | None = opt(None, "Hub revision (branch, tag or commit) for hub ids.")
    download_dir: str | None = opt(None, "Where hub downloads would be cached.")
    trust_remote_code: bool = opt(False, "Allow custom model code from the checkpoint (not supported: our "
                                  "own modules run every architecture).")
    seed: int = opt(0, "Seed for random weights (dummy) and for requests that give no seed.")
    device: str = opt("auto", "Device to run on: auto picks cuda when present, else cpu.",
                      choices=["auto", "cpu", "cuda"])

    def __post_init__(self) -> None:
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError(f"--context-length must be positive, got {self.context_length}")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("--skip-tokenizer-init and --tokenizer-path cannot be combined")
        if self.hf_overrides is not None:
            try:
                overrides = json.loads(self.hf_overrides)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--hf-overrides is not valid JSON: {exc}") from None
            if not isinstance(overrides, dict):
                raise ValueError(f"--hf-overrides must be a JSON object, got {self.hf_overrides!r}")

    @property
    def name(self) -> str:
        """The name clients use for this model."""
        return self.served_model_name or self.model


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: page size and how much memory it takes."""

    page_size: int = opt(16, "Tokens per KV block. 16 keeps internal fragmentation under one block per "
                         "request while keeping block tables short.")
    mem_fraction_static: float = opt(0.3, "Fraction of free memory (RAM on CPU, device memory on CUDA) "
                                     "after weights given to the KV pool. 0.3 on a shared CPU host leaves "
                                     "room for activations and other processes.")
    max_total_tokens: int | None = opt(None, "KV pool size in tokens; overrides --mem-fraction-static.")
    kv_cache_dtype: str = opt("auto", "KV cache dtype; auto uses the model dtype.",
                              choices=["auto", "float32", "bfloat16", "float16"])

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be at least one page ({self.page_size}), "
                             f"got {self.max_total_tokens}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_running_requests: int = opt(64, "Most requests decoding at once; bounds batch size and latency.")
    chunked_prefill_size: int = opt(512, "Most prompt tokens of one request computed in one step; -1 "
                                    "disables chunking. 512 keeps a step short on CPU so decodes stream.")
    max_prefill_tokens: int = opt(4096, "Most tokens (prefill and decode together) computed in one step.")
    stream_interval: int = opt(1, "Send streamed output every N tokens.")

    def __post_init__(self) -> None:
        if self.max_running_requests <= 0:
            raise ValueError(f"--max-running-requests must be positive, got {self.max_running_requests}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"--chunked-prefill-size must be positive or -1, got {self.chunked_prefill_size}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"--max-prefill-tokens must be positive, got {self.max_prefill_tokens}")
        if self.stream_interval <= 0:
            raise ValueError(f"--stream-interval must be positive, got {self.stream_interval}")

    @property
    def max_tokens_per_step(self) -> int:
        """Token budget of one engine step."""
        return self.max_prefill_tokens

    @property
    def max_chunk_tokens(self) -> int | None:
        """Most prompt tokens of one request in one step, or None when chunking is off."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size


@dataclass(frozen=True)
class ParallelConfig:
    """Parallelism degrees. Only 1 is supported today; layers are written column/row-parallel."""

    tensor_parallel_size: int = opt(1, "Tensor-parallel degree (GPUs per model replica).")
    pipeline_parallel_size: int = opt(1, "Pipeline-parallel degree.")
    data_parallel_size: int = opt(1, "Data-parallel replicas.")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value != 1:
                raise ValueError(f"{_flag(name)}={value}: only 1 is supported in this build "
                                 "(a single process runs the whole model)")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP front end."""

    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(30000, "Port to listen on.")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on every endpoint but health.")
    chat_template: str | None = opt(None, "Chat template: a Jinja file path or an inline template.")
    allow_auto_truncate: bool = opt(False, "Truncate prompts longer than the context (keep the end) instead of 400.")
    log_level: str = opt("info", "Log level for servelm.", choices=["debug", "info", "warning", "error"])

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine and server need, one frozen dataclass per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @staticmethod
    def sections() -> dict[str, type]:
        """Section name -> dataclass type, in CLI order."""
        return {f.name: f.type if isinstance(f.type, type) else _SECTION_TYPES[f.name]
                for f in dataclasses.fields(EngineConfig)}

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from a flat {field_name: value} mapping; unknown names raise ValueError."""
        remaining = dict(values)
        sections: dict[str, Any] = {}
        for section_name, section_type in cls.sections().items():
            names = {f.name for f in dataclasses.fields(section_type)}
            kwargs = {k: remaining.pop(k) for k in list(remaining) if k in names}
            sections[section_name] = section_type(**kwargs)
        if remaining:
            raise ValueError(f"unknown engine options: {sorted(remaining)}")
        return cls(**sections)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
}
