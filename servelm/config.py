"""Typed engine configuration: one frozen dataclass per concern, combined into EngineConfig.

Invariants:
- Every field carries ``metadata["help"]`` (unit and why the default) and is the single source of
  the command-line option of the same name (``servelm.cli_args`` generates the parser from these
  fields; aliases from the seed documents map onto them there).
- ``__post_init__`` validates and raises ValueError naming the offending flag. Nothing rewrites a
  config after construction; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


PREQUANTIZED_FLAG_VALUES = ("gptq", "awq", "fp8", "fbgemm_fp8", "compressed-tensors", "bitsandbytes", "gptq_marlin",
                            "awq_marlin")
"""``--quantization`` values naming a pre-quantized checkpoint's format (servelm/model/prequantized.py)."""

REFUSED_QUANTIZATION = {
    "hqq": "HQQ checkpoints are not supported",
    "modelopt": "NVIDIA ModelOpt checkpoints are not supported",
    "modelopt_fp4": "NVIDIA ModelOpt FP4 checkpoints are not supported (no FP4 path on CPU)",
    "gptq_marlin_24": "2:4 sparse GPTQ (Marlin 24) is a CUDA-only sparse format",
    "gptq_bitblas": "BitBLAS is a CUDA kernel; serve the GPTQ checkpoint with --quantization gptq",
    "bitblas": "BitBLAS is a CUDA kernel; serve the GPTQ checkpoint with --quantization gptq",
    "deepspeedfp": "DeepSpeed FP6/FP8 checkpoints are not supported",
    "mxfp4": "MXFP4 checkpoints are not supported (no FP4 path on CPU)",
    "ptpc_fp8": "ptpc_fp8 quantizes to FP8 at load on ROCm; this CPU path has no FP8 GEMM",
    "quark": "AMD Quark checkpoints are not supported",
    "auto-round": "AutoRound checkpoints are not supported",
    "moe_wna16": "moe_wna16 is a CUDA MoE kernel; a GPTQ/AWQ MoE checkpoint loads with --quantization gptq/awq",
    "torchao": "torchao checkpoints are not supported; --quantization int8wo / int4wo-<group> quantize at load",
    "inc": "Intel Neural Compressor checkpoints are not supported",
    "w8a8_fp8": "FP8 quantization at load needs an FP8 GEMM, which this CPU path lacks; use w8a8_int8",
}
"""Other engines' ``--quantization`` values servelm refuses at start-up, with the reason."""


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with CLI metadata: ``help`` text and optional ``choices``/``flags``."""
    metadata = {"help": help, **extra}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_json_object_flag(flag: str, text: str | None) -> dict[str, Any]:
    """A flag whose value is a JSON object (``--hf-overrides``, ``--override-pooler-config``):
    the dict, ``{}`` when unset; ValueError naming the flag when it is not a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


POOLING_TYPES = ("last", "mean", "cls")
"""How an embedding model turns hidden states into one vector (servelm.model.pooling)."""
_POOLER_OVERRIDE_KEYS = ("pooling_type", "normalize", "is_matryoshka", "matryoshka_dimensions")


def is_chat_template_value(value: str) -> bool:
    """--chat-template names a template file, or is the template text itself (it has Jinja tags)."""
    import os

    return os.path.isfile(value) or "{{" in value or "{%" in value


def parse_pooler_override(text: str | None) -> dict[str, Any]:
    """``--override-pooler-config`` JSON -> checked dict (ValueError naming the flag and key)."""
    values = parse_json_object_flag("--override-pooler-config", text)
    for key, value in values.items():
        if key not in _POOLER_OVERRIDE_KEYS:
            raise ValueError(f"--override-pooler-config: {key!r} is not supported (supported: "
                             f"{', '.join(_POOLER_OVERRIDE_KEYS)})")
        if key == "pooling_type":
            if not isinstance(value, str) or value.lower() not in POOLING_TYPES:
                raise ValueError(f"--override-pooler-config: pooling_type {value!r} is not "
                                 f"supported; choose from {', '.join(POOLING_TYPES)}")
            values[key] = value.lower()
        elif key in ("normalize", "is_matryoshka") and not isinstance(value, bool):
            raise ValueError(f"--override-pooler-config: {key} must be true or false, got {value!r}")
        elif key == "matryoshka_dimensions" and not (
                isinstance(value, list) and value and all(isinstance(d, int) and d > 0 for d in value)):
            raise ValueError("--override-pooler-config: matryoshka_dimensions must be a list of "
                             f"positive integers, got {value!r}")
    return values



@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: weights, tokenizer, dtype and context."""

    model: str = opt(
        DEFAULT_MODEL,
        "Model to serve: a local Hugging Face directory, a .gguf file, a packaged short name "
        "(qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m, gemma3-270m; all-minilm-l6-v2 "
        "for embeddings) or a hub id.",
    )
    tokenizer: str | None = opt(None, "Tokenizer directory or .gguf file; defaults to the model's.")
    tokenizer_mode: str = opt("auto", "auto: fast tokenizer when available; slow: always the slow one.",
                              choices=["auto", "slow"])
    skip_tokenizer_init: bool = opt(False, "Load no tokenizer: requests give input_ids and get token ids back.")
    load_format: str = opt("auto", "Weight format: auto detects safetensors/pt/gguf; dummy makes random weights; "
                           "bitsandbytes: a bitsandbytes checkpoint (int8, nf4/fp4; auto detects it too).",
                           choices=["auto", "safetensors", "pt", "gguf", "dummy", "bitsandbytes"])
    dtype: str = opt("auto", "Weight and activation dtype. auto: float32 on CPU (fast, exact), the "
                     "checkpoint's dtype on CUDA.",
                     choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    residual_dtype: str = opt(
        "auto", "Dtype of a decoder's residual stream (the hidden state carried from layer to layer) when "
        "--dtype is bfloat16 or float16. float32: each layer's update is added to a float32 sum instead of "
        "being rounded to 16 bits (llama.cpp keeps float32 activations too); matmul inputs and the KV cache "
        "stay in --dtype. model: --dtype, as Hugging Face runs the model. auto: float32 on CPU (Gemma 3 "
        "270M's greedy outputs identical to the float32 model's: 72 -> 81 percent of 96 prompts, at no "
        "measurable cost; benchmarks/RESULTS.md), --dtype on CUDA.",
        choices=["auto", "float32", "model"])
    enable_fp32_lm_head: bool = opt(
        False, "Compute the LM head (hidden state x vocabulary) in float32 when the model runs in "
        "bfloat16 or float16 (--dtype, or auto on a CPU with a native bf16 GEMM): a float32 copy of "
        "the head's weight is kept beside the model's (4 bytes per vocabulary row entry). A float32 "
        "model's head is float32 already. Not with a quantized head (--quantization).")
    disable_mla: bool = opt(
        False, "Run DeepSeek-V2/V3's multi-head latent attention with per-head K and V expanded from the "
        "latent and cached as such, as transformers computes it, instead of caching the compressed latent "
        "(kv_lora_rank + qk_rope_head_dim values per token and layer) and attending to it directly. Same "
        "outputs; the pool takes 2 num_heads (qk_head_dim + v_head_dim) / (kv_lora_rank + qk_rope_head_dim) "
        "times more bytes per token. Only for models with latent attention.")
    context_length: int | None = opt(None, "Maximum context in tokens; defaults to the model config's.")
    hf_overrides: str | None = opt(None, "JSON object merged into the model's config.json fields.")
    served_model_name: list[str] | None = opt(
        None, "Names clients use for the model: responses carry the first, requests may give any, "
        "and /v1/models lists them all. Unset: the --model value.")
    revision: str | None = opt(None, "Hub revision (branch, tag or commit) for hub ids.")
    download_dir: str | None = opt(None, "Where hub downloads would be cached.")
    seed: int = opt(0, "Seed for random weights (dummy), the random schedule policy, and sampling: a "
                    "request that gives no seed samples from a generator derived from this seed and "
                    "its arrival order, so a server restarted with the same seed and sent the same "
                    "requests in the same order returns the same text.")
    device: str = opt("auto", "Device to run on: auto picks cuda when present, else cpu.",
                      choices=["auto", "cpu", "cuda"])
    quantization: str = opt("auto", "Weight quantization. auto: gguf for a GGUF file (on CPU, --tp-size 1, "
                            "--dtype auto), else none. gguf: serve the GGUF file's own quantized blocks (Q8_0, Q4_0/1, "
                            "Q5_0/1, Q4_K, Q5_K, Q6_K repacked losslessly to int8 codes with per-block "
                            "scales; an AVX512-VNNI kernel with activations rounded to 16 bits per 32 inputs, "
                            "i.e. the dequantized weights' results to 4-5 digits). gguf_a8: the same blocks with activations rounded to int8 per 32 "
                            "inputs as llama.cpp does (VNNI; faster at batch 1, a little less exact). "
                            "Requantization applied after loading: w8a8_int8: int8 weights "
                            "per output channel and int8 activations quantized at run time, for every "
                            "linear layer and the LM head (about 4x less weight traffic; about 2 percent relative "
                            "error per layer). int8wo: int8 weights per output channel, float activations, "
                            "for the linears, the LM head and the embedding. int4wo-<group>: 4-bit weights "
                            "with a scale and zero per group of inputs (8x less weight memory than float32; "
                            "smaller groups are more accurate). none: the model dtype (a GGUF file dequantized). "
                            "A pre-quantized checkpoint (config.json quantization_config: gptq, awq, fp8, "
                            "fbgemm_fp8, compressed-tensors, bitsandbytes) is detected under auto; naming its format "
                            "(gptq_marlin/awq_marlin: the same formats) must agree with the checkpoint. Its "
                            "weights are dequantized exactly at load; GPTQ/AWQ/compressed-tensors integer codes "
                            "then run on the GGUF block kernels (--tp-size 1, --dtype auto). experts_int8: int8wo on "
                            "the routed experts of a mixture-of-experts model only (the rest as loaded).",
                            choices=["auto", "none", "gguf", "gguf_a8", "w8a8_int8", "int8wo", "int4wo-32", "int4wo-64", "int4wo-128",
                                     "int4wo-256", "experts_int8", *PREQUANTIZED_FLAG_VALUES, *REFUSED_QUANTIZATION])
    task: str = opt(
        "auto", "What the model serves: generate (completions and chat) or embed (/v1/embeddings: "
        "one pooled vector per input). auto: embed for encoder-only models (BERT), generate for "
        "the others. embedding is vLLM's older name for embed; classify, score and reward are "
        "not supported.",
        choices=["auto", "generate", "embed", "embedding", "classify", "score", "reward"])
    override_pooler_config: str | None = opt(
        None, "JSON object overriding how an embedding model pools its hidden states: pooling_type "
        "(last, mean or cls), normalize (L2, true or false), is_matryoshka / matryoshka_dimensions "
        "(which smaller `dimensions` requests may ask for). Unset: the sentence-transformers "
        "config when the model has one, else mean for encoders and last for decoders, normalized.")

    def __post_init__(self) -> None:
        if self.task in ("classify", "score", "reward"):
            raise ValueError(f"--task {self.task} is not supported: servelm serves generate and "
                             "embed models only")
        if self.override_pooler_config is not None:
            parse_pooler_override(self.override_pooler_config)
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError(f"--context-length must be positive, got {self.context_length}")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("--skip-tokenizer-init and --tokenizer-path cannot be combined")
        parse_json_object_flag("--hf-overrides", self.hf_overrides)
        if self.served_model_name is not None and (
                isinstance(self.served_model_name, str) or not self.served_model_name
                or not all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ValueError("--served-model-name takes one or more non-empty names, got "
                             f"{self.served_model_name!r}")

    @property
    def name(self) -> str:
        """The name responses carry: the first --served-model-name, else --model."""
        return self.served_names[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name requests may give (and /v1/models lists), the response name first."""
        return tuple(self.served_model_name) if self.served_model_name else (self.model,)

    @property
    def is_embed_task(self) -> bool:
        """--task names embeddings (embed, or vLLM's older spelling embedding). auto is decided
        per model at load (servelm.model.pooling.resolve_task), so it is not one here."""
        return self.task in ("embed", "embedding")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: page size and how much memory it takes."""

    page_size: int = opt(16, "Tokens per KV block. 16 keeps internal fragmentation under one block per "
                         "request while keeping block tables short.")
    mem_fraction_static: float = opt(0.3, "Fraction of free memory (RAM on CPU, device memory on CUDA) "
                                     "after weights given to the KV pool. 0.3 on a shared CPU host leaves "
                                     "room for activations and other processes.")
    max_total_tokens: int | None = opt(None, "KV pool size in tokens; overrides --mem-fraction-static.")
    kv_cache_dtype: str = opt("auto", "KV cache dtype; auto uses the model dtype. fp8_e5m2 and fp8_e4m3 "
                              "(fp8 is vLLM's name for fp8_e4m3) store one byte per element (4x the tokens of float32 in the "
                              "same memory; "
                              "attention computes in the model dtype).",
                              choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e5m2", "fp8_e4m3"])
    disable_radix_cache: bool = opt(False, "Turn the prefix cache off. On by default: requests that "
                                    "share a prompt prefix (system prompts, chat turns, n>1) reuse its "
                                    "KV blocks instead of recomputing them.")
    radix_eviction_policy: str = opt("lru", "Which free cached blocks go first when the pool needs "
                                     "room: lru (least recently used) or lfu (least often hit).",
                                     choices=["lru", "lfu"])

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be at least one page ({self.page_size}), "
                             f"got {self.max_total_tokens}")


HICACHE_EXTERNAL_BACKENDS = ("mooncake", "hf3fs", "nixl", "aibrix", "eic", "dynamic", "lmcache")
_HICACHE_EXTRA_KEYS = ("file_path", "max_size_gb", "prefetch_timeout_s")
HICACHE_DEFAULT_DIR = "~/.cache/servelm/hicache"


@dataclass(frozen=True)
class HiCacheConfig:
    """The hierarchical KV cache (servelm.cache.hicache): a host tier and a file storage tier
    below the device pool, fed by evictions and pulled up by prefix matches."""

    enable_hierarchical_cache: bool = opt(
        False, "Keep blocks evicted from the KV pool in a host tier (and, with "
        "--hicache-storage-backend file, on disk) and bring them back on a prefix match instead "
        "of recomputing them. Off by default: it costs host memory and copies.")
    hicache_ratio: float = opt(
        2.0, "Host tier size as a multiple of the KV pool's blocks (SGLang's default 2: the tier "
        "pays when it holds more than the pool).")
    hicache_size: int = opt(
        0, "Host tier size in GB; overrides --hicache-ratio when > 0 (0: use the ratio).")
    hicache_write_policy: str = opt(
        "write_through", "When blocks are copied down: write_through (as soon as they are cached: "
        "a restart finds them on disk), write_through_selective (once matched twice) or "
        "write_back (only when the pool evicts them). Eviction always demotes to the host tier.",
        choices=["write_through", "write_through_selective", "write_back"])
    hicache_io_backend: str = opt(
        "direct", "How blocks are copied between tiers: direct (plain tensor copies; on CPU the "
        "pool already is host memory). SGLang's kernel backend is CUDA-only and not built.")
    hicache_mem_layout: str = opt(
        "layer_first", "Host tier layout: layer_first (like the device pool) or page_first (one "
        "block contiguous).", choices=["layer_first", "page_first", "page_first_direct"])
    hicache_host_dtype: str = opt(
        "auto", "Host tier storage: auto (the pool's own dtype: exact, so outputs equal the ones "
        "recomputing gives; the default because a cache should not change answers) or int8 (one "
        "byte per value with per-block, per-head scales: 4x the blocks of float32 in the same "
        "memory, values off by at most half a quantization step, so greedy outputs may differ "
        "after a host-tier hit; see benchmarks/RESULTS.md).",
        choices=["auto", "int8"])
    hicache_storage_backend: str | None = opt(
        None, "Storage tier below the host tier: file (one file per block, kept across restarts, "
        "validated against the model and settings that wrote it). Unset: no storage tier. "
        "SGLang's other backends need services servelm does not ship and are refused.",
        choices=["file", *HICACHE_EXTERNAL_BACKENDS])
    hicache_storage_prefetch_policy: str = opt(
        "best_effort", "When a request whose blocks are on disk is admitted: best_effort (now, "
        "with what the background reads have brought in), wait_complete (once its reads are done; "
        "other requests run meanwhile) or timeout (when done or after prefetch_timeout_s).",
        choices=["best_effort", "wait_complete", "timeout"])
    hicache_storage_backend_extra_config: str | None = opt(
        None, "JSON object for the storage backend: file_path (directory; default "
        f"{HICACHE_DEFAULT_DIR}, or SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR when set), max_size_gb "
        "(disk limit, least recently used files deleted first; default 16), prefetch_timeout_s "
        "(the timeout policy's wait; default 2).")

    def __post_init__(self) -> None:
        if not self.enable_hierarchical_cache:
            changed = [f.name for f in dataclasses.fields(self)
                       if f.name != "enable_hierarchical_cache"
                       and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{_flag(changed[0])} needs --enable-hierarchical-cache")
            return
        if self.hicache_ratio <= 0:
            raise ValueError(f"--hicache-ratio must be positive, got {self.hicache_ratio}")
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0 GB, got {self.hicache_size}")
        if self.hicache_io_backend != "direct":
            raise ValueError(f"--hicache-io-backend {self.hicache_io_backend}: only direct (plain "
                             "tensor copies) is built; SGLang's kernel backends are CUDA kernels")
        if self.hicache_mem_layout not in ("layer_first", "page_first"):
            raise ValueError(f"--hicache-mem-layout {self.hicache_mem_layout}: choose layer_first "
                             "or page_first (page_first_direct needs SGLang's direct-IO kernels)")
        backend = self.hicache_storage_backend
        if backend is not None and backend != "file":
            reason = ("it needs an external service or library servelm does not ship"
                      if backend in HICACHE_EXTERNAL_BACKENDS else "unknown backend")
            raise ValueError(f"--hicache-storage-backend {backend}: {reason}; the built-in "
                             "backend is file")
        extra = self.storage_extra_config
        if extra and backend is None:
            raise ValueError("--hicache-storage-backend-extra-config needs --hicache-storage-backend")
        for key, value in extra.items():
            if key not in _HICACHE_EXTRA_KEYS:
                raise ValueError(f"--hicache-storage-backend-extra-config: {key!r} is not supported "
                                 f"(supported: {', '.join(_HICACHE_EXTRA_KEYS)})")
            if key == "file_path" and not (isinstance(value, str) and value):
                raise ValueError("--hicache-storage-backend-extra-config: file_path must be a "
                                 "directory path")
            if key != "file_path" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"--hicache-storage-backend-extra-config: {key} must be a "
                                 f"positive number, got {value!r}")

    @property
    def storage_extra_config(self) -> dict[str, Any]:
        return parse_json_object_flag("--hicache-storage-backend-extra-config",
                                      self.hicache_storage_backend_extra_config)


_DEFAULT_CHUNKED_PREFILL_SIZE = 512
"""--chunked-prefill-size's default (SchedulerConfig.is_lone_prompt_chunked)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_running_requests: int = opt(64, "Most requests decoding at once; bounds batch size and latency.")
    chunked_prefill_size: int = opt(
        _DEFAULT_CHUNKED_PREFILL_SIZE, "Most prompt tokens of one request computed in one step; -1 "
        "disables chunking. 512 keeps a step short on CPU so decodes stream; the default 512 is not "
        "applied to a request alone in the engine (no decode waits on it), any other size always is.")
    max_prefill_tokens: int = opt(4096, "Most tokens (prefill and decode together) computed in one step.")
    fair_step_tokens: int = opt(
        8, "While a heavy request (more than 512 prompt tokens left, a prompt-logprob token counting "
        "double and one deep in a long context more; or more than 4 sequences: n, beams, prompt "
        "lists) and a normal one both have work (and for 1 s after a normal one's last work, if the heavy "
        "one ran beside it, so the user's next request does not wait for a full heavy step), the heavy ones together compute at "
        "most this many tokens per step (prompt tokens and decode rows), in equal shares; fewer while "
        "such a shared step costs more than twice a step of the normal work alone (measured as it "
        "serves), down to 1 token per step with the heavy requests taking turns; normal "
        "requests are not bounded. Keeps a normal user's latency within a small multiple of its latency alone beside "
        "heavy requests (SmolLM2-135M on 2 CPU cores: benchmarks/RESULTS.md, issue 35). 0 turns it "
        "off (throughput first, for batch jobs; the offline Engine class defaults to 0).")
    stream_interval: int = opt(1, "Send streamed output every N tokens.")
    schedule_policy: str = opt(
        "fcfs", "Order of the waiting queue: fcfs (arrival), lpm (longest cached prefix first), "
        "dfs-weight (walk the prefix tree, heaviest branch first, so requests sharing a prefix run "
        "together) or random. fcfs by default: it never starves a request.",
        choices=["fcfs", "lpm", "dfs-weight", "random"])
    enable_priority_scheduling: bool = opt(
        False, "Order the waiting queue by each request's `priority` field first (then by "
        "--schedule-policy), and let a much more urgent request preempt a running one.")
    scheduling_policy: str = opt(
        "fcfs", "vLLM's switch: priority = priority scheduling with smaller `priority` values "
        "first (ties by arrival); fcfs = arrival order.", choices=["fcfs", "priority"])
    schedule_low_priority_values_first: bool = opt(
        False, "With priority scheduling, smaller `priority` values run first (vLLM's convention); "
        "by default larger values do.")
    priority_scheduling_preemption_threshold: int = opt(
        10, "With priority scheduling, a waiting request preempts a running one only when its "
        "priority is better by more than this, so near-equal priorities do not thrash.")
    schedule_conservativeness: float = opt(
        0.0, "Fraction of the running requests' remaining max_tokens kept free in the KV pool when "
        "admitting a new request. 0 (default) admits whenever the next chunk fits and relies on "
        "recompute preemption; 1 admits only what can finish without preemption.")
    router_token_ratio: float = opt(
        0.0, "KV pool usage (0-1) above which admission turns fully conservative (as "
        "--schedule-conservativeness 1); 0 turns the switch off.")
    router_max_wait_tokens: int = opt(
        0, "While requests are decoding, admit new ones only every N steps, so prompts are "
        "batched instead of interrupting decode each step; 0 admits at every step.")
    max_queued_requests: int | None = opt(
        None, "Most requests waiting for admission; beyond it new requests get 503. Unset: no limit.")
    router_max_new_token_len: int | None = opt(
        None, "With --router_token_ratio: the output length admission assumes for a request when "
        "reserving its future KV (the smaller of this and its max_tokens), so requests with large "
        "max_tokens are not held back for output they rarely produce (LightLLM's flag; it may "
        "cause preemptions). Unset: each request's max_tokens.",
        flags=("--router_max_new_token_len",))
    prefill_only_one_req: bool = opt(
        False, "Admit at most one new request per step (its prompt, or its first chunk), so "
        "prompts never share a step with each other (running requests keep decoding beside it).")

    def __post_init__(self) -> None:
        if self.max_running_requests <= 0:
            raise ValueError(f"--max-running-requests must be positive, got {self.max_running_requests}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"--chunked-prefill-size must be positive or -1, got {self.chunked_prefill_size}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"--max-prefill-tokens must be positive, got {self.max_prefill_tokens}")
        if self.fair_step_tokens < 0:
            raise ValueError(f"--fair-step-tokens must be >= 0, got {self.fair_step_tokens}")
        if self.stream_interval <= 0:
            raise ValueError(f"--stream-interval must be positive, got {self.stream_interval}")
        if self.schedule_conservativeness < 0:
            raise ValueError(f"--schedule-conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if not 0.0 <= self.router_token_ratio <= 1.0:
            raise ValueError(f"--router-token-ratio must be in [0, 1], got {self.router_token_ratio}")
        if self.router_max_wait_tokens < 0:
            raise ValueError(f"--router-max-wait-tokens must be >= 0, got {self.router_max_wait_tokens}")
        if self.router_max_new_token_len is not None and self.router_max_new_token_len <= 0:
            raise ValueError("--router_max_new_token_len must be positive, got "
                             f"{self.router_max_new_token_len}")
        if self.max_queued_requests is not None and self.max_queued_requests <= 0:
            raise ValueError(f"--max-queued-requests must be positive, got {self.max_queued_requests}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("--priority-scheduling-preemption-threshold must be >= 0, got "
                             f"{self.priority_scheduling_preemption_threshold}")

    @property
    def max_tokens_per_step(self) -> int:
        """Token budget of one engine step."""
        return self.max_prefill_tokens

    @property
    def is_priority_scheduling(self) -> bool:
        return self.enable_priority_scheduling or self.scheduling_policy == "priority"

    @property
    def is_low_priority_value_first(self) -> bool:
        """Smaller `priority` values are more urgent (SGLang's flag, or vLLM's convention)."""
        return self.schedule_low_priority_values_first or self.scheduling_policy == "priority"

    @property
    def max_chunk_tokens(self) -> int | None:
        """Most prompt tokens of one request in one step, or None when chunking is off."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @property
    def is_lone_prompt_chunked(self) -> bool:
        """Whether a request alone in the engine has its prompt cut at ``max_chunk_tokens`` too.
        The default chunk exists so decodes keep streaming beside a long prompt; alone, nothing
        waits on its step, so the default is not applied there (one 1,019-token step instead of two:
        ~4% less prefill CPU, benchmarks/RESULTS.md). Any other size is applied always."""
        return self.chunked_prefill_size != _DEFAULT_CHUNKED_PREFILL_SIZE


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes and nodes (tensor parallelism may span nodes; pipeline
    parallelism runs on one node)."""

    tensor_parallel_size: int = opt(
        1, "Tensor-parallel degree: ranks that each hold a slice of every layer (heads, MLP columns, "
        "vocabulary) and all-reduce after each row-parallel layer. 1 runs the model in the engine "
        "process; N > 1 adds N - 1 rank processes on this node (rank 0 stays in the engine process).")
    pipeline_parallel_size: int = opt(
        1, "Pipeline-parallel degree: stages that each hold a contiguous range of the decoder layers "
        "(the first also the embedding, the last the final norm and LM head) and its K/V; hidden "
        "states pass stage to stage. N > 1 adds rank processes on this node (tp x pp ranks in all; "
        "the engine process holds the last stage, which computes the logits it samples from).")
    pp_max_micro_batch_size: int | None = opt(
        None, "Most sequences in one pipeline micro-batch. Every step is cut into micro-batches that "
        "flow through the stages one after another, so stage s works on one while stage s + 1 works "
        "on the one before. Unset: the step's sequences cut into --pp-size micro-batches.")
    data_parallel_size: int = opt(
        1, "Data-parallel replicas: N engine processes behind the one HTTP server, each with its "
        "own copy of the model, KV pool and scheduler (each may itself be tensor-parallel). The "
        "node's CPUs are cut into N slices, one per replica, and --num-threads defaults to a "
        "replica's share.")
    load_balance_method: str = opt(
        "round_robin", "How a request's replica is chosen with --dp-size > 1: round_robin (in "
        "turn), shortest_queue (fewest unfinished requests) or minimum_tokens (fewest unfinished "
        "prompt + max_tokens tokens), as counted by the front end; ties go to the lowest replica.",
        choices=["round_robin", "shortest_queue", "minimum_tokens"])
    distributed_executor_backend: str = opt(
        "mp", "How rank processes are started: mp (processes on this node, and on other nodes "
        "with --nnodes) or ray (Ray actors in a placement group on an existing Ray cluster: "
        "`ray start --head` first; needs the optional `ray` package). Collectives run on "
        "torch.distributed either way.", choices=["mp", "ray"])
    dist_timeout: float = opt(
        300.0, "Seconds a rank may take to start and join (load its shard, meet the others), and the "
        "timeout of every collective; a rank that misses it fails the server with a clear error "
        "instead of hanging. Loading a large model on a slow disk may need more.")

    expert_parallel_size: int = opt(
        1, "Expert-parallel degree of MoE layers: 1 (every tensor-parallel rank holds a slice of "
        "every expert), --tp-size (each rank holds whole experts, E / N of them, and tokens go "
        "to the rank holding their expert and back by all-to-all; attention stays tensor-parallel), "
        "or a divisor of --tp-size between (N groups of --tp-size / N ranks: a group holds E / N "
        "experts, each split over its ranks by intermediate columns; one all-reduce sums the parts; "
        "redundant slots and EPLB place whole experts on groups).")
    enable_expert_parallel: bool = opt(
        False, "Expert parallelism over all tensor-parallel ranks: --ep-size set to --tp-size.")
    ep_num_redundant_experts: int = opt(
        0, "Extra expert slots per MoE layer under expert parallelism, each a replica of a busy "
        "expert (rows of a replicated expert are spread over its replicas); experts plus these "
        "must divide by --ep-size. They start as replicas of the first experts; --enable-eplb "
        "moves them to the measured busiest.")
    enable_dp_attention: bool = opt(
        False, "DP attention for mixture-of-experts models (SGLang's): each tensor-parallel rank "
        "runs the attention and dense layers, whole, for its own share of the requests (its KV pool "
        "holds only theirs), and the MoE layers run expert-parallel over all ranks (each rank's "
        "tokens go to their experts' ranks and back). A request's rank is chosen when it first takes "
        "KV blocks (the rank with the most free blocks; a prefix-cache hit: the rank holding it) and "
        "kept for its life. The pool size (--max-total-tokens, or each rank's memory) is divided "
        "among the ranks. The data-parallel size is --tp-size (--dp-size may repeat it).")
    moe_dense_tp_size: int | None = opt(
        None, "SGLang's tensor-parallel size for the dense MLP layers of a MoE model. Those layers are "
        "split over --tp-size like attention, or whole on every rank under --enable-dp-attention: "
        "--moe-dense-tp-size may name that size (--tp-size, or 1 with --enable-dp-attention); another "
        "size is refused at start-up.")
    enable_dp_lm_head: bool = opt(
        False, "With --enable-dp-attention: each rank computes the LM head over its own requests' "
        "rows (a copy of the whole head on every rank) and the logits are gathered; without it the "
        "rows' hidden states are gathered and rank 0 computes every row's logits.")
    enable_eplb: bool = opt(
        False, "Expert load balancing: count each MoE layer's routed rows per expert and every "
        "--eplb-rebalance-num-iterations forward passes re-place the experts (and their redundant "
        "replicas) so each expert-parallel rank computes about as many rows. Outputs do not "
        "change (the placement decides which rank computes a row, not its value).")
    eplb_rebalance_num_iterations: int = opt(
        1000, "Forward passes between two EPLB rebalances (the load counted since the last one "
        "decides the next placement).")
    eplb_min_rebalancing_utilization_threshold: float = opt(
        1.0, "Rebalance only when the layers' mean balancedness (mean / max rows per rank over the "
        "last window) is below this; 1.0 rebalances every time.")

    disable_custom_all_reduce: bool = opt(
        False, "All-reduce through torch.distributed (gloo) only. By default, tensor-parallel ranks "
        "on one CPU host sum tensors of up to 4 MiB through shared memory (tens of microseconds "
        "instead of gloo's hundreds over loopback); larger ones still use gloo.")
    nnodes: int = opt(
        1, "Nodes (machines) the tensor-parallel ranks span. Run the same command on every node "
        "with its own --node-rank; node 0 serves HTTP and holds the engine, the others run only "
        "their --tp-size / --nnodes ranks and exit when node 0 goes.")
    node_rank: int = opt(0, "This node's index, 0 .. --nnodes - 1 (0 serves HTTP).")
    dist_init_addr: str | None = opt(
        None, "host:port where node 0 serves the torch.distributed rendezvous (a TCPStore); every "
        "node must reach it, and node 0 binds its step and reply sockets on that host. Required "
        "with --nnodes > 1. Trusted networks only: like torch.distributed, it is unauthenticated.")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be at least 1, got {self.pipeline_parallel_size}")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ValueError(f"--pp-max-micro-batch-size must be at least 1, got {self.pp_max_micro_batch_size}")
        self._check_nodes()
        self._check_dp_attention()
        self._check_experts()
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be positive, got {self.dist_timeout}")

    def _check_experts(self) -> None:
        """--ep-size and EPLB: experts are sharded over the tensor-parallel ranks."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if self.enable_expert_parallel and ep not in (1, tp):
            raise ValueError(f"--enable-expert-parallel sets --ep-size to --tp-size {tp}; "
                             f"--ep-size {ep} contradicts it")
        if ep < 1 or tp % ep:
            raise ValueError(f"--ep-size {ep} must divide --tp-size {tp}: experts are sharded over "
                             f"the tensor-parallel ranks, in groups of --tp-size / --ep-size ranks that "
                             "split each expert's intermediate columns (attention TP, experts EP)")
        if self.ep_num_redundant_experts < 0:
            raise ValueError(f"--ep-num-redundant-experts must be at least 0, got {self.ep_num_redundant_experts}")
        if self.ep_size == 1 and (self.ep_num_redundant_experts or self.enable_eplb):
            raise ValueError("--ep-num-redundant-experts and --enable-eplb place experts on expert-"
                             "parallel ranks: they need --ep-size > 1 (with --ep-size 1 every rank "
                             "holds every expert)")
        if self.eplb_rebalance_num_iterations < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be at least 1, got "
                             f"{self.eplb_rebalance_num_iterations}")

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree (--ep-size, or --tp-size with --enable-expert-parallel or
        --enable-dp-attention)."""
        if self.enable_expert_parallel or self.enable_dp_attention:
            return self.tensor_parallel_size
        return self.expert_parallel_size

    @property
    def attention_dp_size(self) -> int:
        """Ranks holding KV pools of their own requests: --tp-size under --enable-dp-attention (the
        engine's block ids are cut into that many partitions, one a rank), else 1."""
        return self.tensor_parallel_size if self.enable_dp_attention else 1

    def _check_dp_attention(self) -> None:
        """--enable-dp-attention: the attention ranks are the tensor-parallel ranks of one node;
        SGLang's ``--dp-size N`` beside it names that size (one engine, not N replicas)."""
        tp = self.tensor_parallel_size
        dense_tp = 1 if self.enable_dp_attention else tp
        if self.moe_dense_tp_size is not None and self.moe_dense_tp_size != dense_tp:
            raise ValueError(f"--moe-dense-tp-size {self.moe_dense_tp_size}: a MoE model's dense MLP layers "
                             f"run split over --tp-size {tp} like its attention, or whole on every rank "
                             "(--moe-dense-tp-size 1) with --enable-dp-attention; a size of their own "
                             "(a separate process group for them) is not built here")
        object.__setattr__(self, "moe_dense_tp_size", None)   # named what runs anyway: the default
        if not self.enable_dp_attention:
            if self.enable_dp_lm_head:
                raise ValueError("--enable-dp-lm-head computes the LM head per DP-attention rank: it "
                                 "needs --enable-dp-attention")
            return
        if tp == 1:
            raise ValueError("--enable-dp-attention needs --tp-size > 1: its attention ranks are the "
                             "tensor-parallel ranks (the data-parallel size is --tp-size)")
        if self.data_parallel_size == tp:   # SGLang's spelling: --tp N --dp N --enable-dp-attention
            object.__setattr__(self, "data_parallel_size", 1)
        elif self.data_parallel_size != 1:
            raise ValueError(f"--dp-size {self.data_parallel_size} with --enable-dp-attention: the "
                             f"attention data-parallel size is --tp-size {tp} (leave --dp-size out or "
                             f"set it to {tp}); engine replicas of a DP-attention engine are not built")
        if self.expert_parallel_size not in (1, tp):
            raise ValueError(f"--enable-dp-attention runs the experts expert-parallel over all --tp-size "
                             f"{tp} ranks; --ep-size {self.expert_parallel_size} contradicts it")
        if self.pipeline_parallel_size > 1:
            raise ValueError("--enable-dp-attention cannot be combined with --pp-size > 1: a pipeline "
                             "stage would pass on hidden states of rows its next stage's rank does not own")
        if self.nnodes > 1 or self.distributed_executor_backend != "mp":
            raise ValueError("--enable-dp-attention is built and tested on one node with the mp "
                             "executor only (no --nnodes, no ray) in this build")

    def _check_nodes(self) -> None:
        """The multi-node and executor flags (--nnodes, --node-rank, --dist-init-addr, ray)."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0 .. --nnodes - 1 ({self.nnodes - 1})")
        if self.pipeline_parallel_size > 1 and (
                self.nnodes > 1 or self.distributed_executor_backend == "ray"):
            raise ValueError("--pp-size > 1 runs on one node with the mp backend in this build "
                             "(--nnodes and --distributed-executor-backend ray are tensor parallel only)")
        if self.nnodes == 1:
            if self.dist_init_addr is not None:
                raise ValueError("--dist-init-addr is node 0's address for --nnodes > 1; on one "
                                 "node the ranks meet on loopback (drop the flag)")
            return
        if self.distributed_executor_backend == "ray":
            raise ValueError("--nnodes with --distributed-executor-backend ray: Ray places the ranks "
                             "on its cluster's nodes itself; start one server, without --nnodes")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tensor_parallel_size} is not a multiple of --nnodes "
                             f"{self.nnodes}: every node runs the same number of ranks")
        if self.data_parallel_size != 1:
            raise ValueError("--dp-size with --nnodes > 1 is not supported in this build (data "
                             "parallel replicas run on one node)")
        if self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address, the "
                             "same on every node)")
        split_host_port(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (tp x pp on one node; tp / nnodes across nodes, where pp is 1)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size // self.nnodes


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming --dist-init-addr."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr {address!r}: expected host:port, e.g. 10.0.0.1:5000")
    return host, int(port)


ONEDNN_CACHE_DEFAULT = 64
"""--onednn-primitive-cache-capacity default (benchmarks/onednn_cache.py)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """How the engine process computes: its thread count and whether decode steps are compiled."""

    num_threads: int | None = opt(
        None, "Threads torch uses in the engine process (intra-op; inter-op is 1), or in each rank "
        "with --tp-size > 1 (unset: the physical cores of the rank's own slice of the CPUs). Unset: the "
        "physical cores this process may run on (its CPU affinity divided by the threads per "
        "core), because a second hyper-thread adds no GEMM throughput and an OpenMP thread "
        "waiting for a busy core stalls every op. Lower it when other work shares the machine "
        "(see README, Threads). The HTTP front end keeps one torch thread and one tokenizer "
        "thread.")
    enable_torch_compile: bool = opt(
        False, "Compile the decoder layers with torch.compile (inductor) for decode-only steps of "
        "at most --torch-compile-max-bs sequences; prefill and larger steps stay eager. Compiled "
        "at start-up (tens of seconds on a small CPU). Not with --quantization (the int8 "
        "activations would round differently). On the 2-core CPU float32 decode measured no "
        "faster than eager (its steps are GEMM-bound); see benchmarks/RESULTS.md.")
    disable_adaptive_threads: bool = opt(
        False, "Keep the engine's torch threads fixed. By default they are lowered (from "
        "--num-threads or the default) while other processes keep cores of the engine's CPUs busy, "
        "and raised back when they stop: checked once a second between steps from /proc/stat, "
        "logged on each change. An op split over a thread whose core another process holds waits "
        "for it: beside one busy core a 2-thread decode kept a quarter of its quiet speed, 1 thread "
        "all of it (benchmarks/busy_core.py). Tensor- and pipeline-parallel ranks are pinned to "
        "their own cores and keep their count.")
    disable_lm_head_screen: bool = opt(
        False, "Compute every greedy token from the full LM head. By default, where the LM head is "
        "one unsharded Q8_0 GGUF weight run by the AVX512-VNNI kernel (int16 activations), greedy "
        "rows without logprobs or logit processors first score every vocabulary row from a 5-bit "
        "copy of the head with a rigorous error bound, then compute exactly, with the same kernel, "
        "only the rows that could still be the argmax: that kernel's token, fewer bytes read per token "
        "(servelm/model/gguf/lm_head_screen.py; the copy costs 5/8 byte per weight). Where the head "
        "runs another kernel at a step's row count (the bf16 rows kernel, the dense copy: logits "
        "rounded differently), a greedy token in a near tie may differ with this flag.")
    omp_wait_policy: str = opt(
        "default", "How the OpenMP threads of the engine and rank processes wait when a parallel "
        "region ends: passive (sleep at once: OMP_WAIT_POLICY=PASSIVE), active (spin), or default "
        "(the OpenMP runtime's own: spin a while, then sleep). Spinning wins a few microseconds per "
        "op on an idle machine, but when another process takes one of the cores every op waits for "
        "the thread that lost its core while its partner burns the other (the engine answers "
        "that by using fewer threads, see --disable-adaptive-threads); passive keeps a 2-thread decode going beside a busy "
        "core but halved its quiet speed on the 2-core dev box (benchmarks/busy_core.py, "
        "benchmarks/RESULTS.md). Set in the environment of the processes servelm starts; an "
        "OMP_WAIT_POLICY the user already exported wins. An in-process LLMEngine inherits whatever "
        "its python was started with.", choices=["passive", "active", "default"])
    enable_deterministic_inference: bool = opt(
        False, "Make a request's output independent of what it is batched with and of prefix-cache "
        "hits: every token's forward pass runs alone (one token of one sequence per pass, so "
        "every K/V entry and logit is computed with the same shapes whatever the batch, the "
        "chunking or the cache), with fixed threads. Costs batching: prompts are computed token "
        "by token like decode, and concurrent requests take turns (see README, Deterministic "
        "inference). Not with speculative decoding or --enable-torch-compile.")
    torch_compile_max_bs: int = opt(
        32, "Largest decode batch (sequences) run through the compiled layers; one dynamic-shape "
        "graph covers 2..max-bs, batch 1 gets its own.")
    onednn_primitive_cache_capacity: int | None = opt(
        ONEDNN_CACHE_DEFAULT, "Primitives oneDNN keeps cached in each model process (it builds one per "
        "linear shape and batch size; its own default, 1024, lets a varied load grow the "
        "engine's memory by hundreds of MB). torch's ideep matmul cache gets the same capacity "
        "(at least 1). Set before the model loads; 0 disables the cache "
        "(slow). None in a config file: oneDNN's own setting (ONEDNN_PRIMITIVE_CACHE_CAPACITY or "
        "1024). See benchmarks/RESULTS.md, oneDNN primitive cache.")

    def __post_init__(self) -> None:
        if self.onednn_primitive_cache_capacity is not None and self.onednn_primitive_cache_capacity < 0:
            raise ValueError("--onednn-primitive-cache-capacity must be at least 0, got "
                             f"{self.onednn_primitive_cache_capacity}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {self.num_threads}")
        if self.torch_compile_max_bs < 1:
            raise ValueError(f"--torch-compile-max-bs must be at least 1, got {self.torch_compile_max_bs}")
        if self.omp_wait_policy not in ("passive", "active", "default"):
            raise ValueError("--omp-wait-policy must be passive, active or default, got "
                             f"{self.omp_wait_policy!r}")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Constrained decoding (JSON schema, regex, EBNF grammars)."""

    grammar_backend: str = opt("xgrammar", "Grammar backend for structured output; none disables it "
                               "(requests asking for a grammar then get a 400).",
                               choices=["xgrammar", "none", "outlines", "llguidance"])
    constrained_json_whitespace_pattern: str | None = opt(
        None, "Whitespace allowed between JSON tokens. Unset: compact JSON (small models given free "
        "whitespace can loop on it); set: any JSON whitespace is allowed.")
    disable_jump_forward: bool = opt(False, "Sample every token under a grammar. By default, text the "
                                     "grammar forces (JSON keys and punctuation) is appended without a "
                                     "model step, saving steps.")
    grammar_compile_timeout: float = opt(
        10.0, "Seconds one grammar may take to compile (on a worker thread, off the engine step); "
        "a request whose grammar takes longer gets a 400. 10 s is far above a realistic schema's "
        "compile (milliseconds) and bounds what one request can cost; 0: no limit.")
    disable_grammar_compile_process: bool = opt(
        False, "Compile grammars on threads only. By default each compile worker first compiles a "
        "spec in a child process it kills at --grammar-compile-timeout, so a timed-out compile "
        "stops using a core at once; the child holds ~300 MB while grammars are compiled (it "
        "exits after 2 idle minutes) and a new spec compiles twice (child, then engine).")
    max_grammar_spec_bytes: int = opt(
        32768, "Largest grammar spec (JSON schema, regex, EBNF, choice list) in bytes, refused with "
        "a 400 up front. Compile time grows superlinearly with size (xgrammar: 0.3 s for 1k "
        "optional properties, minutes for 10k); raise it for large tool schemas.")

    def __post_init__(self) -> None:
        if self.grammar_compile_timeout < 0:
            raise ValueError(f"--grammar-compile-timeout must be >= 0, got {self.grammar_compile_timeout}")
        if self.max_grammar_spec_bytes < 1:
            raise ValueError(f"--max-grammar-spec-bytes must be at least 1, got {self.max_grammar_spec_bytes}")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP front end."""

    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(30000, "Port to listen on.")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on every endpoint but health.")
    chat_template: str | None = opt(None, "Chat template: a Jinja file path or an inline template.")
    allow_auto_truncate: bool = opt(False, "Truncate prompts longer than the context (keep the end) instead of 400.")
    enable_cache_report: bool = opt(False, "Report prompt tokens served from the prefix cache as "
                                    "usage.prompt_tokens_details.cached_tokens in OpenAI responses.")
    beam_mode: bool = opt(False, "LightLLM's beam mode: a completion or chat request with best_of "
                          "(else n) > 1 runs a beam search of that width unless it sets "
                          "use_beam_search false (see README, Beam search).")
    long_truncation_mode: str = opt(
        "none", "What to drop from a prompt longer than the context allows: none (answer 400, "
        "unless --allow-auto-truncate, which is head), head (the oldest tokens) or center (the "
        "middle, keeping the start and the end).", choices=["none", "head", "center"])
    log_level: str = opt("info", "Log level for servelm.", choices=["debug", "info", "warning", "error"])
    skip_server_warmup: bool = opt(
        False, "Report ready as soon as the model is loaded, without the start-up warm-up (a "
        "second or so: prefill chunks and decode batches run once, off the prefix cache and the "
        "metrics, so the first user request does not pay for oneDNN primitives and cold kernels).")
    tool_call_parser: str | None = opt(
        None, "How tool calls are read from the model's text (tool_choice auto). Unset: the format "
        "the chat template shows when it declares tools (logged at start-up), else hermes with "
        "--enable-auto-tool-choice (it also takes a bare JSON object).",
        choices=["hermes", "qwen25", "llama3", "llama3_json", "mistral", "pythonic"])
    enable_auto_tool_choice: bool = opt(
        False, "Let the model decide to call tools (tool_choice auto with tools) even when its chat "
        "template declares no tool format servelm recognises (already on for templates that do, "
        "and when --tool-call-parser is set).")
    reasoning_parser: str | None = opt(None, "Split <think>...</think> into reasoning_content.",
                                       choices=["deepseek-r1", "qwen3"])
    allowed_origins: str | None = opt(
        None, "CORS: origins allowed to call the API, a JSON list or comma-separated ('*' for "
        "any). Unset: no CORS headers (browsers on other origins are refused).")
    allowed_methods: str = opt("*", "CORS: allowed methods (JSON list or comma-separated).")
    allowed_headers: str = opt("*", "CORS: allowed request headers (JSON list or comma-separated).")
    allow_credentials: bool = opt(False, "CORS: allow cookies and Authorization headers cross-origin.")
    ssl_keyfile: str | None = opt(None, "TLS private key file (PEM); with --ssl-certfile serves HTTPS.")
    ssl_certfile: str | None = opt(None, "TLS certificate file (PEM).")
    ssl_ca_certs: str | None = opt(None, "CA certificates file for verifying client certificates.")
    ssl_cert_reqs: int = opt(0, "Client certificate requirement, as Python's ssl module: 0 none, "
                             "1 optional, 2 required.")
    root_path: str | None = opt(None, "ASGI root path when behind a path-based routing proxy "
                                "(e.g. /llm).")
    max_request_body_bytes: int = opt(
        32 * 1024 * 1024, "Largest request body accepted, in bytes; larger ones get 413. 32 MiB "
        "holds any text prompt that fits a 1M-token context, or a camera photo as a base64 data: "
        "URL (base64 adds a third: a 20 MB JPEG, --max-image-bytes, is 27 MB), while bounding "
        "memory per request.")
    shutdown_timeout_s: float = opt(
        60.0, "On SIGTERM/SIGINT, seconds to let in-flight requests finish before they are "
        "cut off; then the engine process is stopped.")
    trust_request_chat_template: bool = opt(
        False, "Accept a `chat_template` sent in a request (vLLM's flag). Off by default: a "
        "template is code; an allowed one is rendered in a sandboxed worker process with a "
        "time and memory budget, so it cannot stall or crash the server.")
    max_sequences_per_request: int = opt(
        256, "Most sequences one request may create (prompts x n); more is a 400. A request's "
        "sequences also share one fair slot in admission, so a big batch cannot starve others.")
    max_connections: int = opt(
        2048, "Most open HTTP connections; further ones are answered 503 (Retry-After) and closed "
        "at once (bounded further by the process's open-file limit), so idle sockets cannot "
        "exhaust file handles.")
    http_header_timeout_s: float = opt(
        10.0, "Seconds a connection may take to send a request's headers (from connecting, or "
        "from the previous response); slower ones (idle or slowloris sockets) are closed.")
    use_tgi_api: bool = opt(
        False, "Answer POST /generate (and /, /generate_stream) in Hugging Face TGI's request and "
        "response shapes instead of SGLang's, as LightLLM's flag does; GET /info describes the model.",
        flags=("--use_tgi_api",))
    disable_playground: bool = opt(
        False, "Do not serve the playground page at / and /playground (the API is unchanged).")
    http_body_timeout_s: float = opt(
        60.0, "Seconds a request may take to send its body once its headers arrived; then the "
        "connection is closed. 60 s moves the largest body (--max-request-body-bytes, 32 MiB) at "
        "about 5 Mbit/s.")
    response_role: str = opt(
        "assistant", "Role of the generated message in chat completion responses (when the "
        "request adds the generation prompt; otherwise the role of its last message).")
    return_tokens_as_token_ids: bool = opt(
        False, "Show tokens in OpenAI logprobs as 'token_id:ID' strings instead of their text, so "
        "tokens that are not valid UTF-8 on their own can be identified.")
    max_logprobs: int = opt(
        20, "Most logprobs (alternatives per token) a request may ask for, for its output "
        "(logprobs, top_logprobs, top_logprobs_num) or its prompt; more is a 400. At most 20, "
        "the sampler's limit.")
    stream_output: bool = opt(
        False, "Streamed /generate chunks carry only what is new since the previous chunk (text, "
        "output_ids, output logprobs: disjoint segments) instead of everything so far.")
    preferred_sampling_params: str | None = opt(
        None, "A JSON object of sampling settings recommended for this model, returned as "
        "preferred_sampling_params by /get_model_info (it changes no request).")
    return_all_prompt_logprobs: bool = opt(
        False, "LightLLM's flag, with --use_tgi_api: every request's prompt logprobs are computed "
        "and the /generate body adds prompt_token_ids and prompt_logprobs (None for the first "
        "token), as details.prefill does for decoder_input_details.",
        flags=("--return_all_prompt_logprobs",))
    disable_fastapi_docs: bool = opt(
        False, "Do not serve the OpenAPI schema and its docs pages (/openapi.json, /docs, /redoc).")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.chat_template is not None and not is_chat_template_value(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r}: no such file, and not an inline "
                             "Jinja template (give a template file's path, or the template text itself)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"--max-request-body-bytes must be positive, got {self.max_request_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout-s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_sequences_per_request <= 0:
            raise ValueError("--max-sequences-per-request must be positive, got "
                             f"{self.max_sequences_per_request}")
        if self.max_connections <= 0:
            raise ValueError(f"--max-connections must be positive, got {self.max_connections}")
        if self.http_header_timeout_s <= 0 or self.http_body_timeout_s <= 0:
            raise ValueError("--http-header-timeout-s and --http-body-timeout-s must be positive")
        if not self.response_role.strip():
            raise ValueError("--response-role must not be empty")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"--max-logprobs must be in [0, 20] (the sampler returns at most 20 "
                             f"alternatives per token), got {self.max_logprobs}")
        parse_json_object_flag("--preferred-sampling-params", self.preferred_sampling_params)

    @property
    def truncation_mode(self) -> str | None:
        """head or center when over-long prompts are truncated; None when they are refused."""
        if self.long_truncation_mode != "none":
            return self.long_truncation_mode
        return "head" if self.allow_auto_truncate else None


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def token_buckets(flag: str, rule: list[str], default: tuple[float, ...]) -> list[float]:
    """Histogram bounds from SGLang's bucket rule: ``default``; ``tse MIDDLE BASE COUNT``
    (MIDDLE, and MIDDLE +- BASE^i for i in 1..ceil(COUNT/2), floored at 0); ``custom B1 B2 ..``.
    ValueError naming ``flag`` for anything else."""
    kind, args = (rule[0], rule[1:]) if rule else ("default", [])
    try:
        if kind == "default" and not args:
            return sorted(set(default))
        if kind == "tse" and len(args) == 3:
            middle, base, count = float(args[0]), float(args[1]), int(args[2])
            if base <= 1 or count < 1 or middle < 0:
                raise ValueError("tse needs MIDDLE >= 0, BASE > 1 and COUNT >= 1")
            bounds, distance = {middle}, 1.0
            for _ in range(math.ceil(count / 2)):
                distance *= base
                bounds.update((middle + distance, max(0.0, middle - distance)))
            return sorted(bounds)
        if kind in ("custom", "customer") and args:
            bounds_list = sorted({float(value) for value in args})
            if bounds_list[0] < 0:
                raise ValueError("custom bounds must be >= 0")
            return bounds_list
    except ValueError as error:
        raise ValueError(f"{flag} {' '.join(rule)}: {error}") from None
    raise ValueError(f"{flag} {' '.join(rule)}: expected default, tse MIDDLE BASE COUNT, or "
                     "custom B1 B2 ...")


def _bucket_check(flag: str, buckets: list[float] | None) -> None:
    if buckets is None:
        return
    if not buckets or any(b <= 0 for b in buckets) or sorted(set(buckets)) != list(buckets):
        raise ValueError(f"{flag} needs positive, increasing bucket bounds in seconds, got {buckets}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Metrics, request logs, the periodic stats line and the forward-pass watchdog."""

    enable_metrics: bool = opt(False, "Serve Prometheus metrics at GET /metrics.")
    bucket_time_to_first_token: list[float] | None = opt(
        None, "Histogram bucket bounds (seconds) for time to first token; default a 0.01-60 s ladder.")
    bucket_inter_token_latency: list[float] | None = opt(
        None, "Histogram bucket bounds (seconds) for the gap between output tokens.")
    bucket_e2e_request_latency: list[float] | None = opt(
        None, "Histogram bucket bounds (seconds) for whole-request latency.")
    log_level_http: str | None = opt(None, "Log level of the HTTP access log; defaults to --log-level.",
                                     choices=["debug", "info", "warning", "error", "critical"])
    log_requests: bool = opt(False, "Log each request when it finishes (see --log-requests-level).")
    log_requests_level: int = opt(
        0, "What --log-requests writes: 0 id, token counts, finish reason, latency; 1 plus the "
        "sampling parameters; 2 plus prompt and output text cut to --max-log-len; 3 all of it.")
    max_log_len: int | None = opt(None, "Most characters (or token ids) of prompt and output per "
                                  "request log line at level 2; unset: 2048.")
    log_stats_interval: float = opt(10.0, "Seconds between stats lines (throughput, running/queued, "
                                    "KV use, cache hit rate) while there is work; 0 turns them off.")
    decode_log_interval: int = opt(0, "Also log the stats line every N engine steps; 0: by time only.")
    watchdog_timeout: float = opt(
        300.0, "Seconds one engine step may take; a step that hangs longer kills the engine (the "
        "server then exits with an error) instead of hanging forever. 300 s is far above any "
        "healthy step, even a full prefill on CPU. 0 turns the watchdog off.")
    expert_distribution_recorder_mode: str | None = opt(
        None, "Record which experts each MoE layer routes to, for /dump_expert_distribution_record "
        "(between /start_expert_distribution_record and /stop_expert_distribution_record): stat "
        "(rows per layer and expert, summed over the buffer's passes), per_pass (those counts per "
        "forward pass) or per_token (each token's chosen experts per layer, per pass).",
        choices=["stat", "per_pass", "per_token"])
    expert_distribution_recorder_buffer_size: int | None = opt(
        None, "Forward passes the recorder keeps (the oldest drop out); unset: 1000, -1: all.")
    enable_expert_distribution_metrics: bool = opt(
        False, "Export MoE routing on /metrics: rows per layer and expert, rows per expert-parallel "
        "rank, and EPLB rebalances (counted since start; needs --enable-metrics).")
    crash_dump_folder: str | None = opt(
        None, "Folder for a JSON dump of the last five minutes of requests (prompt token ids, "
        "sampling parameters, how each ended), written when the engine process dies; unset: no "
        "record is kept.")
    enable_trace: bool = opt(
        False, "Send one OpenTelemetry span per request (its queue, prefill, decode and "
        "detokenize phases as events, token counts and latencies as attributes) over OTLP/HTTP "
        "to --otlp-traces-endpoint; a request's W3C traceparent header makes its span part of "
        "the caller's trace. Needs the OpenTelemetry SDK: pip install 'servelm[tracing]'.")
    otlp_traces_endpoint: str | None = opt(
        None, "OTLP/HTTP (protobuf) collector receiving the traces: a URL "
        "(http://collector:4318/v1/traces) or host:port (http:// and /v1/traces are added); "
        "setting it turns tracing on. Unset with --enable-trace: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://localhost:4318/v1/traces. (OTLP over "
        "gRPC, port 4317, is not spoken: point it at the collector's HTTP receiver.)")
    collect_detailed_traces: str | None = opt(
        None, "vLLM's model, worker or all (comma-separated; all mean the same here): each "
        "request span also gets a child span per phase (queue, prefill, decode, detokenize). "
        "Needs tracing (--enable-trace or --otlp-traces-endpoint).")
    collect_tokens_histogram: bool = opt(
        False, "With --enable-metrics: histograms of each request's prompt and generation "
        "token counts (servelm:prompt_tokens_histogram, servelm:generation_tokens_histogram).")
    prompt_tokens_buckets: list[str] | None = opt(
        None, "Bucket rule of the prompt tokens histogram (SGLang's): default; tse MIDDLE BASE "
        "COUNT (bounds MIDDLE +- BASE^i, two-sided exponential); or custom B1 B2 ...")
    generation_tokens_buckets: list[str] | None = opt(
        None, "Bucket rule of the generation tokens histogram, as --prompt-tokens-buckets.")
    tokenizer_metrics_custom_labels_header: str = opt(
        "x-custom-labels", "Request header carrying a JSON object of metric labels for the "
        "request (the names --tokenizer-metrics-allowed-custom-labels allows).")
    tokenizer_metrics_allowed_custom_labels: list[str] | None = opt(
        None, "Label names a request may set through --tokenizer-metrics-custom-labels-header; "
        "each becomes a label of the per-request metrics (empty when a request does not set it; "
        "other names in the header are ignored).")
    enable_request_time_stats_logging: bool = opt(
        False, "Log each finished request's phase times: queue, prefill (to the first token), "
        "decode, detokenize, time to first token and end to end (logger servelm.requests).")
    metric_gateway: str | None = opt(
        None, "Prometheus Pushgateway (host:port or URL) that the server pushes its metrics to "
        "every --push-interval seconds (LightLLM's push), under --job-name and --grouping-key.",
        flags=("--metric_gateway",))
    job_name: str = opt("servelm", "Pushgateway job the metrics are pushed as.",
                        flags=("--job_name",))
    grouping_key: list[str] | None = opt(
        None, "Pushgateway grouping key, KEY=VALUE pairs (e.g. instance=node1).",
        flags=("--grouping_key",))
    push_interval: float = opt(10.0, "Seconds between pushes to --metric-gateway.",
                               flags=("--push_interval",))
    enable_nan_detection: bool = opt(
        False, "Check every step's logits for NaN: a request whose row has NaN is logged (a "
        "warning naming it) and sampled with those entries at -1e5, so one bad row does not "
        "poison the batch. Costs one pass over the step's logits.")
    crash_on_nan: bool = opt(
        False, "Treat NaN in the logits as fatal: every request ends with an error and the "
        "engine process exits (the server with it, status 1). Implies the check of "
        "--enable-nan-detection.")
    gc_warning_threshold_secs: float = opt(
        0.0, "Log a warning when one Python garbage collection takes longer than this (seconds), "
        "in the server and the engine process; 0 turns it off.")
    debug_tensor_dump_output_folder: str | None = opt(
        None, "Folder where each forward pass writes its intermediate tensors (batch input ids "
        "and positions, each decoder layer's and its attention's and MLP's output, the final "
        "norm's, the logits) as rank<r>/pass<N>.pt, for comparing a model with a reference layer "
        "by layer. Slow, and large: debugging only. Not with --pp-size > 1.")
    show_time_cost: bool = opt(
        False, "Log the time cost of the engine's marked phases: model load and warm-up at "
        "start-up, and each stats line (--log-stats-interval) the mean and longest step time "
        "since the previous line.")
    enable_monitor_auth: bool = opt(
        False, "Push with HTTP basic auth, the user and password read from the environment "
        "(SERVELM_PUSHGATEWAY_USER, SERVELM_PUSHGATEWAY_PASSWORD).",
        flags=("--enable_monitor_auth",))

    def __post_init__(self) -> None:
        _bucket_check("--bucket-time-to-first-token", self.bucket_time_to_first_token)
        _bucket_check("--bucket-inter-token-latency", self.bucket_inter_token_latency)
        _bucket_check("--bucket-e2e-request-latency", self.bucket_e2e_request_latency)
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError(f"--log-requests-level must be 0, 1, 2 or 3, got {self.log_requests_level}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.log_stats_interval < 0:
            raise ValueError(f"--log-stats-interval must be >= 0, got {self.log_stats_interval}")
        if self.decode_log_interval < 0:
            raise ValueError(f"--decode-log-interval must be >= 0, got {self.decode_log_interval}")
        size = self.expert_distribution_recorder_buffer_size
        if size is not None and (size == 0 or size < -1):
            raise ValueError(f"--expert-distribution-recorder-buffer-size must be positive or -1 (all), got {size}")
        if self.enable_expert_distribution_metrics and not self.enable_metrics:
            raise ValueError("--enable-expert-distribution-metrics exports on /metrics: add --enable-metrics")
        if self.watchdog_timeout < 0:
            raise ValueError(f"--watchdog-timeout must be >= 0, got {self.watchdog_timeout}")
        self._check_tracing()
        self._check_token_metrics()
        if self.gc_warning_threshold_secs < 0:
            raise ValueError("--gc-warning-threshold-secs must be >= 0, got "
                             f"{self.gc_warning_threshold_secs}")
        if self.push_interval <= 0:
            raise ValueError(f"--push-interval must be positive, got {self.push_interval}")
        for pair in self.grouping_key or ():
            key, sep, _ = pair.partition("=")
            if not sep or not _LABEL_NAME.fullmatch(key):
                raise ValueError(f"--grouping-key {pair!r}: expected KEY=VALUE with KEY a label "
                                 "name ([a-zA-Z_][a-zA-Z0-9_]*)")

    @property
    def nan_check(self) -> str:
        """What NaN in the logits does: off, warn (--enable-nan-detection) or crash."""
        return "crash" if self.crash_on_nan else "warn" if self.enable_nan_detection else "off"

    @property
    def tracing(self) -> bool:
        """Requests are traced (--enable-trace or --otlp-traces-endpoint)."""
        return self.enable_trace or self.otlp_traces_endpoint is not None

    @property
    def grouping_key_dict(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for pair in self.grouping_key or ())

    def _check_tracing(self) -> None:
        if self.collect_detailed_traces is not None:
            modules = {m.strip() for m in self.collect_detailed_traces.split(",")}
            if not modules or not modules <= {"model", "worker", "all"}:
                raise ValueError("--collect-detailed-traces takes model, worker or all (comma-"
                                 f"separated), got {self.collect_detailed_traces!r}")
            if not self.tracing:
                raise ValueError("--collect-detailed-traces needs tracing on: give "
                                 "--otlp-traces-endpoint (or --enable-trace)")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.strip():
            raise ValueError("--otlp-traces-endpoint is empty")

    def _check_token_metrics(self) -> None:
        for flag, rule in (("--prompt-tokens-buckets", self.prompt_tokens_buckets),
                           ("--generation-tokens-buckets", self.generation_tokens_buckets)):
            if rule is not None:
                token_buckets(flag, rule, (1.0,))  # raises ValueError naming the flag
        header = self.tokenizer_metrics_custom_labels_header
        if not header or any(c.isspace() or c == ":" for c in header):
            raise ValueError(f"--tokenizer-metrics-custom-labels-header {header!r} is not a "
                             "header name")
        labels = self.tokenizer_metrics_allowed_custom_labels or []
        for label in labels:
            if not _LABEL_NAME.fullmatch(label) or label in ("model_name", "finish_reason", "le"):
                raise ValueError(f"--tokenizer-metrics-allowed-custom-labels: {label!r} is not a "
                                 "usable Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not "
                                 "model_name, finish_reason or le)")
        if len(set(labels)) != len(labels):
            raise ValueError("--tokenizer-metrics-allowed-custom-labels names a label twice")


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "qkv_proj", "gate_up_proj")
"""The projections a LoRA adapter may target (servelm.lora.adapter serves exactly these); the
last two are the fused forms (Phi-3's names, and SGLang's for --lora-target-modules)."""
_FUSED_LORA_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoRASource:
    """One adapter named on the command line: ``name=path``, a bare path (named after its
    folder), or a JSON object (vLLM's ``{"name", "path"}``, SGLang's ``{"lora_name",
    "lora_path"}``)."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRASource:
        text = text.strip()
        if text.startswith("{"):
            values = parse_json_object_flag("--lora-paths/--lora-modules", text)
            name = values.get("name", values.get("lora_name"))
            path = values.get("path", values.get("lora_path"))
            if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                raise ValueError(f"--lora-paths/--lora-modules {text!r}: a JSON entry needs string "
                                 "'name' and 'path' (vLLM) or 'lora_name' and 'lora_path' (SGLang)")
            return cls(name, path)
        name, sep, path = text.partition("=")
        if not sep:
            path = text
            name = text.rstrip("/").rsplit("/", 1)[-1]
        if not name or not path:
            raise ValueError(f"--lora-paths/--lora-modules {text!r}: expected NAME=PATH or PATH")
        return cls(name, path)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: adapters over the one base model, mixed in the same batches."""

    enable_lora: bool = opt(
        False, "Serve LoRA adapters (PEFT format) over the base model; --lora-paths/--lora-modules "
        "turn it on too (SGLang's rule). Adapters may also be loaded at run time "
        "(POST /load_lora_adapter, /v1/load_lora_adapter).")
    lora_paths: list[str] | None = opt(
        None, "Adapters loaded at start-up: NAME=PATH, PATH (named after its folder) or a JSON "
        "object {\"name\": ..., \"path\": ...}. Requests pick one by name (OpenAI model field, "
        "base:NAME, or lora_path on /generate).", flags=("--lora-modules",))
    max_loras_per_batch: int = opt(
        8, "Most distinct adapters in one step (the base model does not count): requests for a "
        "further adapter wait until one of the running adapters has no request left. 8 as in SGLang; "
        "each adapter in a step costs two small GEMMs per targeted layer.")
    max_lora_rank: int = opt(
        64, "Largest adapter rank accepted; a larger one is refused at load (400). Memory grows "
        "with the rank of the adapters actually loaded, not with this limit.")
    lora_target_modules: list[str] | None = opt(
        None, "Projections adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, the fused qkv_proj and gate_up_proj, or all); an adapter targeting another is "
        "refused at load. Unset: all.")
    max_loaded_loras: int | None = opt(
        None, "Most adapters held in memory. Past it the least recently used adapter with no "
        "running request is dropped from memory and read again from disk when a request for it "
        "is admitted. Unset: no limit. At least --max-loras-per-batch.")
    lora_eviction_policy: str = opt(
        "lru", "Which adapter --max-loaded-loras drops first: lru (least recently used) or fifo "
        "(loaded first).", choices=["lru", "fifo"])
    lora_dtype: str = opt(
        "auto", "Dtype of the adapter weights and their deltas. auto: the model's dtype.",
        choices=["auto", "float32", "float16", "bfloat16"])

    def __post_init__(self) -> None:
        sources = self.sources  # raises on a malformed entry
        names = [source.name for source in sources]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"--lora-paths names {', '.join(duplicates)} more than once")
        for name in names:
            if ":" in name:
                raise ValueError(f"--lora-paths: adapter name {name!r} must not contain ':' "
                                 "(requests pick an adapter with model: 'base:adapter')")
        if not self.is_enabled:
            for name in ("max_loras_per_batch", "max_lora_rank", "lora_target_modules",
                         "max_loaded_loras", "lora_eviction_policy", "lora_dtype"):
                if getattr(self, name) != _default_of(LoRAConfig, name):
                    raise ValueError(f"{_flag(name)} has no effect without --enable-lora (or "
                                     "--lora-paths); add --enable-lora or drop it")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be at least 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras ({self.max_loaded_loras}) must be at least "
                             f"--max-loras-per-batch ({self.max_loras_per_batch})")
        for module in self.lora_target_modules or ():
            if module != "all" and module not in LORA_TARGET_MODULES:
                raise ValueError(f"--lora-target-modules {module!r} is not supported; choose from "
                                 f"{', '.join(LORA_TARGET_MODULES)} or all")

    @property
    def is_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @property
    def sources(self) -> list[LoRASource]:
        """The start-up adapters, parsed."""
        return [LoRASource.parse(text) for text in self.lora_paths or ()]

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The projections adapters may target: a fused name allows its parts and the parts
        together allow the fused name."""
        modules = set(self.lora_target_modules or ["all"])
        if "all" in modules:
            return LORA_TARGET_MODULES
        for fused, parts in _FUSED_LORA_TARGETS.items():
            if fused in modules:
                modules.update(parts)
            elif modules.issuperset(parts):
                modules.add(fused)
        return tuple(m for m in LORA_TARGET_MODULES if m in modules)


def _default_of(section: type, name: str) -> Any:
    field_ = section.__dataclass_fields__[name]  # type: ignore[attr-defined]
    if field_.default is not dataclasses.MISSING:
        return field_.default
    return field_.default_factory()


ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
"""--spec-decoding-acceptance-method values (vLLM's names)."""
TYPICAL_POSTERIOR_THRESHOLD = 0.09
"""vLLM's default epsilon of typical acceptance."""
TYPICAL_POSTERIOR_ALPHA = 0.3
"""vLLM's default delta of typical acceptance."""

EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
"""Algorithms whose --speculative-draft-model-path is a draft head over the model's hidden states."""
HEAD_ALGORITHMS = (*EAGLE_ALGORITHMS, "NEXTN")
"""Algorithms whose draft is a head over the model's hidden states (the EAGLE proposer): a head
checkpoint's, or the model's own multi-token-prediction layer (NEXTN)."""

DEFAULT_NUM_SPECULATIVE_TOKENS = 5
"""Drafts per step when neither --num-speculative-tokens nor --speculative-num-steps is given."""
NGRAM_ADAPTIVE_MAX_DRAFT_TOKENS = 24
"""Most drafts of the adaptive n-gram proposer when --num-speculative-tokens is not given: on a
copied run a 25-row verify step costs ~5x a 1-row step on a CPU (benchmarks/RESULTS.md), so long
accepted drafts pay, and the proposer only drafts that long where the text matched that long."""

NGRAM_MODEL = "[ngram]"
"""vLLM's --speculative-model value for prompt lookup (a path otherwise)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens and the model verifies them in one pass."""

    speculative_algorithm: str | None = opt(
        None, "Speculative decoding algorithm. NGRAM: prompt lookup (drafts copied from earlier "
        "in the prompt and output; no extra model), verified exactly (greedy output is unchanged, "
        "sampling keeps the model's distribution). Off by default: it pays when outputs repeat "
        "their input (edits, code, extraction) and costs a little elsewhere. STANDALONE: a smaller "
        "model with the same tokenizer drafts (--speculative-draft-model-path; implied when only a "
        "draft model is given). EAGLE / EAGLE3: a draft head in the EAGLE-1 / EAGLE-3 checkpoint "
        "format (--speculative-draft-model-path) reads the model's hidden states and drafts a chain "
        "(topk 1). NEXTN: the model's own multi-token-prediction layer (DeepSeek-V3/R1's MTP, read "
        "from --model's checkpoint) drafts like an EAGLE head, applied again for each of "
        "--speculative-num-steps drafts; a model without one is refused at start-up.",
        choices=["NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
    num_speculative_tokens: int | None = opt(
        None, "Most draft tokens verified per request per step (k; the step computes k + 1 "
        "positions of the request; an EAGLE tree's node count). Unset: --speculative-num-steps for "
        f"a chain, steps x topk for a tree, else {DEFAULT_NUM_SPECULATIVE_TOKENS}: on a CPU a "
        "6-token step costs little more than a 1-token one, and copied runs are often longer.")
    ngram_prompt_lookup_max: int = opt(
        16, "NGRAM: longest suffix (tokens) matched against earlier text; the earlier place with "
        "the longest match is drafted from. 16 tells apart repeated code lines by the lines "
        "before them (4 drafted from the wrong copy of a repeated line: a third fewer tokens per "
        "step on a copied file, benchmarks/RESULTS.md).")
    ngram_prompt_lookup_min: int = opt(
        2, "NGRAM: shortest suffix (tokens) matched. 2 rather than 1: a single-token match (a "
        "space, a bracket) rarely predicts what follows and only wastes verification work.")
    ngram_draft_length: str = opt(
        "adaptive", "NGRAM: how many tokens a request drafts per step. adaptive: at most as many "
        "as its text has matched the earlier place (a long match in a copied file, a short one by "
        "chance in prose) and as its recent drafts earned (the cap doubles after a draft accepted "
        "whole and halves after one cut short), up to --num-speculative-tokens (unset: "
        f"{NGRAM_ADAPTIVE_MAX_DRAFT_TOKENS}): a verify step costs the model a row per draft, so "
        "weak matches decode plainly and copied runs draft long. fixed: always "
        f"--num-speculative-tokens (unset: {DEFAULT_NUM_SPECULATIVE_TOKENS}) tokens after the "
        "match, as vLLM's prompt lookup.", choices=["adaptive", "fixed"])
    speculative_draft_model_path: str | None = opt(
        None, "STANDALONE: the draft model (a local checkpoint directory, .gguf or packaged name, "
        "as --model takes) that must share the model's tokenizer; it runs in the engine process "
        "with its own KV pool, a share of the KV budget. EAGLE / EAGLE3: the head checkpoint "
        "directory (config.json with architectures LlamaForCausalLMEagle / LlamaForCausalLMEagle3 "
        "and its weights), trained for this model. vLLM's --speculative-model also takes [ngram] "
        "here (prompt lookup).")
    speculative_eagle_topk: int | None = opt(
        None, "EAGLE / EAGLE3 / NEXTN: drafts kept per head step. 1 (or unset): a chain of drafts. K > 1: a "
        "tree: each of --speculative-num-steps head steps expands the K best frontier nodes into "
        "their K best children, and the --num-speculative-tokens (SGLang: --speculative-num-draft-"
        "tokens N, i.e. N - 1) candidates of best cumulative head log-probability are verified in "
        "one pass with a tree attention mask; the model's token at each node picks the branch.")
    speculative_num_steps: int | None = opt(
        None, "Draft steps (the depth of what is drafted, SGLang's --speculative-num-steps): a "
        "chain drafts this many (at most --num-speculative-tokens when both are given), an EAGLE "
        "tree (--speculative-eagle-topk > 1) grows this deep. Unset: --num-speculative-tokens for "
        "a chain; required for a tree.")
    speculative_token_map: str | None = opt(
        None, "EAGLE: a reduced draft vocabulary (FR-Spec's hot tokens): a torch file (.pt) holding "
        "a 1-D tensor of model token ids; the head scores only these through a slice of the "
        "model's LM head, so its drafts are always among them. EAGLE-3 heads carry their own (d2t).")
    speculative_disable_by_batch_size: int | None = opt(
        None, "Draft nothing in a step where at least this many requests are running: large "
        "batches already use the compute that speculation would use. None: always speculate.")
    spec_decoding_acceptance_method: str = opt(
        "rejection_sampler", "How the drafts of a sampling (temperature > 0) request are verified. "
        "rejection_sampler: exact rejection sampling, the output follows the model's distribution. "
        "typical_acceptance_sampler: vLLM's typical acceptance (MEDUSA): a draft token is kept when "
        "the model gives it a probability above min(--typical-acceptance-sampler-posterior-threshold, "
        "--typical-acceptance-sampler-posterior-alpha x exp(-entropy of the model's distribution)), "
        "and at the first one refused the model's most likely token is emitted: longer accepted "
        "runs, but the output no longer follows the model's distribution exactly. Greedy requests "
        "are token for token plain decoding with either.",
        choices=list(ACCEPTANCE_METHODS))
    typical_acceptance_sampler_posterior_threshold: float | None = opt(
        None, "typical_acceptance_sampler: the highest probability a draft token ever needs to be "
        f"kept (epsilon). Unset: {TYPICAL_POSTERIOR_THRESHOLD}, vLLM's default.")
    typical_acceptance_sampler_posterior_alpha: float | None = opt(
        None, "typical_acceptance_sampler: the scale of the entropy-based bound, alpha x "
        "exp(-entropy) (delta; a flat distribution lowers the bar). Unset: "
        f"{TYPICAL_POSTERIOR_ALPHA}, vLLM's default (about the square root of the threshold).")

    def __post_init__(self) -> None:
        self._resolve_draft_model()
        self._check_eagle()
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be at least 1, got "
                             f"{self.speculative_num_steps}")
        self._check_tree()
        if self.ngram_prompt_lookup_min < 1:
            raise ValueError(f"--ngram-prompt-lookup-min must be at least 1, got "
                             f"{self.ngram_prompt_lookup_min}")
        if self.ngram_prompt_lookup_max < self.ngram_prompt_lookup_min:
            raise ValueError(f"--ngram-prompt-lookup-max ({self.ngram_prompt_lookup_max}) must be at "
                             f"least --ngram-prompt-lookup-min ({self.ngram_prompt_lookup_min})")
        if self.ngram_draft_length not in ("adaptive", "fixed"):
            raise ValueError(f"--ngram-draft-length must be adaptive or fixed, got "
                             f"{self.ngram_draft_length!r}")
        if self.speculative_disable_by_batch_size is not None and \
                self.speculative_disable_by_batch_size < 1:
            raise ValueError(f"--speculative-disable-by-batch-size must be at least 1, got "
                             f"{self.speculative_disable_by_batch_size}")
        self._check_acceptance_method()

    def _resolve_draft_model(self) -> None:
        """vLLM's --speculative-model and LightLLM's --mtp_draft_model_dir give only a model: a
        path implies STANDALONE and [ngram] means NGRAM, settled here while the config is built
        (so --dry-run prints the algorithm it runs)."""
        path = self.speculative_draft_model_path
        algorithm = self.speculative_algorithm
        if algorithm == "NEXTN" and path is not None:
            raise ValueError("--speculative-algorithm NEXTN drafts with the MTP layer in --model's own "
                             f"checkpoint; --speculative-draft-model-path {path!r} would not be read: "
                             "leave it out")
        if algorithm in EAGLE_ALGORITHMS:
            if path is None or path.strip().lower() in (NGRAM_MODEL, "ngram"):
                raise ValueError(f"--speculative-algorithm {algorithm} needs its head checkpoint: "
                                 "--speculative-draft-model-path PATH")
            return
        if path is None:
            if algorithm == "STANDALONE":
                raise ValueError("--speculative-algorithm STANDALONE needs a draft model: "
                                 "--speculative-draft-model-path PATH")
            return
        if path.strip().lower() in (NGRAM_MODEL, "ngram"):
            if algorithm not in (None, "NGRAM"):
                raise ValueError(f"--speculative-model [ngram] contradicts --speculative-algorithm "
                                 f"{algorithm}; give only one of them")
            object.__setattr__(self, "speculative_algorithm", "NGRAM")
            object.__setattr__(self, "speculative_draft_model_path", None)
            return
        if algorithm is None:
            object.__setattr__(self, "speculative_algorithm", "STANDALONE")
        elif algorithm != "STANDALONE":
            raise ValueError(f"--speculative-draft-model-path is the STANDALONE draft model; it "
                             f"contradicts --speculative-algorithm {algorithm}")

    def _check_eagle(self) -> None:
        is_head = self.speculative_algorithm in HEAD_ALGORITHMS
        topk = self.speculative_eagle_topk
        if topk is not None:
            if not is_head:
                raise ValueError(f"--speculative-eagle-topk applies to EAGLE / EAGLE3 / NEXTN heads, not "
                                 f"--speculative-algorithm {self.speculative_algorithm}")
            if topk < 1:
                raise ValueError(f"--speculative-eagle-topk must be at least 1, got {topk}")
        if self.speculative_token_map is not None and self.speculative_algorithm != "EAGLE":
            raise ValueError("--speculative-token-map applies to EAGLE heads (an EAGLE-3 head carries "
                             f"its own reduced vocabulary), not --speculative-algorithm "
                             f"{self.speculative_algorithm}")

    @property
    def is_enabled(self) -> bool:
        return self.speculative_algorithm is not None

    def _check_tree(self) -> None:
        """A tree (topk > 1) needs its depth, and cannot verify more nodes than it proposes."""
        topk = self.speculative_eagle_topk or 1
        if topk == 1:
            return
        steps = self.speculative_num_steps
        if steps is None:
            raise ValueError(f"--speculative-eagle-topk {topk} drafts a tree: give its depth with "
                             "--speculative-num-steps")
        num_candidates = topk + (steps - 1) * topk * topk
        if self.max_draft_tokens > num_candidates:
            raise ValueError(
                f"--num-speculative-tokens {self.max_draft_tokens} (SGLang's "
                f"--speculative-num-draft-tokens {self.max_draft_tokens + 1}) exceeds the "
                f"{num_candidates} candidates a tree of --speculative-num-steps {steps} and "
                f"--speculative-eagle-topk {topk} proposes (K + (steps - 1) K^2): give at most "
                f"{num_candidates} (--speculative-num-draft-tokens {num_candidates + 1})")

    @property
    def is_tree(self) -> bool:
        """EAGLE drafts trees (--speculative-eagle-topk > 1)."""
        return (self.speculative_eagle_topk or 1) > 1

    @property
    def max_draft_tokens(self) -> int:
        """Drafts verified per request per step: a tree's node count, a chain's length (cut to
        --speculative-num-steps when given)."""
        given, steps = self.num_speculative_tokens, self.speculative_num_steps
        if self.is_tree:
            assert steps is not None and self.speculative_eagle_topk is not None
            return given if given is not None else steps * self.speculative_eagle_topk
        if given is None and steps is None and self.speculative_algorithm == "NGRAM" \
                and self.ngram_draft_length == "adaptive":
            return NGRAM_ADAPTIVE_MAX_DRAFT_TOKENS
        if given is None:
            return steps if steps is not None else DEFAULT_NUM_SPECULATIVE_TOKENS
        return given if steps is None else min(given, steps)

    @property
    def max_draft_positions(self) -> int:
        """Draft-side KV positions written past the accepted text per step (a tree's head writes
        its frontier entries: (steps - 1) x topk)."""
        if not self.is_tree:
            return self.max_draft_tokens
        assert self.speculative_num_steps is not None and self.speculative_eagle_topk is not None
        return max(self.max_draft_tokens,
                   (self.speculative_num_steps - 1) * self.speculative_eagle_topk)

    @property
    def is_typical_acceptance(self) -> bool:
        return self.spec_decoding_acceptance_method == "typical_acceptance_sampler"

    @property
    def posterior_threshold(self) -> float:
        """typical_acceptance_sampler's epsilon (the flag, or vLLM's default)."""
        value = self.typical_acceptance_sampler_posterior_threshold
        return TYPICAL_POSTERIOR_THRESHOLD if value is None else value

    @property
    def posterior_alpha(self) -> float:
        """typical_acceptance_sampler's delta (the flag, or vLLM's default)."""
        value = self.typical_acceptance_sampler_posterior_alpha
        return TYPICAL_POSTERIOR_ALPHA if value is None else value

    def _check_acceptance_method(self) -> None:
        """Typical acceptance needs speculation, and its two knobs need typical acceptance
        (a flag is never accepted and ignored)."""
        method = self.spec_decoding_acceptance_method
        if method not in ACCEPTANCE_METHODS:
            raise ValueError(f"--spec-decoding-acceptance-method must be one of "
                             f"{', '.join(ACCEPTANCE_METHODS)}, got {method!r}")
        knobs = {"--typical-acceptance-sampler-posterior-threshold":
                 self.typical_acceptance_sampler_posterior_threshold,
                 "--typical-acceptance-sampler-posterior-alpha":
                 self.typical_acceptance_sampler_posterior_alpha}
        for flag, value in knobs.items():
            if value is None:
                continue
            if not self.is_typical_acceptance:
                raise ValueError(f"{flag} sets typical acceptance; it needs "
                                 "--spec-decoding-acceptance-method typical_acceptance_sampler")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag} must be a positive number, got {value}")
        if self.is_typical_acceptance and not self.is_enabled:
            raise ValueError("--spec-decoding-acceptance-method typical_acceptance_sampler verifies "
                             "speculative drafts; it needs --speculative-algorithm (or "
                             "--speculative-model)")


DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("zmq", "shm", "nixl", "mooncake")
_TRANSFER_PACKAGES = {"nixl": "--no-deps nixl nixl-cu12",
                      "mooncake": "mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"}
"""Transfer backends that need a package: the pip arguments a missing one is installed with."""
_TRANSFER_MODULES = {"nixl": ("nixl", "nixl_cu12"), "mooncake": ("mooncake",)}
"""The modules any of which provides the backend's library."""
_BUILT_TRANSFER_BACKENDS = ("zmq", "shm", "nixl", "mooncake")
_VLLM_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
_VLLM_CONNECTORS = {"ZmqConnector": "zmq", "ShmConnector": "shm", "NixlConnector": "nixl",
                    "MooncakeConnector": "mooncake", "MooncakeConnectorV1": "mooncake"}
"""vLLM --kv-transfer-config kv_connector names servelm maps onto a transfer backend (ZmqConnector
and ShmConnector are servelm's own names for its zmq and shm backends)."""


def parse_kv_transfer_config(text: str | None) -> tuple[str, str] | None:
    """vLLM's ``--kv-transfer-config`` JSON -> (disaggregation mode, transfer backend), or None
    when unset. ValueError naming the flag and key for what servelm does not map."""
    values = parse_json_object_flag("--kv-transfer-config", text)
    if not values:
        return None
    role = values.get("kv_role")
    if role == "kv_both":
        raise ValueError("--kv-transfer-config: kv_role kv_both is not supported: servelm gives each "
                         "server one role; use kv_producer on the prefill server and kv_consumer "
                         "on the decode server")
    if role not in _VLLM_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be kv_producer or kv_consumer, got {role!r}")
    connector = values.get("kv_connector", "ZmqConnector")
    if connector not in _VLLM_CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not supported; choose "
                         f"{', '.join(_VLLM_CONNECTORS)} (ZmqConnector: TCP with pyzmq, "
                         "servelm's default)")
    unknown = set(values) - {"kv_role", "kv_connector", "engine_id", "kv_rank", "kv_parallel_size",
                             "kv_buffer_device", "kv_connector_extra_config"}
    if unknown:
        raise ValueError(f"--kv-transfer-config: {sorted(unknown)} not supported")
    return _VLLM_ROLES[role], _VLLM_CONNECTORS[connector]


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation: a prefill server computes prompts and hands their K/V to a
    decode server, which decodes (servelm/disagg/)."""

    disaggregation_mode: str = opt(
        "null", "This server's role: null (co-located: it prefills and decodes), prefill (computes a "
        "request's prompt K/V and first token, then hands them to the decode server the request "
        "names) or decode (receives the K/V from the prefill server the request names, then "
        "decodes). SGLang's protocol (bootstrap_host/port/room in the request) and vLLM's "
        "kv_transfer_params both work.", choices=list(DISAGGREGATION_MODES))
    disaggregation_bootstrap_port: int = opt(
        8998, "Prefill server: TCP port of its bootstrap/transfer endpoint (a pyzmq ROUTER socket); "
        "decode servers connect to it to ask for K/V. 8998 is SGLang's default.")
    disaggregation_transfer_backend: str = opt(
        "zmq", "How K/V blocks move: zmq (TCP with pyzmq, across machines), shm (the bytes through "
        "a file in /dev/shm: prefill and decode on one host), nixl (NVIDIA NIXL over UCX: the "
        "prefill server writes the blocks straight into the decode server's registered pool; "
        "pip install --no-deps nixl nixl-cu12), mooncake (Mooncake's transfer engine over TCP, "
        "writing likewise; pip install mooncake-transfer-engine-non-cuda, apt-get install "
        "libibverbs1). Control messages always use the bootstrap zmq socket; both servers must "
        "name the same backend (zmq and shm mix).", choices=list(TRANSFER_BACKENDS))
    disaggregation_ib_device: str | None = opt(
        None, "The network devices for K/V: nixl: UCX's (NIXL's ucx_devices, e.g. mlx5_0:1 or "
        "mlx5_0:1,mlx5_1:1; unset: UCX picks, and skips InfiniBand on a host without RDMA "
        "devices); mooncake: the transfer engine's device name (e.g. mlx5_0). Only with "
        "--disaggregation-transfer-backend nixl or mooncake.")
    disaggregation_transfer_timeout: float = opt(
        30.0, "Seconds a transfer may take: a decode server that gets no K/V in this time ends "
        "the request with an error; a prefill server frees K/V nobody pulled in this time.")
    disaggregation_decode_tp: int | None = opt(
        None, "Prefill server: the decode servers' --tp-size, as in SGLang (unset: this server's "
        "own --tp-size). A transfer carries every KV head whatever either side's tp, and each "
        "side splits the heads over its own ranks; a pull from a decode server of another tp is "
        "refused with an error naming both sizes.")
    disaggregation_decode_dp: int = opt(
        1, "Prefill server: the decode servers' data-parallel size. Only 1: one engine process "
        "per decode server; run several decode servers behind `servelm router` instead.")
    disaggregation_prefill_pp: int = opt(
        1, "Decode server: the prefill servers' pipeline-parallel size. Only 1: a prefill server "
        "has no --pp-size > 1.")
    num_reserved_decode_tokens: int = opt(
        512, "Decode server: a transfer is accepted only while the pool keeps this many tokens "
        "free per running request beyond the prompt's blocks (room to decode), as SGLang's flag "
        "does.")
    disaggregation_decode_polling_interval: int = opt(
        1, "Decode server: poll the transfer sockets every N steps while requests decode (1: "
        "every step).")
    kv_transfer_config: str | None = opt(
        None, "vLLM's JSON form: kv_role kv_producer (prefill) or kv_consumer (decode), kv_connector "
        "ZmqConnector, ShmConnector, NixlConnector or MooncakeConnector. Sets the mode and backend.")
    pd_master_ip: str | None = opt(
        None, "LightLLM: host of the PD master (`servelm router`) a prefill or decode server "
        "registers with at start-up (POST /register). Unset: no registration.")
    pd_master_port: int = opt(1212, "LightLLM: port of the PD master (1212 is LightLLM's default).")

    def __post_init__(self) -> None:
        vllm = parse_kv_transfer_config(self.kv_transfer_config)
        if vllm is not None:
            if self.disaggregation_mode != "null" and self.disaggregation_mode != vllm[0]:
                raise ValueError(f"--kv-transfer-config asks for {vllm[0]} but --disaggregation-mode "
                                 f"is {self.disaggregation_mode}")
            if self.disaggregation_transfer_backend not in ("zmq", vllm[1]):
                raise ValueError(f"--kv-transfer-config asks for backend {vllm[1]} but "
                                 f"--disaggregation-transfer-backend is "
                                 f"{self.disaggregation_transfer_backend}")
        if self.disaggregation_decode_dp != 1:
            raise ValueError(f"--disaggregation-decode-dp {self.disaggregation_decode_dp} is not "
                             "supported: a decode server is one engine (--dp-size 1); data "
                             "parallelism of PD servers is the router's (several decode servers "
                             "behind `servelm router`); only 1")
        if self.disaggregation_prefill_pp != 1:
            raise ValueError(f"--disaggregation-prefill-pp {self.disaggregation_prefill_pp} is not "
                             "supported: prefill servers run --pp-size 1; only 1")
        if self.disaggregation_decode_tp is not None:
            if self.disaggregation_decode_tp < 1:
                raise ValueError(f"--disaggregation-decode-tp must be at least 1, got "
                                 f"{self.disaggregation_decode_tp}")
            if self.mode != "prefill":
                raise ValueError("--disaggregation-decode-tp is a prefill server's flag (the "
                                 "decode servers' --tp-size); give it with --disaggregation-mode "
                                 "prefill")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be a TCP port, got "
                             f"{self.disaggregation_bootstrap_port}")
        if not 0 < self.pd_master_port < 65536:
            raise ValueError(f"--pd-master-port must be a TCP port, got {self.pd_master_port}")
        if self.disaggregation_transfer_timeout <= 0:
            raise ValueError(f"--disaggregation-transfer-timeout must be positive, got "
                             f"{self.disaggregation_transfer_timeout}")
        if self.num_reserved_decode_tokens < 0:
            raise ValueError(f"--num-reserved-decode-tokens must be non-negative, got "
                             f"{self.num_reserved_decode_tokens}")
        if self.disaggregation_decode_polling_interval < 1:
            raise ValueError(f"--disaggregation-decode-polling-interval must be at least 1, got "
                             f"{self.disaggregation_decode_polling_interval}")
        if self.disaggregation_ib_device is not None and self.transfer_backend not in ("nixl",
                                                                                        "mooncake"):
            raise ValueError("--disaggregation-ib-device chooses the nixl or mooncake backend's "
                             f"devices; --disaggregation-transfer-backend {self.transfer_backend} "
                             "uses none")
        self._check_backend()

    def _check_backend(self) -> None:
        backend = self.transfer_backend
        if backend not in _TRANSFER_PACKAGES:
            return
        import importlib.util

        if all(importlib.util.find_spec(module) is None for module in _TRANSFER_MODULES[backend]):
            raise ValueError(f"--disaggregation-transfer-backend {backend} needs its package: pip "
                             f"install {_TRANSFER_PACKAGES[backend]} (or use zmq, the default, or "
                             "shm on one host)")
        if backend in _BUILT_TRANSFER_BACKENDS:
            return
        raise ValueError(f"--disaggregation-transfer-backend {backend}: the package is installed but "
                         "servelm has no transfer over it; use zmq (TCP) or shm")

    @property
    def mode(self) -> str:
        """null, prefill or decode: --disaggregation-mode, or the role --kv-transfer-config gives."""
        vllm = parse_kv_transfer_config(self.kv_transfer_config)
        return vllm[0] if vllm is not None else self.disaggregation_mode

    @property
    def transfer_backend(self) -> str:
        vllm = parse_kv_transfer_config(self.kv_transfer_config)
        if vllm is not None and self.disaggregation_transfer_backend == "zmq":
            return vllm[1]
        return self.disaggregation_transfer_backend

    @property
    def is_enabled(self) -> bool:
        return self.mode != "null"


MM_MODALITIES = ("image", "video", "audio")
"""Modalities --limit-mm-per-prompt may name (vLLM's); only images are served here."""
DEFAULT_IMAGES_PER_PROMPT = 16
CONTENT_FORMATS = ("auto", "string", "openai")


def parse_mm_limits(text: str | None) -> dict[str, int]:
    """``--limit-mm-per-prompt`` in vLLM's spellings, ``{"image": 2}`` or ``image=2,video=0``, as
    {modality: limit}; ValueError naming the flag for anything else."""
    if not text:
        return {}
    flag = "--limit-mm-per-prompt"
    if text.strip().startswith("{"):
        raw: dict[str, Any] = parse_json_object_flag(flag, text)
    else:
        raw = {}
        for item in text.split(","):
            key, equals, value = item.partition("=")
            if not equals:
                raise ValueError(f"{flag}: expected MODALITY=N items or a JSON object, got {text!r}")
            raw[key.strip()] = value.strip()
    limits: dict[str, int] = {}
    for key, value in raw.items():
        if key not in MM_MODALITIES:
            raise ValueError(f"{flag}: unknown modality {key!r}; choose from {', '.join(MM_MODALITIES)}")
        try:
            number = int(value) if not isinstance(value, bool) else -1
        except (TypeError, ValueError):
            number = -1
        if number < 0 or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{flag}: {key} needs a count (an integer >= 0), got {value!r}")
        if key != "image" and number > 0:
            raise ValueError(f"{flag}: {key} inputs are not supported (servelm's multimodal models "
                             f"take images only); give {key}=0 or leave it out")
        limits[key] = number
    return limits


@dataclass(frozen=True)
class MultimodalConfig:
    """Images in requests: where they may come from, how many and how large, how chat templates
    see them, and the engine's cache of encoded images."""

    enable_multimodal: bool | None = opt(
        None, "Accept images. Default: on when the model has a vision tower (as vLLM and SGLang "
        "do); --enable-multimodal makes start-up fail on a text-only model instead of serving it "
        "without images; --no-enable-multimodal serves a vision-language model text-only.",
        flags=("--enable_multimodal",), negatable=True)
    limit_mm_per_prompt: str | None = opt(
        None, "Most images in one prompt, in vLLM's syntax: '{\"image\": 2}' or image=2 (0 refuses "
        f"images). Default {DEFAULT_IMAGES_PER_PROMPT}: each image costs hundreds of prompt tokens "
        "and its decoding memory. Video and audio are not served (only 0 is accepted).")
    mm_processor_kwargs: str | None = opt(
        None, "JSON object of image-processor settings that override the model's "
        "preprocessor_config.json (e.g. '{\"do_pan_and_scan\": true}'); start-up fails when the "
        "model's processor does not take them (never ignored).")
    allowed_local_media_path: str | None = opt(
        None, "A directory whose files requests may name as file:// image URLs (symlinks and '..' "
        "out of it are refused). Off by default: a request could otherwise read any file the "
        "server can.")
    allowed_media_domains: list[str] | None = opt(
        None, "Hosts whose http(s) image URLs the server fetches (exact host names). Off by "
        "default: fetching a URL a client names lets it reach hosts the server can reach.")
    media_fetch_timeout_s: float = opt(
        5.0, "Seconds fetching one image URL may take, body included (vLLM's default).")
    max_image_bytes: int = opt(
        20 * 1024 * 1024, "Largest encoded image, in bytes (a 48-megapixel phone JPEG is ~15 MB).")
    max_image_pixels: int = opt(
        50_000_000, "Largest image in pixels (width x height), checked from the image header "
        "before decoding, so a small file declaring a huge image (a decompression bomb) is "
        "refused without allocating it; 50 M holds any camera photo, decoded as ~150 MB RGB.")
    chat_template_content_format: str = opt(
        "auto", "How message content reaches the chat template: openai gives content-part lists "
        "([{type: text, text}, {type: image}], what vision-language templates iterate), string "
        "joins the parts into one string (an image becomes the model's image marker text); auto "
        "picks openai for messages with images when the template iterates content, else string.",
        choices=list(CONTENT_FORMATS))
    encoder_cache_capacity: int = opt(
        200, "Images whose vision-tower output the engine keeps, keyed by the image's digest, so a "
        "repeated image is not encoded again (least recently used dropped first); 0 turns the "
        "cache off. LightLLM's --cache_capacity and its default (~250 MB for Gemma 3 4B in bf16).")

    def __post_init__(self) -> None:
        parse_mm_limits(self.limit_mm_per_prompt)
        parse_json_object_flag("--mm-processor-kwargs", self.mm_processor_kwargs)
        path = self.allowed_local_media_path
        if path is not None:
            import os

            if not os.path.isdir(path):
                raise ValueError(f"--allowed-local-media-path {path!r} is not a directory")
        for domain in self.allowed_media_domains or ():
            if not domain or any(c in domain for c in "/:@ ") or domain.startswith("."):
                raise ValueError(f"--allowed-media-domains takes host names (example.com), got "
                                 f"{domain!r}")
        if self.media_fetch_timeout_s <= 0:
            raise ValueError(f"--media-fetch-timeout-s must be positive, got {self.media_fetch_timeout_s}")
        if self.max_image_bytes <= 0 or self.max_image_pixels <= 0:
            raise ValueError("--max-image-bytes and --max-image-pixels must be positive")
        if self.encoder_cache_capacity < 0:
            raise ValueError(f"--encoder-cache-capacity must be >= 0, got {self.encoder_cache_capacity}")

    @property
    def images_per_prompt(self) -> int:
        """Most images one prompt may carry (0: images refused)."""
        return parse_mm_limits(self.limit_mm_per_prompt).get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def processor_kwargs(self) -> dict[str, Any]:
        """--mm-processor-kwargs as a dict ({} when unset)."""
        return parse_json_object_flag("--mm-processor-kwargs", self.mm_processor_kwargs)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine and server need, one frozen dataclass per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)

    def __post_init__(self) -> None:
        if self.model.quantization in REFUSED_QUANTIZATION:
            raise ValueError(f"--quantization {self.model.quantization} is not supported: "
                             f"{REFUSED_QUANTIZATION[self.model.quantization]}")
        if self.runtime.enable_torch_compile and self.model.quantization not in ("none", "auto"):
            raise ValueError(
                f"--enable-torch-compile cannot be combined with --quantization "
                f"{self.model.quantization}: inductor's fused norms and activation scaling differ "
                "from eager in the last bit, the int8 rounding of the activations turns that into "
                "different greedy outputs, and w8a8_int8 measured slower compiled; use one or the other")
        if self.model.quantization == "experts_int8" and self.parallel.enable_eplb:
            raise ValueError("--quantization experts_int8 cannot be combined with --enable-eplb: rebalancing moves "
                             "float expert stacks between ranks, and experts_int8 replaces them by int8 weights")
        self._check_torch_compile()
        self._check_lora()
        self._check_hicache()
        self._check_disaggregation()
        self._check_dp_attention()
        if self.runtime.enable_deterministic_inference:
            if self.speculative.is_enabled:
                raise ValueError("--enable-deterministic-inference runs one token per forward pass; "
                                 "speculative decoding verifies its drafts in one pass, and what it "
                                 "drafts depends on other passes: use one or the other")
            if self.runtime.enable_torch_compile:
                raise ValueError("--enable-deterministic-inference cannot be combined with "
                                 "--enable-torch-compile (compiled kernels are chosen per batch shape)")
        if (self.observability.debug_tensor_dump_output_folder is not None
                and self.parallel.pipeline_parallel_size > 1):
            raise ValueError("--debug-tensor-dump-output-folder dumps whole forward passes; a "
                             "pipeline stage (--pipeline-parallel-size > 1) runs part of one")

    def _check_hicache(self) -> None:
        """The hierarchical cache extends the radix cache of the in-process runner."""
        if not self.hicache.enable_hierarchical_cache:
            return
        if self.cache.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache extends the prefix cache; it cannot be "
                             "combined with --disable-radix-cache")
        if self.parallel.tensor_parallel_size > 1 or self.parallel.pipeline_parallel_size > 1:
            raise ValueError("--enable-hierarchical-cache needs the in-process runner (--tp-size 1 "
                             "--pp-size 1): the tiers copy blocks out of the engine process's "
                             "KV pool, and rank workers hold theirs in other processes")
        if self.model.is_embed_task:
            raise ValueError("--enable-hierarchical-cache serves generation; embedding requests "
                             "never use the prefix cache")

    def _check_disaggregation(self) -> None:
        """What a prefill or decode server cannot run with: K/V moves between tp ranks of one stage."""
        mode = self.disaggregation.mode
        if mode == "null":
            return
        parallel = self.parallel
        if parallel.data_parallel_size > 1:
            raise ValueError(f"--disaggregation-mode {mode} cannot be combined with --dp-size > 1: "
                             "data parallelism of PD servers is the router's job (start several "
                             "prefill or decode servers and list them all to `servelm router`)")
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(f"--disaggregation-mode {mode} cannot be combined with --pp-size > 1: "
                             "a transfer reads and writes one stage's KV pool (use --tp-size)")
        if parallel.tensor_parallel_size > 1 and (self.disaggregation.transfer_backend not in ("zmq", "shm")
                                                  or parallel.distributed_executor_backend != "mp"):
            raise ValueError(f"--disaggregation-mode {mode} with --tp-size > 1 moves K/V through "
                             "the engine process: it needs --disaggregation-transfer-backend zmq "
                             "or shm and --distributed-executor-backend mp")
        if self.model.is_embed_task:
            raise ValueError(f"--disaggregation-mode {mode} serves generation; it cannot be "
                             "combined with --task embed")
        if self.speculative.is_enabled and mode == "prefill":
            raise ValueError("--speculative-algorithm on a prefill server drafts nothing (it "
                             "samples one token per request); give it to the decode server")

    def _check_dp_attention(self) -> None:
        """What --enable-dp-attention runs without: each rank's forward covers only its own
        requests' rows, and rank 0 sees only its own rows' routing."""
        if not self.parallel.enable_dp_attention:
            return
        others = {
            "--speculative-algorithm": (self.speculative.is_enabled, "a draft and its verify pass "
                                        "would need the same split of the requests over the ranks"),
            "--disaggregation-mode": (self.disaggregation.is_enabled, "a K/V transfer reads and "
                                      "writes the engine process's pool, which holds rank 0's requests only"),
            "--enable-lora": (self.lora.is_enabled, "adapters are installed as tensor-parallel shards, "
                              "and DP attention's layers are whole on every rank"),
            "--task embed": (self.model.is_embed_task, "DP attention serves generation"),
            "--enable-eplb, --expert-distribution-recorder-mode, --enable-expert-distribution-metrics": (
                self.parallel.enable_eplb or self.observability.expert_distribution_recorder_mode is not None
                or self.observability.enable_expert_distribution_metrics,
                "rank 0 sees only its own requests' routing, so its counts are not the engine's"),
            "--debug-tensor-dump-output-folder": (self.observability.debug_tensor_dump_output_folder is not None,
                                                  "a rank's pass holds only its own requests' rows"),
        }
        for flag, (is_set, reason) in others.items():
            if is_set:
                raise ValueError(f"--enable-dp-attention cannot be combined with {flag}: {reason}")

    def _check_torch_compile(self) -> None:
        """What --enable-torch-compile cannot do: it compiles the in-process runner's decode steps."""
        if not self.runtime.enable_torch_compile:
            return
        if self.model.is_embed_task:
            raise ValueError("--enable-torch-compile compiles decode steps; an embedding model "
                             "(--task embed) has none, so nothing would be compiled")
        parallel = self.parallel
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError("--enable-torch-compile cannot be combined with --tp-size or --pp-size > 1: "
                             "the compiled decode graphs are built by the in-process runner only, and "
                             "the rank workers run their layers eagerly")

    def _check_lora(self) -> None:
        """LoRA's refusals per mode: what the adapters' per-row deltas cannot run with."""
        if not self.lora.is_enabled:
            return
        if self.model.is_embed_task:
            raise ValueError("--enable-lora serves generation; it cannot be combined with "
                             "--task embed")
        if self.parallel.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora cannot be combined with --pp-size > 1: adapters are "
                             "installed on the tensor-parallel ranks only; use --tp-size or --dp-size")
        for source in self.lora.sources:
            if source.name in (*self.model.served_names, self.model.model):
                raise ValueError(f"--lora-paths: adapter name {source.name!r} is the base model's "
                                 "name; give the adapter another name (NAME=PATH)")

    @staticmethod
    def sections() -> dict[str, type]:
        """Section name -> dataclass type, in CLI order."""
        hints = typing.get_type_hints(EngineConfig)  # resolves the postponed annotations
        return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}

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
