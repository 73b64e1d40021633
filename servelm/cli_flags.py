"""Catalogue of every command-line flag servelm recognises, including other engines' flags.

servelm follows the server arguments of SGLang, vLLM and LightLLM (../shared/seeds). Each of their
flags is in exactly one of four places:

- implemented: a field of a config dataclass in ``servelm.config`` (the flag is generated from it);
- ALIASES: another engine's spelling of one of our fields, possibly with a value transform;
- ALREADY_BEHAVIOUR: accepted because what the user asks for is already what this build does
  (``--disable-cuda-graph``: servelm never captures CUDA graphs). A flag that takes a value is
  accepted only with the listed values; any other value is rejected;
- REJECTIONS: rejected at start-up with the reason, grouped by reason.

Invariants: no flag string appears twice across these tables or collides with a generated field
flag (``check_catalogue`` enforces it, and the tests call it); nothing is accepted and ignored.
To implement a feature, add its config field and delete its flags from REJECTIONS (or turn the
REJECTIONS entry into an Alias).

``python -m servelm.cli_flags`` prints the catalogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelm.config import EngineConfig


class Unchanged:
    """Returned by an alias transform when the value asks for what the config already does."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = Unchanged()


@dataclass(frozen=True)
class Alias:
    """Another engine's flag that sets one of our fields."""

    flags: tuple[str, ...]
    field: str
    origin: str
    """Engines that spell it this way, for --help."""
    convert: Callable[[str], Any] | None = None
    """Raw string -> field value (raise ValueError with a reason); None: the field's own type.
    May return UNCHANGED: accepted, the config keeps its value, which must not be ``conflict``."""
    takes_value: bool = True
    const: Any = None
    """Value used when the flag takes no value, or when an optional value is left out."""
    optional_value: bool = False
    """vLLM's ``--flag [BOOL]`` form: the value may be left out (then ``const``)."""
    conflict: Any = None
    """With UNCHANGED: the field value the flag contradicts (an error if the config ends with it)."""
    example: tuple[str, ...] = ()
    """Arguments after the flag that change the config (used by the tests and the listing)."""
    note: str = ""
    metavar: str | None = None


@dataclass(frozen=True)
class AlreadyBehaviour:
    """A flag asking for what servelm already does; accepted and has nothing to change."""

    flags: tuple[str, ...]
    reason: str
    values: tuple[str, ...] | None = None
    """None: the flag takes no value. Otherwise the only values accepted (compared
    case-insensitively, numbers by value); others are rejected with ``reason``."""
    bad_value: str | None = None
    """A value that must be rejected (used by the tests)."""


@dataclass(frozen=True)
class Rejection:
    """Flags rejected at start-up, all for the same reason."""

    reason: str
    flags: tuple[str, ...]


# --- value transforms --------------------------------------------------------------------------

def parse_bool(text: str) -> bool:
    """'true'/'false' (and 1/0, yes/no, on/off), as vLLM's optional-bool flags take."""
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _chunked_prefill_switch(text: str) -> Any:
    # On by default here; "false" turns chunking off, which our field spells -1.
    return UNCHANGED if parse_bool(text) else -1


def _prefix_caching_switch(text: str) -> Any:
    # On by default here; "false" turns the prefix cache off (our field is its negation).
    return UNCHANGED if parse_bool(text) else True


def _lightllm_tokenizer_mode(text: str) -> str:
    modes = {"fast": "auto", "auto": "auto", "slow": "slow"}
    if text not in modes:
        raise ValueError(f"choose from fast, auto, slow; got {text!r}")
    return modes[text]


def _lightllm_data_type(text: str) -> str:
    dtypes = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
              "fp32": "float32", "float32": "float32"}
    if text not in dtypes:
        raise ValueError(f"choose from {', '.join(dtypes)}; got {text!r}")
    return dtypes[text]


def _lightllm_truncation(text: str) -> str:
    modes = {"None": "none", "none": "none", "head": "head", "center": "center"}
    if text not in modes:
        raise ValueError(f"choose from None, head, center; got {text!r}")
    return modes[text]


def _vllm_guided_backend(text: str) -> str:
    names = {"auto": "xgrammar", "xgrammar": "xgrammar", "guidance": "llguidance",
             "llguidance": "llguidance", "outlines": "outlines", "none": "none"}
    if text not in names:
        raise ValueError(f"{text!r} is not supported: choose xgrammar (or auto), outlines, "
                         "guidance or none")
    return names[text]


_INT4_GROUPS = ("32", "64", "128", "256")


def _torchao_config(text: str) -> str:
    if text == "int8dq":
        return "w8a8_int8"
    if text == "int8wo":
        return "int8wo"
    if text.startswith("int4wo-") and text.removeprefix("int4wo-") in _INT4_GROUPS:
        return text
    raise ValueError(f"choose from int8dq, int8wo, int4wo-<group> with group {'/'.join(_INT4_GROUPS)} "
                     f"(fp8 variants are not supported on CPU); got {text!r}")


def _lightllm_quant_type(text: str) -> str:
    if text == "none":
        return "none"
    if text in ("vllm-w8a8", "ao-int8dq"):
        return "w8a8_int8"
    if text == "ao-int8wo":
        return "int8wo"
    if text.startswith("ao-int4wo-") and text.removeprefix("ao-int4wo-") in _INT4_GROUPS:
        return text.removeprefix("ao-")
    raise ValueError("choose from none, vllm-w8a8, ao-int8dq (W8A8 dynamic int8), ao-int8wo, "
                     f"ao-int4wo-<group> with group {'/'.join(_INT4_GROUPS)}; got {text!r}")


# --- aliases -----------------------------------------------------------------------------------

ALIASES: tuple[Alias, ...] = (
    Alias(("--model-path",), "model", "SGLang", example=("some/model",)),
    Alias(("--model_dir",), "model", "LightLLM", example=("some/model",)),
    Alias(("--tokenizer-path",), "tokenizer", "SGLang", example=("some/tokenizer",)),
    Alias(("--tokenizer_mode",), "tokenizer_mode", "LightLLM", _lightllm_tokenizer_mode,
          example=("slow",), note="fast and auto -> auto", metavar="{slow,fast,auto}"),
    Alias(("--trust_remote_code",), "trust_remote_code", "LightLLM", takes_value=False, const=True),
    Alias(("--data_type",), "dtype", "LightLLM", _lightllm_data_type, example=("bf16",),
          note="fp16 -> float16, bf16 -> bfloat16, fp32 -> float32", metavar="{fp16,bf16,fp32,...}"),
    Alias(("--max-model-len",), "context_length", "vLLM", example=("2048",)),
    Alias(("--max_req_total_len",), "context_length", "LightLLM", example=("2048",),
          note="prompt + output tokens of one request: our context length"),
    Alias(("--json-model-override-args",), "hf_overrides", "SGLang", example=('{"rope_theta": 10000.0}',)),
    Alias(("--random-seed",), "seed", "SGLang", example=("7",)),
    Alias(("--model_name",), "served_model_name", "LightLLM", example=("my-model",)),
    Alias(("--block-size",), "page_size", "vLLM", example=("32",)),
    Alias(("--gpu-memory-utilization",), "mem_fraction_static", "vLLM", example=("0.5",),
          note="ours is the fraction of free memory after weights given to the KV pool"),
    Alias(("--mem_fraction",), "mem_fraction_static", "LightLLM", example=("0.5",)),
    Alias(("--max_total_token_num",), "max_total_tokens", "LightLLM", example=("4096",)),
    Alias(("--max-num-seqs",), "max_running_requests", "vLLM", example=("8",)),
    Alias(("--running_max_req_size",), "max_running_requests", "LightLLM", example=("8",)),
    Alias(("--max-num-batched-tokens",), "max_prefill_tokens", "vLLM", example=("2048",)),
    Alias(("--batch_max_tokens",), "max_prefill_tokens", "LightLLM", example=("2048",)),
    Alias(("--chunked_prefill_size", "--splitfuse_block_size"), "chunked_prefill_size", "LightLLM",
          example=("256",)),
    Alias(("--disable_chunked_prefill",), "chunked_prefill_size", "LightLLM", takes_value=False,
          const=-1),
    Alias(("--enable-chunked-prefill",), "chunked_prefill_size", "vLLM", _chunked_prefill_switch,
          optional_value=True, const="true", conflict=-1, example=("false",),
          note="on by default; false = --chunked-prefill-size -1", metavar="BOOL"),
    Alias(("--long_truncation_mode",), "long_truncation_mode", "LightLLM", _lightllm_truncation,
          example=("center",), note="None = none (reject long prompts)",
          metavar="{None,head,center}"),
    Alias(("--log_stats_interval",), "log_stats_interval", "LightLLM", example=("5",)),
    Alias(("--disable-log-stats", "--disable_log_stats"), "log_stats_interval", "vLLM, LightLLM",
          takes_value=False, const=0.0, note="no periodic stats line"),
    Alias(("--uvicorn-log-level",), "log_level_http", "vLLM", example=("warning",)),
    Alias(("--no-enable-prefix-caching", "--disable_dynamic_prompt_cache"), "disable_radix_cache",
          "vLLM, LightLLM", takes_value=False, const=True),
    Alias(("--enable-prefix-caching",), "disable_radix_cache", "vLLM", _prefix_caching_switch,
          optional_value=True, const="true", conflict=True, example=("false",),
          note="on by default; false = --disable-radix-cache", metavar="BOOL"),
    Alias(("--enable-prompt-tokens-details",), "enable_cache_report", "vLLM", takes_value=False,
          const=True),
    Alias(("--router_token_ratio",), "router_token_ratio", "LightLLM", example=("0.5",)),
    Alias(("--router_max_wait_tokens",), "router_max_wait_tokens", "LightLLM", example=("6",)),
    Alias(("--tp-size", "--tp", "-tp"), "tensor_parallel_size",
          "SGLang, vLLM, LightLLM", example=("2",)),
    Alias(("--disable_custom_allreduce",), "disable_custom_all_reduce", "LightLLM", takes_value=False,
          const=True),
    Alias(("-pp", "--pp-size"), "pipeline_parallel_size", "vLLM, SGLang", example=("2",)),
    Alias(("--dp-size", "--dp"), "data_parallel_size", "SGLang, LightLLM", example=("2",)),
    Alias(("--guided-decoding-backend",), "grammar_backend", "vLLM", _vllm_guided_backend,
          example=("none",), note="auto -> xgrammar, guidance -> llguidance"),
    Alias(("--output_constraint_mode",), "grammar_backend", "LightLLM", example=("none",)),
    Alias(("--tool_call_parser",), "tool_call_parser", "LightLLM", example=("qwen25",)),
    Alias(("--is-embedding",), "task", "SGLang", takes_value=False, const="embed",
          note="serve the model's pooled hidden states at /v1/embeddings"),
    Alias(("-q",), "quantization", "vLLM", example=("w8a8_int8",)),
    Alias(("--torchao-config",), "quantization", "SGLang", _torchao_config, example=("int8dq",),
          note="int8dq -> w8a8_int8; int8wo and int4wo-<group> (32/64/128/256) keep their names",
          metavar="{int8dq,int8wo,int4wo-<group>}"),
    Alias(("--quant_type",), "quantization", "LightLLM", _lightllm_quant_type, example=("vllm-w8a8",),
          note="vllm-w8a8 and ao-int8dq -> w8a8_int8; ao-int8wo -> int8wo; ao-int4wo-<g> -> int4wo-<g>",
          metavar="{none,vllm-w8a8,ao-int8dq,ao-int8wo,ao-int4wo-<g>}"),
)

# --- accepted: already the behaviour of this build ---------------------------------------------

_EAGER = "servelm never captures CUDA graphs: every device runs eager PyTorch"
_PREFIX_CACHE_ON = "the prefix cache is on by default (--disable-radix-cache turns it off)"

ALREADY_BEHAVIOUR: tuple[AlreadyBehaviour, ...] = (
    AlreadyBehaviour(("--disable-cuda-graph", "--disable_cudagraph", "--enforce-eager",
                      "--disable-cuda-graph-padding"), _EAGER),
    AlreadyBehaviour(("--use_dynamic_prompt_cache",), _PREFIX_CACHE_ON),
    AlreadyBehaviour(("--disable-overlap-schedule",),
                     "servelm's scheduler does not overlap with the forward pass"),
    AlreadyBehaviour(("--disable-outlines-disk-cache",),
                     "servelm has no outlines backend; xgrammar compiles are cached in memory"),
    AlreadyBehaviour(("--disable-mla",), "servelm has no Multi-head Latent Attention kernels"),
    AlreadyBehaviour(("--enable-mixed-chunk", "--splitfuse_mode"),
                     "servelm's scheduler has no prefill/decode phases: prompt chunks and decodes "
                     "always share a step"),
    AlreadyBehaviour(("--use-v2-block-manager",),
                     "servelm has a single paged block manager (vLLM documents this flag as a no-op)"),
    AlreadyBehaviour(("--disable-log-requests",),
                     "servelm logs requests only with --log-requests (off by default)"),
    AlreadyBehaviour(("--preemption-mode",),
                     "a preempted request frees its blocks and is recomputed; swapping to CPU is "
                     "not supported", values=("recompute",), bad_value="swap"),
    AlreadyBehaviour(("--scheduler-delay-factor",),
                     "servelm schedules waiting prompts without delay", values=("0",),
                     bad_value="0.5"),
    AlreadyBehaviour(("--num-scheduler-steps", "--num-continuous-decode-steps"),
                     "servelm schedules before every forward step; multi-step decoding is not "
                     "supported", values=("1",), bad_value="4"),
    AlreadyBehaviour(("--expert-parallel-size", "--ep-size"),
                     "servelm has no expert parallelism (no MoE kernels)", values=("1",),
                     bad_value="2"),
    AlreadyBehaviour(("--nnodes",), "servelm runs on one node", values=("1",), bad_value="2"),
    AlreadyBehaviour(("--node-rank", "--node_rank"), "servelm runs on one node", values=("0",),
                     bad_value="1"),
    AlreadyBehaviour(("--cpu-offload-gb", "--swap-space"),
                     "servelm keeps weights and KV in one memory pool: no CPU offload or swap",
                     values=("0",), bad_value="4"),
    AlreadyBehaviour(("--compilation-config", "-O"),
                     "servelm runs eager PyTorch by default: only level 0 (no compilation) is "
                     "accepted here; --enable-torch-compile compiles decode steps",
                     values=("0",), bad_value="3"),
    AlreadyBehaviour(("--attention-backend",), "servelm's only attention backend is torch_native "
                     "(plain PyTorch)", values=("torch_native",), bad_value="flashinfer"),
    AlreadyBehaviour(("--sampling-backend",), "servelm samples with plain PyTorch",
                     values=("pytorch",), bad_value="flashinfer"),
    AlreadyBehaviour(("--config-format",),
                     "servelm reads Hugging Face config.json (or GGUF metadata); mistral "
                     "params.json is not supported", values=("auto", "hf"), bad_value="mistral"),
    AlreadyBehaviour(("--load_way",), "servelm loads Hugging Face format (and GGUF); DeepSpeed "
                     "checkpoints are not supported", values=("HF",), bad_value="DS"),
    AlreadyBehaviour(("--run_mode",), "servelm runs as a single server; PD disaggregation is not "
                     "supported", values=("normal",), bad_value="prefill"),
    AlreadyBehaviour(("--chunked_max_new_token",), "servelm has no chunked decoding",
                     values=("0",), bad_value="8"),
    AlreadyBehaviour(("--httpserver_workers",), "servelm runs one HTTP server process",
                     values=("1",), bad_value="4"),
)

# --- rejected, by reason -----------------------------------------------------------------------

REJECTIONS: tuple[Rejection, ...] = (
    Rejection("not supported yet: hierarchical (host/storage) KV cache is not implemented",
              ("--hicache-storage-backend-extra-config",)),
    Rejection("not supported yet: scheduling policies and their tuning are a planned feature "
              "(requests are served first come, first served)",
              ("--prefill-only-one-req", "--router_max_new_token_len",
               "--disable_aggressive_schedule")),
    Rejection("not supported yet: metrics push gateways, custom metric labels, tracing and "
              "timing marks (--enable-metrics serves /metrics for Prometheus to scrape)",
              ("--enable-metrics-for-all-schedulers",
               "--tokenizer-metrics-custom-labels-header",
               "--tokenizer-metrics-allowed-custom-labels", "--metric_gateway", "--job_name",
               "--grouping_key", "--push_interval", "--enable_monitor_auth", "--health_monitor",
               "--otlp-traces-endpoint", "--collect-detailed-traces", "--enable-trace",
               "--show-time-cost")),
    Rejection("not supported: custom logit processors run client-supplied code inside the "
              "engine process (a code execution risk), so servelm keeps them off",
              ("--enable-custom-logit-processor",)),
    Rejection("not supported yet: LoRA adapters are a planned feature",
              ("--enable-lora", "--enable-lora-bias", "--fully-sharded-loras", "--lora-dtype",
               "--lora-extra-vocab-size", "--lora-modules", "--long-lora-scaling-factors",
               "--max-cpu-loras", "--max-lora-rank", "--max-loras", "--lora-paths",
               "--max-loras-per-batch", "--qlora-adapter-name-or-path")),
    Rejection("not supported: prompt adapters (soft prompts) are not planned",
              ("--enable-prompt-adapter", "--prompt-adapters", "--max-prompt-adapters",
               "--max-prompt-adapter-token")),
    Rejection("not supported yet: speculative decoding is a planned feature",
              ("--speculative-algorithm", "--speculative-draft-model-path",
               "--speculative-num-steps", "--speculative-num-draft-tokens",
               "--speculative-eagle-topk", "--speculative-model", "--num-speculative-tokens",
               "--speculative-max-model-len", "--speculative-disable-by-batch-size",
               "--speculative-disable-mqa-scorer", "--speculative-draft-tensor-parallel-size",
               "-spec-draft-tp", "--speculative-model-quantization", "--ngram-prompt-lookup-max",
               "--ngram-prompt-lookup-min", "--spec-decoding-acceptance-method",
               "--typical-acceptance-sampler-posterior-alpha",
               "--typical-acceptance-sampler-posterior-threshold", "--num-lookahead-slots",
               "--disable-logprobs-during-spec-decoding", "--mtp_mode", "--mtp_draft_model_dir",
               "--mtp_step")),
    Rejection("not supported yet: only quantization computed at load (--quantization w8a8_int8, int8wo, "
              "int4wo-<group>) is implemented; "
              "pre-quantized checkpoints and calibration files are not (GGUF loads by path)",
              ("--quantization-param-path", "--quant_cfg", "--vit_quant_type", "--vit_quant_cfg")),
    Rejection("not supported: custom logits processors and first-token constraints (use a grammar: "
              "response_format, json_schema, regex, ebnf)",
              ("--first_token_constraint_mode", "--logits-processor-pattern")),
    Rejection("not supported: tool parser plugins (choose a built-in --tool-call-parser)",
              ("--tool-parser-plugin",)),
    Rejection("not supported yet: servelm runs tensor parallelism on one node (--tp-size); "
              "multi-node serving, Ray, data-parallel load balancing and these tuning options are "
              "not implemented",
              ("--dist-init-addr", "--nccl-init-addr", "--nccl_host", "--nccl_port",
               "--multinode_httpmanager_port", "--multinode_router_gloo_port",
               "--use_config_server_to_init_nccl",
               "--worker-use-ray", "--ray-workers-use-nsight", "--worker-cls",
               "--load-balance-method", "--enable-dp-attention", "--enable-p2p-check",
               "--base-gpu-id", "--enable_tpsp_mix_mode", "--enable_custom_allgather",
               "--enable_prefill_microbatch_overlap", "--enable_decode_microbatch_overlap")),
    Rejection("not supported: servelm has no mixture-of-experts kernels or expert parallelism",
              ("--enable-ep-moe", "--enable-deepep-moe", "--enable-flashinfer-cutlass-moe",
               "--enable-flashinfer-cutedsl-moe", "--enable-flashinfer-trtllm-moe",
               "--enable-flashinfer-mxfp4-moe", "--enable-triton-kernel-moe",
               "--moe-runner-backend", "--ep_redundancy_expert_config_path",
               "--auto_update_redundancy_expert")),
    Rejection("not supported: prefill/decode disaggregation (a single server does both)",
              ("--pd_master_ip", "--pd_master_port", "--pd_decode_rpyc_port",
               "--config_server_host", "--config_server_port", "--pd_max_retry_count",
               "--kv-transfer-config", "--disaggregation-ib-device")),
    Rejection("not supported: servelm runs eager PyTorch (or torch.compile with "
              "--enable-torch-compile) on every device: no CUDA graphs, flashinfer, triton or "
              "other custom kernels",
              ("--cuda-graph-bs", "--cuda-graph-max-bs", "--max-seq-len-to-capture",
               "--graph_max_batch_size", "--graph_split_batch_size", "--graph_grow_step_size",
               "--graph_max_len_in_batch",
               "--sampling_backend", "--enable_flashinfer_prefill",
               "--enable_flashinfer_decode", "--enable_fa3", "--triton-attention-reduce-in-fp32",
               "--triton-attention-num-kv-splits", "--mode", "--enable-double-sparsity",
               "--ds-channel-config-path", "--ds-heavy-channel-num", "--ds-heavy-token-num",
               "--ds-heavy-channel-type", "--ds-sparse-decode-threshold", "--enable_mps")),
    Rejection("not supported: servelm serves text-only models (no multimodal inputs)",
              ("--enable_multimodal", "--enable-multimodal", "--enable_multimodal_audio",
               "--cache_capacity", "--cache_reserved_ratio", "--visual_infer_batch_size",
               "--visual_gpu_ids", "--visual_tp", "--visual_dp", "--visual_nccl_ports",
               "--limit-mm-per-prompt", "--mm-processor-kwargs", "--mm-cache-preprocessor",
               "--allowed-local-media-path")),
    Rejection("not supported: servelm serves text generation and embeddings only (no reward "
              "models; no beam, diverse or token-healing modes; no TGI API)",
              ("--use_reward_model", "--beam_mode",
               "--diverse_mode", "--token_healing_mode", "--use_tgi_api")),
    Rejection("not supported: this response option is not implemented (prompt logprobs and "
              "token ids are per-request parameters)",
              ("--return_all_prompt_logprobs", "--return-token-ids",
               "--return-tokens-as-token-ids", "--max-logprobs", "--response-role",
               "--chat-template-content-format")),
    Rejection("not supported: KV offloading and block-count overrides (size the pool with "
              "--max-total-tokens or --mem-fraction-static)",
              ("--num-gpu-blocks-override",)),
    Rejection("not supported yet: this HTTP server option (custom middleware, docs switch, "
              "file storage, warm-up) is not implemented",
              ("--middleware", "--disable-fastapi-docs",
               "--file-storage-pth", "--warmups", "--skip-server-warmup")),
    Rejection("not supported: the process layout is fixed (engine core in its own process, "
              "ZMQ IPC, tokenization in the front end)",
              ("--zmq_mode", "--disable-frontend-multiprocessing", "--disable-async-output-proc",
               "--multi-step-stream-outputs", "--tokenizer-pool-size", "--tokenizer-pool-type",
               "--tokenizer-pool-extra-config", "--enable-dynamic-batch-tokenizer",
               "--tokenizer-worker-num")),
    Rejection("not supported: servelm runs its own model code from the checkpoint's config and "
              "weights; this loading option has no equivalent",
              ("--code-revision", "--tokenizer-revision", "--ignore-patterns",
               "--max-parallel-loading-workers", "--model-loader-extra-config",
               "--override-neuron-config", "--delete-ckpt-after-loading", "--model-impl")),
    Rejection("not supported: change model config fields with --hf-overrides (a JSON object), "
              "e.g. --hf-overrides '{\"rope_theta\": 1000000}'",
              ("--rope-scaling", "--rope-theta")),
    Rejection("not supported: end-of-sequence ids come from the model's generation config "
              "(requests can add stop_token_ids)", ("--eos_id",)),
    Rejection("not supported: sliding-window attention follows the model config",
              ("--disable-sliding-window",)),
    Rejection("not supported: prompts are bounded only by the context length "
              "(--context-length / --max_req_total_len)", ("--max_req_input_len",)),
    Rejection("not supported: debugging switch not implemented (NaN detection, "
              "deterministic mode)",
              ("--enable-nan-detection", "--enable-deterministic-inference")),
    Rejection("not a server option: --shm-size is a `docker run` flag (shared memory for the "
              "container)", ("--shm-size",)),
)


# --- lookups -----------------------------------------------------------------------------------

def flag_name(field_name: str) -> str:
    """The command-line flag generated for a config field."""
    return "--" + field_name.replace("_", "-")


def config_fields() -> dict[str, dataclasses.Field[Any]]:
    """Field name -> dataclass field, over every section of EngineConfig."""
    fields: dict[str, dataclasses.Field[Any]] = {}
    for section in EngineConfig.sections().values():
        for f in dataclasses.fields(section):
            fields[f.name] = f
    return fields


def implemented_flags() -> dict[str, str]:
    """Flag -> field for every config field (plus its ``--no-`` form and metadata flags)."""
    flags: dict[str, str] = {}
    for name, f in config_fields().items():
        flags[flag_name(name)] = name
        if f.metadata.get("negatable"):
            flags["--no-" + flag_name(name)[2:]] = name
        for extra in f.metadata.get("flags", ()):
            flags[extra] = name
    return flags


def rejection_reason(flag: str) -> str | None:
    """Why ``flag`` is rejected, or None when it is not in REJECTIONS."""
    for rejection in REJECTIONS:
        if flag in rejection.flags:
            return rejection.reason
    return None


def classify(flag: str) -> str | None:
    """'implemented', 'alias', 'already', 'rejected', or None for an unknown flag."""
    if flag in implemented_flags():
        return "implemented"
    if any(flag in alias.flags for alias in ALIASES):
        return "alias"
    if any(flag in entry.flags for entry in ALREADY_BEHAVIOUR):
        return "already"
    if rejection_reason(flag) is not None:
        return "rejected"
    return None


def check_catalogue() -> None:
    """Raise ValueError if a flag is catalogued twice or an alias names no field."""
    seen: dict[str, str] = {flag: "implemented" for flag in implemented_flags()}
    fields = config_fields()

    def claim(flag: str, kind: str) -> None:
        if flag in seen:
            raise ValueError(f"{flag} is catalogued as both {seen[flag]} and {kind}")
        seen[flag] = kind

    for alias in ALIASES:
        if alias.field not in fields:
            raise ValueError(f"alias {alias.flags} names unknown field {alias.field!r}")
        for flag in alias.flags:
            claim(flag, "alias")
    for entry in ALREADY_BEHAVIOUR:
        for flag in entry.flags:
            claim(flag, "already")
    for rejection in REJECTIONS:
        for flag in rejection.flags:
            claim(flag, "rejected")


def counts() -> dict[str, int]:
    """Number of flag strings of each kind."""
    result = {"implemented": len(implemented_flags()),
              "alias": sum(len(a.flags) for a in ALIASES),
              "already": sum(len(e.flags) for e in ALREADY_BEHAVIOUR),
              "rejected": sum(len(r.flags) for r in REJECTIONS)}
    return result


def describe() -> str:
    """The whole catalogue as text, for ``python -m servelm.cli_flags``."""
    lines = ["Implemented (config fields):"]
    lines += [f"  {flag:34} {field}" for flag, field in implemented_flags().items()]
    lines.append("\nAliases (other engines' spellings):")
    for alias in ALIASES:
        target = flag_name(alias.field)
        note = f"  ({alias.note})" if alias.note else ""
        lines.append(f"  {', '.join(alias.flags):34} -> {target} [{alias.origin}]{note}")
    lines.append("\nAccepted, already the behaviour of this build:")
    for entry in ALREADY_BEHAVIOUR:
        values = f" (only {', '.join(entry.values)})" if entry.values else ""
        lines.append(f"  {', '.join(entry.flags)}{values}: {entry.reason}")
    lines.append("\nRejected:")
    for rejection in REJECTIONS:
        lines.append(f"  {rejection.reason}:")
        lines.append("    " + " ".join(rejection.flags))
    lines.append("\n" + ", ".join(f"{kind}: {n}" for kind, n in counts().items()))
    return "\n".join(lines)


if __name__ == "__main__":
    check_catalogue()
    print(describe())
