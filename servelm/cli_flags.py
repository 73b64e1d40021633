"""Catalogue of every command-line flag servelm recognises, including other engines' flags.

servelm follows the server arguments of SGLang, vLLM and LightLLM (../shared/seeds). Each of their
flags is in exactly one of four places:

- implemented: a field of a config dataclass in ``servelm.config`` (the flag is generated from it);
- ALIASES: another engine's spelling of one of our fields, possibly with a value transform;
- ALREADY_BEHAVIOUR: accepted because what the user asks for is already what this build does
  (``--disable-cuda-graph``: servelm never captures CUDA graphs). A flag that takes a value is
  accepted only with the listed values; any other value is rejected. An entry lists the config
  values that would undo the behaviour (``contradicts``): given together, start-up fails naming
  both flags;
- REJECTIONS: rejected at start-up with the reason, grouped by reason. Building a refused
  feature turns its entry into config fields or aliases.

``NEEDS`` lists options that mean nothing without another one (refused alone), and
``PARSER_OPTIONS`` the parser's own options (--config, --dry-run, --help).

Invariants: no flag string appears twice across these tables or collides with a generated field
flag (``check_catalogue`` enforces it, and the tests call it); nothing is accepted and ignored.
To implement a feature, add its config field and delete its REJECTIONS entry (or turn it into
Aliases).

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
    merge: Callable[[Any, Any], Any] | None = None
    """(value set so far by a flag of the same ``family``, or None; this flag's converted value)
    -> the field's value: flags that each give part of one field (LightLLM's host and port)."""
    family: str | None = None
    """Flags sharing a family complete each other's value (``merge``) instead of conflicting."""


class NonDefault:
    """Stands for "any value other than the field's default" in a Contradiction."""

    def __repr__(self) -> str:
        return "NON_DEFAULT"


NON_DEFAULT = NonDefault()


@dataclass(frozen=True)
class Contradiction:
    """A final config value that undoes what an accepted flag asks for (an error naming both)."""

    field: str
    values: tuple[Any, ...] | NonDefault = NON_DEFAULT
    """The field values that contradict the flag; NON_DEFAULT: any value but the default."""

    def is_contradicted_by(self, value: Any, default: Any) -> bool:
        if isinstance(self.values, NonDefault):
            return bool(value != default)
        return value in self.values


@dataclass(frozen=True)
class AlreadyBehaviour:
    """A flag asking for what servelm already does; accepted and has nothing to change.

    "Already the behaviour" holds only while other flags leave that behaviour alone:
    ``contradicts`` lists the config values that undo it (``--disable-log-requests`` with
    ``--log-requests``), and the command line is then refused naming both flags."""

    flags: tuple[str, ...]
    reason: str
    values: tuple[str, ...] | None = None
    """None: the flag takes no value. Otherwise the only values accepted (compared
    case-insensitively, numbers by value); others are rejected with ``reason``."""
    bad_value: str | None = None
    """A value that must be rejected (used by the tests)."""
    contradicts: tuple[Contradiction, ...] = ()


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


LIGHTLLM_NCCL_DEFAULTS = ("127.0.0.1", 28765)
"""LightLLM's --nccl_host and --nccl_port defaults: the half a user leaves out."""


def _nccl_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"expected a port number (1-65535), got {text!r}")
    return int(text)


def _nccl_host(text: str) -> str:
    if not text or any(c in text for c in " /"):
        raise ValueError(f"expected a host name or address, got {text!r}")
    return text.strip("[]")


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(address: str | None) -> tuple[str, int]:
    if address is None:
        return LIGHTLLM_NCCL_DEFAULTS
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _merge_nccl_host(previous: str | None, host: str) -> str:
    """--nccl_host H: --dist-init-addr H:port (LightLLM's default port unless --nccl_port gave one)."""
    return _join_host_port(host, _split_host_port(previous)[1])


def _merge_nccl_port(previous: str | None, port: int) -> str:
    """--nccl_port P: --dist-init-addr host:P (LightLLM's default host unless --nccl_host gave one)."""
    return _join_host_port(_split_host_port(previous)[0], port)


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
    if "fp8" in text:
        raise ValueError(f"{text!r} quantizes to FP8 at load, which needs an FP8 GEMM that this CPU path lacks "
                         "(a pre-quantized FP8 checkpoint loads by path, dequantized); choose from none, "
                         "vllm-w8a8, ao-int8dq, ao-int8wo, ao-int4wo-<group>")
    raise ValueError("choose from none, vllm-w8a8, ao-int8dq (W8A8 dynamic int8), ao-int8wo, "
                     f"ao-int4wo-<group> with group {'/'.join(_INT4_GROUPS)}; got {text!r}")


def _sglang_num_draft_tokens(text: str) -> int:
    # SGLang counts the tokens of one verify pass, the last accepted token included: N -> k = N - 1.
    value = int(text)
    if value < 2:
        raise ValueError(f"must be at least 2 (the accepted token plus one draft), got {value}")
    return value - 1


def _lightllm_mtp_step(text: str) -> int:
    # LightLLM: draft tokens per step; its default 0 means no MTP, which here is leaving it out.
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1 draft token, got {value} (LightLLM's 0 means no "
                         "speculation: leave --mtp_step out, or give --mtp_draft_model_dir with "
                         "--mtp_step 1 or more)")
    return value


def _vllm_speculative_model(text: str) -> str:
    # vLLM: a draft model path, or [ngram] for prompt lookup (SpeculativeConfig settles which).
    if not text.strip():
        raise ValueError("give a draft model path or [ngram]")
    return text.strip()


def _lightllm_run_mode(text: str) -> Any:
    modes = {"normal": UNCHANGED, "prefill": "prefill", "decode": "decode"}
    if text == "pd_master":
        raise ValueError("pd_master is the router's role: run `servelm router --prefill URL "
                         "--decode URL` (prefill and decode servers register with it via "
                         "--pd_master_ip/--pd_master_port)")
    if text not in modes:
        raise ValueError(f"choose from normal, prefill, decode; got {text!r}")
    return modes[text]


# --- aliases -----------------------------------------------------------------------------------

ALIASES: tuple[Alias, ...] = (
    Alias(("--run_mode",), "disaggregation_mode", "LightLLM", lambda text: _lightllm_run_mode(text),
          example=("prefill",), note="normal -> null; prefill, decode; pd_master is `servelm router`",
          metavar="{normal,prefill,decode}"),
    Alias(("--pd_master_ip",), "pd_master_ip", "LightLLM", example=("127.0.0.1",)),
    Alias(("--pd_master_port",), "pd_master_port", "LightLLM", example=("1213",)),
    Alias(("--model-path",), "model", "SGLang", example=("some/model",)),
    Alias(("--model_dir",), "model", "LightLLM", example=("some/model",)),
    Alias(("--tokenizer-path",), "tokenizer", "SGLang", example=("some/tokenizer",)),
    Alias(("--tokenizer_mode",), "tokenizer_mode", "LightLLM", _lightllm_tokenizer_mode,
          example=("slow",), note="fast and auto -> auto", metavar="{slow,fast,auto}"),
    Alias(("--data_type",), "dtype", "LightLLM", _lightllm_data_type, example=("bf16",),
          note="fp16 -> float16, bf16 -> bfloat16, fp32 -> float32", metavar="{fp16,bf16,fp32,...}"),
    Alias(("--max-model-len",), "context_length", "vLLM", example=("2048",)),
    Alias(("--max_req_total_len",), "context_length", "LightLLM", example=("2048",),
          note="prompt + output tokens of one request: our context length"),
    Alias(("--json-model-override-args",), "hf_overrides", "SGLang", example=('{"rope_theta": 10000.0}',)),
    Alias(("--random-seed",), "seed", "SGLang", example=("7",)),
    Alias(("--model_name",), "served_model_name", "LightLLM", lambda name: [name],
          example=("my-model",), metavar="NAME"),
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
    Alias(("--no-webui",), "disable_playground", "llama.cpp", takes_value=False, const=True),
    Alias(("--beam_mode",), "beam_mode", "LightLLM", takes_value=False, const=True),
    Alias(("--router_token_ratio",), "router_token_ratio", "LightLLM", example=("0.5",)),
    Alias(("--router_max_wait_tokens",), "router_max_wait_tokens", "LightLLM", example=("6",)),
    Alias(("--node_rank",), "node_rank", "LightLLM", example=("1",)),
    Alias(("--nccl-init-addr",), "dist_init_addr", "SGLang", example=("127.0.0.1:5000",)),
    Alias(("--nccl_host",), "dist_init_addr", "LightLLM", _nccl_host, merge=_merge_nccl_host,
          family="lightllm-nccl", example=("10.0.0.1",), metavar="HOST",
          note="node 0's address with --nnodes > 1; with --nccl_port (default 28765) it makes "
          "--dist-init-addr HOST:PORT"),
    Alias(("--nccl_port",), "dist_init_addr", "LightLLM", _nccl_port, merge=_merge_nccl_port,
          family="lightllm-nccl", example=("29000",), metavar="PORT",
          note="the rendezvous port with --nnodes > 1; with --nccl_host (default 127.0.0.1) it "
          "makes --dist-init-addr HOST:PORT"),
    Alias(("--worker-use-ray",), "distributed_executor_backend", "vLLM (deprecated)",
          takes_value=False, const="ray"),
    Alias(("--tp-size", "--tp", "-tp"), "tensor_parallel_size",
          "SGLang, vLLM, LightLLM", example=("2",)),
    Alias(("--disable_custom_allreduce",), "disable_custom_all_reduce", "LightLLM", takes_value=False,
          const=True),
    Alias(("--ep-size", "--ep"), "expert_parallel_size", "SGLang", example=("2",)),
    Alias(("--enable-ep-moe", "--enable_ep_moe"), "enable_expert_parallel", "SGLang, LightLLM",
          takes_value=False, const=True, note="--ep-size = --tp-size"),
    Alias(("--auto_update_redundancy_expert",), "enable_eplb", "LightLLM", takes_value=False, const=True),
    Alias(("-pp", "--pp-size"), "pipeline_parallel_size", "vLLM, SGLang", example=("2",)),
    Alias(("--dp-size", "--dp", "-dp"), "data_parallel_size", "SGLang, LightLLM, vLLM",
          example=("2",)),
    Alias(("--guided-decoding-backend",), "grammar_backend", "vLLM", _vllm_guided_backend,
          example=("none",), note="auto -> xgrammar, guidance -> llguidance"),
    Alias(("--output_constraint_mode",), "grammar_backend", "LightLLM", example=("none",)),
    Alias(("--tool_call_parser",), "tool_call_parser", "LightLLM", example=("qwen25",)),
    Alias(("--is-embedding",), "task", "SGLang", takes_value=False, const="embed",
          note="serve the model's pooled hidden states at /v1/embeddings"),
    Alias(("-q",), "quantization", "vLLM", example=("w8a8_int8",)),
    Alias(("--max-loras",), "max_loras_per_batch", "vLLM", example=("4",)),
    Alias(("--max-cpu-loras",), "max_loaded_loras", "vLLM", example=("16",),
          note="adapters held in memory, least recently used dropped and reloaded from disk"),
    Alias(("--torchao-config",), "quantization", "SGLang", _torchao_config, example=("int8dq",),
          note="int8dq -> w8a8_int8; int8wo and int4wo-<group> (32/64/128/256) keep their names",
          metavar="{int8dq,int8wo,int4wo-<group>}"),
    Alias(("--quant_type",), "quantization", "LightLLM", _lightllm_quant_type, example=("vllm-w8a8",),
          note="vllm-w8a8 and ao-int8dq -> w8a8_int8; ao-int8wo -> int8wo; ao-int4wo-<g> -> int4wo-<g>",
          metavar="{none,vllm-w8a8,ao-int8dq,ao-int8wo,ao-int4wo-<g>}"),
    Alias(("--speculative-num-draft-tokens",), "num_speculative_tokens", "SGLang",
          _sglang_num_draft_tokens, example=("3",),
          note="tokens per verify pass including the last accepted one: N -> N - 1 drafts"),
    Alias(("--speculative-model",), "speculative_draft_model_path", "vLLM", _vllm_speculative_model,
          example=("some/draft",), note="[ngram] -> NGRAM; a model path -> STANDALONE with that draft"),
    Alias(("--speculative-draft-model",), "speculative_draft_model_path", "SGLang",
          example=("some/draft",)),
    Alias(("--mtp_draft_model_dir",), "speculative_draft_model_path", "LightLLM",
          example=("some/draft",), note="a separate draft model: STANDALONE"),
    Alias(("--mtp_step",), "num_speculative_tokens", "LightLLM", _lightllm_mtp_step, example=("2",),
          note="draft tokens per step of the --mtp_draft_model_dir draft (STANDALONE)"),
    Alias(("--speculative-ngram-max-match-window-size",), "ngram_prompt_lookup_max", "SGLang",
          example=("8",)),
    Alias(("--speculative-ngram-min-match-window-size",), "ngram_prompt_lookup_min", "SGLang",
          example=("3",)),
    Alias(("--cache_capacity",), "encoder_cache_capacity", "LightLLM", example=("100",),
          note="images whose vision-tower output is kept (LightLLM's multimodal cache)"),
)

# --- accepted: already the behaviour of this build ---------------------------------------------

_EAGER = "servelm never captures CUDA graphs: every device runs eager PyTorch"
_PREFIX_CACHE_ON = "the prefix cache is on by default (--disable-radix-cache turns it off)"
_NO_COMPILE = Contradiction("enable_torch_compile")

ALREADY_BEHAVIOUR: tuple[AlreadyBehaviour, ...] = (
    AlreadyBehaviour(("--disable-cuda-graph", "--disable_cudagraph", "--disable-cuda-graph-padding"),
                     _EAGER),
    AlreadyBehaviour(("--enforce-eager",), "servelm runs eager PyTorch unless "
                     "--enable-torch-compile is given", contradicts=(_NO_COMPILE,)),
    AlreadyBehaviour(("--use_dynamic_prompt_cache",), _PREFIX_CACHE_ON,
                     contradicts=(Contradiction("disable_radix_cache"),)),
    AlreadyBehaviour(("--diverse_mode", "--diverse-mode"),
                     "n > 1 choices already share the prompt's K/V: the prompt is computed once and "
                     "the siblings take it from the prefix cache, then each samples on its own "
                     "(LightLLM's diverse mode; it has no group penalty)",
                     contradicts=(Contradiction("disable_radix_cache"),)),
    AlreadyBehaviour(("--disable-overlap-schedule",),
                     "servelm's scheduler does not overlap with the forward pass"),
    AlreadyBehaviour(("--disable-outlines-disk-cache",),
                     "servelm has no outlines backend; xgrammar compiles are cached in memory"),
    AlreadyBehaviour(("--disable-shared-experts-fusion",),
                     "servelm computes a shared expert (Qwen2-MoE) as its own gated MLP beside the "
                     "routed experts, never fused into them"),
    AlreadyBehaviour(("--disable-chunked-prefix-cache", "--flashinfer-mla-disable-ragged",
                      "--disable-flashinfer-cutlass-moe-fp4-allgather"),
                     "servelm has none of these DeepSeek MLA / FlashInfer MoE optimisations (CUDA-only "
                     "kernels)"),
    AlreadyBehaviour(("--moe-runner-backend",),
                     "servelm runs every MoE layer through its own fused CPU path (rows grouped by "
                     "expert, a gate_up and a down GEMM per expert with rows), which is what auto picks "
                     "here; the triton, triton_kernel, deep_gemm, cutlass and flashinfer_* runners are "
                     "CUDA-only kernels", values=("auto",), bad_value="triton"),
    AlreadyBehaviour(("--moe-a2a-backend",),
                     "expert parallelism exchanges tokens with torch.distributed's all-to-all (gloo "
                     "on CPU); deepep and mooncake are CUDA/RDMA transports",
                     values=("none",), bad_value="deepep"),
    AlreadyBehaviour(("--enable-mixed-chunk", "--splitfuse_mode"),
                     "servelm's scheduler has no prefill/decode phases: prompt chunks and decodes "
                     "always share a step",
                     contradicts=(Contradiction("chunked_prefill_size", (-1,)),)),
    AlreadyBehaviour(("--use-v2-block-manager",),
                     "servelm has a single paged block manager (vLLM documents this flag as a no-op)"),
    AlreadyBehaviour(("--disable-log-requests",),
                     "servelm logs requests only with --log-requests (off by default)",
                     contradicts=(Contradiction("log_requests"),)),
    AlreadyBehaviour(("--preemption-mode",),
                     "a preempted request frees its blocks and is recomputed; swapping to CPU is "
                     "not supported", values=("recompute",), bad_value="swap"),
    AlreadyBehaviour(("--scheduler-delay-factor",),
                     "servelm schedules waiting prompts without delay", values=("0",),
                     bad_value="0.5", contradicts=(Contradiction("router_max_wait_tokens"),)),
    AlreadyBehaviour(("--num-scheduler-steps", "--num-continuous-decode-steps"),
                     "servelm schedules before every forward step; multi-step decoding is not "
                     "supported", values=("1",), bad_value="4"),
    AlreadyBehaviour(("--scheduler-recv-interval",),
                     "the engine reads new requests between every two steps", values=("1",),
                     bad_value="4"),
    AlreadyBehaviour(("--init-expert-location",),
                     "experts start in checkpoint order, the redundant slots replicating the first "
                     "experts, and --enable-eplb moves them from the measured load (a placement file "
                     "is not read)", values=("trivial",), bad_value="/tmp/placement.json"),
    AlreadyBehaviour(("--eplb-algorithm",),
                     "servelm's EPLB gives the redundant slots to the experts with the most rows per "
                     "replica and packs the replicas heaviest first onto the least loaded rank; "
                     "the ranks are one tensor-parallel group, so there is no node hierarchy to plan "
                     "for (deepseek_hierarchical)", values=("auto",), bad_value="deepseek_hierarchical"),
    AlreadyBehaviour(("--cpu-offload-gb", "--swap-space"),
                     "weights stay where the model was loaded (no CPU offload of weights), and a "
                     "preempted request is recomputed, not swapped out (evicted prefix blocks can "
                     "go to host memory with --enable-hierarchical-cache)",
                     values=("0",), bad_value="4"),
    AlreadyBehaviour(("--compilation-config", "-O"),
                     "servelm runs eager PyTorch by default: only level 0 (no compilation) is "
                     "accepted here; --enable-torch-compile compiles decode steps",
                     values=("0",), bad_value="3", contradicts=(_NO_COMPILE,)),
    AlreadyBehaviour(("--attention-backend", "--prefill-attention-backend",
                      "--decode-attention-backend"),
                     "servelm's only attention backend is torch_native (plain PyTorch)",
                     values=("torch_native",), bad_value="flashinfer"),
    AlreadyBehaviour(("--sampling-backend",), "servelm samples with plain PyTorch",
                     values=("pytorch",), bad_value="flashinfer"),
    AlreadyBehaviour(("--config-format",),
                     "servelm reads Hugging Face config.json (or GGUF metadata); mistral "
                     "params.json is not supported", values=("auto", "hf"), bad_value="mistral"),
    AlreadyBehaviour(("--load_way",), "servelm loads Hugging Face format (and GGUF); DeepSpeed "
                     "checkpoints are not supported", values=("HF",), bad_value="DS"),
    AlreadyBehaviour(("--chunked_max_new_token",), "servelm has no chunked decoding",
                     values=("0",), bad_value="8"),
    AlreadyBehaviour(("--httpserver_workers",), "servelm runs one HTTP server process",
                     values=("1",), bad_value="4"),
    AlreadyBehaviour(("--constrained-json-disable-any-whitespace",),
                     "grammars produce compact JSON unless --constrained-json-whitespace-pattern "
                     "is given", contradicts=(Contradiction("constrained_json_whitespace_pattern"),)),
    AlreadyBehaviour(("--sleep-on-idle",),
                     "an idle engine waits on its request socket (waking once a second), using "
                     "next to no CPU"),
    AlreadyBehaviour(("--disable-hybrid-swa-memory",),
                     "servelm's KV pool has no separate sliding-window region: every layer keeps "
                     "every token"),
    AlreadyBehaviour(("--lora-backend",),
                     "LoRA deltas run on torch_native: rows grouped by adapter, two GEMMs per "
                     "group (SGLang's triton/csgmv kernels are CUDA-only and not built)",
                     values=("torch_native",), bad_value="triton"),
    AlreadyBehaviour(("--lora-extra-vocab-size",),
                     "adapters that add tokens (embedding or LM-head LoRA) are refused at load, so "
                     "no extra vocabulary is reserved", values=("0",), bad_value="256"),
    AlreadyBehaviour(("--mtp_mode",),
                     "a model's own multi-token-prediction layer (DeepSeek-V3 MTP) drafts with "
                     "--speculative-algorithm NEXTN, read from --model's checkpoint, not from a "
                     "--mtp_draft_model_dir of extracted MTP weights, so only None is accepted; "
                     "--mtp_draft_model_dir alone runs that model as a separate draft (STANDALONE)",
                     values=("None",), bad_value="deepseekv3"),
    AlreadyBehaviour(("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc"),
                     "verification is exact: a draft token is kept only as the model's own sample "
                     "(a threshold below 1 would trade the model's distribution for speed)",
                     values=("1",), bad_value="0.5"),
    AlreadyBehaviour(("--mm-cache-preprocessor",),
                     "a repeated image is not encoded again: the engine's encoder cache (on by "
                     "default, --encoder-cache-capacity) keeps its vision-tower output by the "
                     "image's digest, which skips more than caching the preprocessor would",
                     contradicts=(Contradiction("encoder_cache_capacity", (0,)),)),
    AlreadyBehaviour(("--mm-attention-backend",),
                     "the vision tower's attention runs on PyTorch's scaled_dot_product_attention "
                     "(sdpa); fa3, flashinfer, triton_attn and aiter_attn are CUDA/ROCm-only kernels",
                     values=("sdpa",), bad_value="fa3"),
    AlreadyBehaviour(("--disable-fast-image-processor",),
                     "servelm preprocesses images with its own code, equal to transformers' base "
                     "(PIL and numpy) image processors: there is no fast (torchvision) variant"),
    AlreadyBehaviour(("--keep-mm-feature-on-device",),
                     "image features stay where the vision tower computed them, beside the text "
                     "model: on CPU there is no device-to-host copy to save"),
    AlreadyBehaviour(("--visual_tp", "--visual_dp"),
                     "the vision tower runs inside the engine with the text model: it has no "
                     "tensor- or data-parallel group of its own", values=("1",), bad_value="2"),
    AlreadyBehaviour(("--disable_aggressive_schedule",),
                     "servelm always schedules as LightLLM does with this flag: while requests "
                     "decode, --router_max_wait_tokens N holds new prompts back for N steps (0, the "
                     "default, admits at every step)"),
    AlreadyBehaviour(("--return-token-ids",),
                     "SGLang's /generate already returns each output's token ids (output_ids) "
                     "with its text"),
    AlreadyBehaviour(("--enable-metrics-for-all-schedulers",),
                     "every scheduler already reports: an engine has one scheduler (tensor-"
                     "parallel ranks run its batches and schedule nothing), and with --dp-size > 1 "
                     "/metrics shows each replica's running and waiting requests "
                     "(servelm:dp_replica_*)"),
    AlreadyBehaviour(("--speculative-attention-mode",),
                     "the target verifies the drafts as one multi-token (prefill-style) step",
                     values=("prefill",), bad_value="decode"),
)

# --- rejected, by reason -----------------------------------------------------------------------
# A reason says why: a CUDA-only mechanism, a design choice, or (NOT_BUILT_YET) a feature of an
# open issue (mixture-of-experts parallelism, pre-quantized checkpoints).

NOT_BUILT_YET = "not built yet"

REJECTIONS: tuple[Rejection, ...] = (
    Rejection("not supported: LMCache is a separate library configured through its own files "
              "and environment; servelm's own host and disk tiers are --enable-hierarchical-cache "
              "(with --hicache-storage-backend file)", ("--enable-lmcache",)),
    Rejection("not supported: LoRA adapters with biases (bias=all or lora_only adapters are "
              "refused at load; servelm serves bias-free PEFT LoRA)", ("--enable-lora-bias",)),
    Rejection("not supported: vLLM's fully sharded LoRA layout (with --tp-size > 1 servelm "
              "shards B of the column-parallel and A of the row-parallel layers, vLLM's default, "
              "and replicates the other half)", ("--fully-sharded-loras",)),
    Rejection("not supported: long-context LoRA (adapters with their own rotary scaling)",
              ("--long-lora-scaling-factors",)),
    Rejection("not supported: QLoRA (a bitsandbytes-quantized base with its adapter); serve the "
              "adapter with --lora-paths over a float or --quantization base",
              ("--qlora-adapter-name-or-path",)),
    Rejection("not supported: the chunk size of SGLang's csgmv CUDA kernel (servelm's "
              "torch_native LoRA backend runs two GEMMs per adapter group, with no chunks)",
              ("--max-lora-chunk-size",)),
    Rejection("not supported: the STANDALONE draft model is loaded like --model (a local path or "
              "packaged name, with the model's dtype and --quantization), runs whole on the engine's rank next to "
              "the model and drafts over the request's whole context",
              ("--speculative-draft-model-revision", "--speculative-moe-runner-backend",
               "--speculative-draft-tensor-parallel-size", "-spec-draft-tp",
               "--speculative-model-quantization", "--speculative-max-model-len")),
    Rejection("not supported: servelm's NGRAM proposer drafts one chain from the request's own "
              "prompt and output (--ngram-prompt-lookup-min/max, --num-speculative-tokens) and "
              "keeps no n-gram store shared between requests, so SGLang's cache-tree settings "
              "(capacity, BFS breadth, match type, branch length) have nothing to set",
              ("--speculative-ngram-min-bfs-breadth", "--speculative-ngram-max-bfs-breadth",
               "--speculative-ngram-match-type", "--speculative-ngram-branch-length",
               "--speculative-ngram-capacity")),
    Rejection("not supported: the scheduler gives each step's drafts their KV slots itself "
              "(--num-speculative-tokens), verification is one multi-token pass (no MQA or "
              "batch-expansion scorer to choose), and logprobs of accepted tokens are those of "
              "plain decoding at no extra cost",
              ("--num-lookahead-slots", "--speculative-disable-mqa-scorer",
               "--disable-logprobs-during-spec-decoding")),
    Rejection("not supported: SGLang's asynchronous offload of a decode server's K/V to "
              "storage (servelm's hierarchical cache, --enable-hierarchical-cache, tiers the prefix "
              "cache's blocks; it has no decode-side offload path)",
              ("--disaggregation-decode-enable-offload-kvcache",)),
    Rejection("not needed: a servelm decode server listens on no port of its own for K/V; it "
              "connects to the prefill server's --disaggregation-bootstrap-port",
              ("--pd_decode_rpyc_port",)),
    Rejection("not supported: a failed K/V transfer is not retried; the request ends with an error "
              "(a router may resend the whole request)", ("--pd_max_retry_count",)),
    Rejection("not supported: LightLLM's config server (servelm's prefill and decode servers "
              "register with one PD master: --pd_master_ip/--pd_master_port)",
              ("--config_server_host", "--config_server_port")),
    Rejection("not needed: SGLang's data-parallel controller polls its DP ranks' load this often; "
              "servelm's --enable-dp-attention has one scheduler, which places each new request on the "
              "rank with the fewest sequences in the step that first computes it (no load to poll), "
              "and --dp-size replicas are chosen by --load-balance-method", ("--load-watch-interval",)),
    Rejection("not supported: it makes a PD prefill server assign DP-attention ranks round robin so "
              "the decode server can predict them; servelm refuses --disaggregation-mode with "
              "--enable-dp-attention", ("--prefill-round-robin-balance",)),
    Rejection("not supported: CUDA-only communication kernels (NVLS, symmetric memory, MSCCL++, "
              "FlashInfer's fused all-reduce, custom all-gather); servelm's collectives are plain "
              "torch.distributed groups (gloo and shared memory on CPU, NCCL on CUDA) with no "
              "custom kernel to switch on",
              ("--enable-nccl-nvls", "--enable-symm-mem", "--enable-mscclpp",
               "--enable-torch-symm-mem", "--enable-flashinfer-allreduce-fusion",
               "--enable_custom_allgather", "--enable-p2p-check")),
    Rejection("not supported: overlapping one micro-batch's communication with another's compute "
              "(SGLang's two-batch overlap, LightLLM's micro-batch overlap) hides the all-to-all "
              "of expert parallelism and DP attention on GPUs; servelm runs each step as one batch",
              ("--enable-two-batch-overlap", "--enable-single-batch-overlap",
               "--tbo-token-distribution-threshold", "--enable_prefill_microbatch_overlap",
               "--enable_decode_microbatch_overlap")),
    Rejection("not supported: on CUDA, rank r of a node uses cuda:r; choose the GPUs with "
              "CUDA_VISIBLE_DEVICES", ("--gpu-id-step", "--base-gpu-id")),
    Rejection("not supported: on one node the ranks meet on a free loopback port chosen at "
              "start-up, so there is no port to pick (and no clash between servers); across "
              "nodes give node 0's address with --dist-init-addr host:port",
              ("--nccl-port",)),
    Rejection("not supported: with --nnodes the other nodes learn node 0's step and reply "
              "sockets (ports the OS picks) from the rendezvous at --dist-init-addr, the one "
              "port to open (LightLLM's config server is not used: PD servers register with "
              "--pd_master_ip/--pd_master_port)",
              ("--multinode_httpmanager_port", "--multinode_router_gloo_port",
               "--use_config_server_to_init_nccl")),
    Rejection("not supported: tensor parallelism here splits heads, MLP columns and the "
              "vocabulary with whole activations on every rank (no sequence-parallel mixed mode)",
              ("--enable_tpsp_mix_mode",)),
    Rejection("not supported: rank processes run servelm's own worker (no user worker classes, "
              "no Nsight profiling of Ray workers)",
              ("--worker-cls", "--ray-workers-use-nsight")),
    Rejection("not supported: servelm does not restart itself; a dead engine process or a hung "
              "step (--watchdog-timeout) makes the server exit with an error status, for its "
              "supervisor (systemd, Kubernetes, docker --restart) to restart it; /health and "
              "/health_generate are there for that supervisor's probes",
              ("--health_monitor",)),
    Rejection("not supported: KV cache event publishing for external routers (NVIDIA Dynamo)",
              ("--kv-events-config",)),
    Rejection("not supported: custom logit processors run client-supplied code inside the "
              "engine process (a code execution risk), so servelm keeps them off",
              ("--enable-custom-logit-processor",)),
    Rejection("not supported: servelm runs every architecture with its own modules and never "
              "executes code from a checkpoint (drop the flag)",
              ("--trust-remote-code", "--trust_remote_code")),
    Rejection("not supported: prompt adapters (soft prompts) are not planned",
              ("--enable-prompt-adapter", "--prompt-adapters", "--max-prompt-adapters",
               "--max-prompt-adapter-token")),
    Rejection("not supported: servelm's fp8 K/V cache (--kv-cache-dtype fp8_e4m3/fp8_e5m2) stores K and V "
              "unscaled, rounded to fp8 as they are, so a file of per-layer scaling factors has nothing to "
              "scale (drop the flag)", ("--quantization-param-path",)),
    Rejection("not supported: NVIDIA ModelOpt quantization and its checkpoints (CUDA formats); pre-quantized "
              "GPTQ, AWQ, FP8 and compressed-tensors checkpoints load by path (their config.json "
              "quantization_config), and --quantization w8a8_int8/int8wo/int4wo-<group> quantize at load",
              ("--modelopt-quant", "--modelopt-checkpoint-restore-path", "--modelopt-checkpoint-save-path")),
    Rejection("not supported: LightLLM's --quant_cfg files assign LightLLM's own kernels layer by layer; "
              "servelm quantizes every linear with --quant_type/--quantization, and a pre-quantized "
              "checkpoint's config.json quantization_config says how its layers are stored",
              ("--quant_cfg",)),
    Rejection("not supported: custom logits processors and first-token constraints (use a grammar: "
              "response_format, json_schema, regex, ebnf)",
              ("--first_token_constraint_mode", "--logits-processor-pattern")),
    Rejection("not supported: tool parser plugins (choose a built-in --tool-call-parser)",
              ("--tool-parser-plugin",)),
    Rejection("not supported: LightLLM's redundant-expert file; servelm places redundant experts "
              "itself (--ep-num-redundant-experts, moved by --enable-eplb)",
              ("--ep_redundancy_expert_config_path",)),
    Rejection("not supported: elastic expert parallelism (surviving a lost rank over Mooncake's RDMA "
              "transport); a rank that dies ends the server with an error naming it",
              ("--elastic-ep-backend",)),
    Rejection("not supported: a redundant expert's rows are spread over its replicas round robin "
              "by the row's position in the batch, which every rank computes alike without "
              "exchanging choices; SGLang's static/dynamic/fake dispatch choices are not offered",
              ("--ep-dispatch-algorithm",)),
    Rejection("not supported: EPLB moves every MoE layer's experts in the same forward pass (a "
              "rebalance is a few broadcasts of the moved experts over the tensor-parallel group); "
              "there is no per-chunk schedule to set", ("--eplb-rebalance-layers-per-chunk",)),
    Rejection("not supported: CUDA-only MoE kernels and transports (DeepEP, FlashInfer, Triton, "
              "Mooncake RDMA); servelm runs MoE layers through its own fused CPU path",
              ("--enable-deepep-moe", "--enable-flashinfer-cutlass-moe", "--enable-flashinfer-cutedsl-moe",
               "--enable-flashinfer-trtllm-moe", "--enable-flashinfer-mxfp4-moe", "--enable-triton-kernel-moe",
               "--flashinfer-mxfp4-moe-precision", "--deepep-mode", "--deepep-config",
               "--mooncake-ib-device")),
    Rejection("not supported: servelm serves transformer models only (no Mamba state cache)",
              ("--max-mamba-cache-size", "--mamba-ssm-dtype", "--mamba-full-memory-ratio")),
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
               "--ds-heavy-channel-type", "--ds-sparse-decode-threshold", "--enable_mps",
               "--nsa-prefill-backend", "--nsa-decode-backend", "--enable-profile-cuda-graph",
               "--enable-cudagraph-gc", "--enable-piecewise-cuda-graph",
               "--piecewise-cuda-graph-tokens", "--piecewise-cuda-graph-max-tokens",
               "--triton-attention-split-tile-size", "--enable-pdmux", "--pdmux-config-path",
               "--sm-group-num")),
    Rejection("not supported: servelm's KV pool gives sliding-window layers as many tokens as "
              "full layers (no hybrid SWA pool to size)",
              ("--hybrid-kvcache-ratio", "--swa-full-tokens-ratio")),
    Rejection("not supported: audio inputs (servelm's multimodal models take images only)",
              ("--enable_multimodal_audio",)),
    Rejection("not supported: the vision tower has no server of its own: it runs inside the "
              "engine process on the model's device and threads (no visual GPU ids or NCCL "
              "ports), and encodes the images an engine step needs together (no separate batch "
              "size)", ("--visual_infer_batch_size", "--visual_gpu_ids", "--visual_nccl_ports")),
    Rejection("not supported: the encoder cache drops the least recently used image one at a "
              "time when it is full (--encoder-cache-capacity); there is no bulk clearing down to "
              "a reserved ratio", ("--cache_reserved_ratio",)),
    Rejection("not supported: quantizing the vision tower; it runs unquantized, in the model's "
              "dtype", ("--vit_quant_type", "--vit_quant_cfg")),
    Rejection("not supported: servelm serves text generation and embeddings only (no reward "
              "models or multi-item scoring; no token-healing mode)",
              ("--use_reward_model", "--multi-item-scoring-delimiter", "--token_healing_mode")),
    Rejection("not supported: a forward pass hands back only each request's sampled tokens and "
              "their logprobs; no hidden-state vectors leave the model runner (a prompt's pooled "
              "vector is what --is-embedding serves at /v1/embeddings)",
              ("--enable-return-hidden-states",)),
    Rejection("not supported: a block-count override (size the KV pool with "
              "--max-total-tokens or --mem-fraction-static)",
              ("--num-gpu-blocks-override",)),
    Rejection("not supported: weights stay in memory for the server's lifetime (no layer "
              "offloading, no release and resume of weights or KV)",
              ("--offload-group-size", "--offload-num-in-group", "--offload-prefetch-step",
               "--offload-mode", "--enable-memory-saver", "--enable-weights-cpu-backup")),
    Rejection("not supported: --middleware imports and runs user code (an import path) inside "
              "the server process; servelm runs no code the command line names (its own "
              "middleware: --api-key, --allowed-origins, --max-request-body-bytes)",
              ("--middleware",)),
    Rejection("not supported: servelm has no file API (/v1/files, batches), so there is no file "
              "storage to place", ("--file-storage-pth",)),
    Rejection("not supported: SGLang's named warm-up functions (its warmup.py registry) do not "
              "exist here; servelm warms up by itself before it reports ready (prefill chunks and "
              "decode batches; --skip-server-warmup turns it off)", ("--warmups",)),
    Rejection("not supported: the process layout is fixed (engine core in its own process, "
              "ZMQ IPC, tokenization in the front end)",
              ("--zmq_mode", "--disable-frontend-multiprocessing", "--disable-async-output-proc",
               "--multi-step-stream-outputs", "--tokenizer-pool-size", "--tokenizer-pool-type",
               "--tokenizer-pool-extra-config", "--enable-dynamic-batch-tokenizer",
               "--tokenizer-worker-num", "--enable-tokenizer-batch-encode",
               "--dynamic-batch-tokenizer-batch-size", "--dynamic-batch-tokenizer-batch-timeout")),
    Rejection("not supported: placing processes on NUMA nodes (start servelm under numactl or "
              "taskset; --num-threads sets the engine's threads)", ("--numa-node",)),
    Rejection("not supported: servelm runs its own model code from the checkpoint's config and "
              "weights; this loading option has no equivalent",
              ("--code-revision", "--tokenizer-revision", "--ignore-patterns",
               "--max-parallel-loading-workers", "--model-loader-extra-config",
               "--override-neuron-config", "--delete-ckpt-after-loading", "--model-impl",
               "--custom-weight-loader", "--weight-loader-disable-mmap",
               "--remote-instance-weight-loader-seed-instance-ip",
               "--remote-instance-weight-loader-seed-instance-service-port",
               "--remote-instance-weight-loader-send-weights-group-ports")),
    Rejection("not supported: change model config fields with --hf-overrides (a JSON object), "
              "e.g. --hf-overrides '{\"rope_theta\": 1000000}'",
              ("--rope-scaling", "--rope-theta")),
    Rejection("not supported: end-of-sequence ids come from the model's generation config "
              "(requests can add stop_token_ids)", ("--eos_id",)),
    Rejection("not supported: sliding-window attention follows the model config",
              ("--disable-sliding-window",)),
    Rejection("not supported: prompts are bounded only by the context length "
              "(--context-length / --max_req_total_len)", ("--max_req_input_len",)),
    Rejection("not supported: servelm dumps the tensors of the requests it serves "
              "(--debug-tensor-dump-output-folder); send the input as a request (input_ids at "
              "/generate) rather than as a start-up input file", ("--debug-tensor-dump-input-file",)),
    Rejection("not supported: feeding a reference implementation's (JAX) layer outputs into every "
              "layer is a harness for SGLang's own model ports; compare servelm's dumps "
              "(--debug-tensor-dump-output-folder) with transformers instead",
              ("--debug-tensor-dump-inject",)),
    Rejection("not a server option: --shm-size is a `docker run` flag (shared memory for the "
              "container)", ("--shm-size",)),
)

NEEDS: tuple[tuple[str, str], ...] = (
    ("allowed_methods", "allowed_origins"),
    ("allowed_headers", "allowed_origins"),
    ("allow_credentials", "allowed_origins"),
    ("ssl_ca_certs", "ssl_certfile"),
    ("ssl_keyfile", "ssl_certfile"),
    ("ssl_cert_reqs", "ssl_certfile"),
    ("torch_compile_max_bs", "enable_torch_compile"),
    ("bucket_time_to_first_token", "enable_metrics"),
    ("bucket_inter_token_latency", "enable_metrics"),
    ("bucket_e2e_request_latency", "enable_metrics"),
    ("speculative_eagle_topk", "speculative_algorithm"),
    ("speculative_num_steps", "speculative_algorithm"),
    ("speculative_token_map", "speculative_algorithm"),
    ("num_speculative_tokens", "speculative_algorithm"),
    ("ngram_prompt_lookup_max", "speculative_algorithm"),
    ("ngram_prompt_lookup_min", "speculative_algorithm"),
    ("ngram_draft_length", "speculative_algorithm"),
    ("speculative_disable_by_batch_size", "speculative_algorithm"),
    ("spec_decoding_acceptance_method", "speculative_algorithm"),
    ("typical_acceptance_sampler_posterior_threshold", "spec_decoding_acceptance_method"),
    ("typical_acceptance_sampler_posterior_alpha", "spec_decoding_acceptance_method"),
    *((name, "enable_hierarchical_cache") for name in (
        "hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_io_backend",
        "hicache_mem_layout", "hicache_host_dtype", "hicache_storage_backend",
        "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config")),
    ("hicache_storage_backend_extra_config", "hicache_storage_backend"),
    ("disaggregation_bootstrap_port", "disaggregation_mode"),
    ("disaggregation_transfer_backend", "disaggregation_mode"),
    ("disaggregation_transfer_timeout", "disaggregation_mode"),
    ("disaggregation_decode_tp", "disaggregation_mode"),
    ("num_reserved_decode_tokens", "disaggregation_mode"),
    ("disaggregation_decode_polling_interval", "disaggregation_mode"),
    ("pd_master_ip", "disaggregation_mode"),
    ("pd_master_port", "disaggregation_mode"),
    ("return_all_prompt_logprobs", "use_tgi_api"),
    ("router_max_new_token_len", "router_token_ratio"),
    ("collect_tokens_histogram", "enable_metrics"),
    ("prompt_tokens_buckets", "collect_tokens_histogram"),
    ("generation_tokens_buckets", "collect_tokens_histogram"),
    ("tokenizer_metrics_custom_labels_header", "tokenizer_metrics_allowed_custom_labels"),
    ("expert_parallel_size", "tensor_parallel_size"),
    ("enable_expert_parallel", "tensor_parallel_size"),
    ("ep_num_redundant_experts", "expert_parallel_size"),
    ("enable_dp_attention", "tensor_parallel_size"),
    ("enable_dp_lm_head", "enable_dp_attention"),
    ("enable_eplb", "expert_parallel_size"),
    ("eplb_rebalance_num_iterations", "enable_eplb"),
    ("eplb_min_rebalancing_utilization_threshold", "enable_eplb"),
    ("expert_distribution_recorder_buffer_size", "expert_distribution_recorder_mode"),
    ("enable_expert_distribution_metrics", "enable_metrics"),
    ("job_name", "metric_gateway"),
    ("grouping_key", "metric_gateway"),
    ("push_interval", "metric_gateway"),
    ("enable_monitor_auth", "metric_gateway"),
)
"""(field, needed): a non-default ``field`` means nothing unless ``needed`` is set too, so it is
refused at start-up rather than ignored."""

PARSER_OPTIONS: dict[str, str] = {
    "--config": "a YAML file of options (servelm.cli_args reads it; flags override it)",
    "--dry-run": "validate the command line and print the resolved config as YAML",
    "--help": "print the options and exit", "-h": "print the options and exit",
}
"""Options of the parser itself rather than of a config field."""


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


def field_defaults() -> dict[str, Any]:
    """Field name -> default value, over every section of EngineConfig."""
    defaults: dict[str, Any] = {}
    for section_name, section in EngineConfig.sections().items():
        values = getattr(EngineConfig(), section_name)
        for f in dataclasses.fields(section):
            defaults[f.name] = getattr(values, f.name)
    return defaults


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
    if flag in implemented_flags() or flag in PARSER_OPTIONS:
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

    for name, needed in NEEDS:
        if name not in fields or needed not in fields:
            raise ValueError(f"NEEDS names an unknown field: {name!r} or {needed!r}")
    for alias in ALIASES:
        if alias.field not in fields:
            raise ValueError(f"alias {alias.flags} names unknown field {alias.field!r}")
        for flag in alias.flags:
            claim(flag, "alias")
    for flag in PARSER_OPTIONS:
        claim(flag, "parser option")
    for entry in ALREADY_BEHAVIOUR:
        for contradiction in entry.contradicts:
            if contradiction.field not in fields:
                raise ValueError(f"{entry.flags}: contradiction names unknown field "
                                 f"{contradiction.field!r}")
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
    lines.append("\nOptions of the parser:")
    lines += [f"  {flag:34} {what}" for flag, what in PARSER_OPTIONS.items()]
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
