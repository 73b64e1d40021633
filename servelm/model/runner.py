"""ModelRunner: one rank's worker. It owns its shard of the model and its KV pool, and turns a
BatchPlan into float32 logits.

Invariants:
- The pool holds ``num_blocks * block_size`` token slots per layer, sized once at start-up and never
  grown; block ids in every plan must be below ``num_blocks`` (the scheduler allocates them).
- Sizing is a handshake: ``kv_capacity_blocks()`` says what this rank could hold; the engine takes
  the minimum over the ranks and calls ``init_kv_cache(num_blocks)`` on every rank (a runner built
  with ``defer_kv_cache=False``, as tests do, sizes itself to its own capacity at once).
- Under tensor parallelism every rank executes the same plans in the same order (their collectives
  pair up) and every rank returns the full logits; the engine reads rank 0's.
- Under pipeline parallelism (servelm.model.pipeline) every stage executes every plan too, in
  micro-batches: a stage receives each micro-batch's hidden states from the stage before, runs its
  layers and sends them on; only the last stage returns logits (the others an empty tensor). Its
  pool holds K/V for its own layers only, so its capacity is counted from them.
- ``execute`` writes the K/V of every planned token and returns logits only for the rows the plan
  asks for: ``[plan.num_logits, vocab_size]`` in plan order.
- ``task`` is fixed at start-up (``servelm.model.pooling.resolve_task``): a generate runner only
  executes, an embed runner only pools (``pool``: one float32 vector per sequence, every sequence
  a whole prompt). An embed runner's pool holds at most one step of prompts (embedding requests
  free their blocks in the step that computes them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psutil
import torch

from servelm.config import CacheConfig, EngineConfig
from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import set_residual_dtype
from servelm.model.architectures.moe_block import RoutedExpertsBlock
from servelm.model.attention import Attention, LatentAttention, get_attention_backend, prefill_routes
from servelm.model.compile import compile_decode_layers, warm_up
from servelm.model.dp_attention import AttentionRanks, rank_share, run_idle_experts
from servelm.model.expert_load import build_expert_load
from servelm.model.forward_batch import BatchPlan, ForwardBatch
from servelm.model.gguf.gguf_weights import (GGUF_MODES, apply_gguf_blocks, gguf_model_dtype, load_gguf_model,
                                             has_routed_experts, resolve_quantization)
from servelm.model.kv_cache import KVCache, pool_class
from servelm.model.layers.linear import LinearBase
from servelm.model.gguf.lm_head_screen import head_logits, setup_screen
from servelm.model.layers.f32_rows import apply_dense_routes
from servelm.model.layers.quantization import quantize_model
from servelm.model.prequantized import (LoadReport, QuantSpec, apply_prequantized_blocks, dequantizing_weights,
                                       serve_blocks)
from servelm.model.prequantized import detect as detect_prequantized
from servelm.model.prequantized import resolve as resolve_prequantized
from servelm.model.loader import (
    DTYPES, dtype_reason, load_model, resolve_device, resolve_dtype, resolve_residual_dtype)
from servelm.model.pipeline import PipelineStage
from servelm.model.pooling import (PoolerConfig, architecture_label, pool, resolve_pooler_config,
                                    resolve_task)
from servelm.model.onednn import configure_onednn_cache
from servelm.model.tensor_dump import TensorDumper
from servelm.model.threads import ThreadGovernor, configure_engine_threads, log_openmp_wait_policy
from servelm.multimodal.encoder_cache import EncoderCache

if TYPE_CHECKING:
    from servelm.model.source import ModelSource

logger = logging.getLogger(__name__)

MAX_CPU_KV_TOKENS = 2 ** 18
"""Cap on the CPU pool when sized from free RAM (262,144 tokens = 64 requests x 4,096 tokens): a CPU
cannot usefully decode more context than that at once, and zero-filling a bigger pool only delays
start-up and takes RAM from the other processes on a shared host. --max-total-tokens overrides it."""


DEFAULT_CPU_POOL_SHARE = 1 / 16
"""With --mem-fraction-static left at its default, a CPU pool takes at most this share of total RAM
(1.5 GiB of a 24 GiB host; SmolLM2-135M's float32 K/V: 34k tokens), so several servers, or ranks,
fit on one host; an idle server reserved 30% of free RAM (6.7 GiB) before (issue 19)."""


def kv_pool_blocks(cache: CacheConfig, bytes_per_token: int, device: torch.device,
                   demand_tokens: int | None = None,
                   memory_bytes: tuple[int, int] | None = None) -> int:
    """Number of KV blocks: ``max_total_tokens`` if set, else the smallest of
    ``mem_fraction_static`` of free memory, ``demand_tokens`` (max running requests x context:
    more can never be in use) and, on CPU with the default fraction, DEFAULT_CPU_POOL_SHARE of
    total RAM and MAX_CPU_KV_TOKENS. ``memory_bytes`` (free, total) defaults to the device's.
    Logs the size, what bounded it and the flags that change it."""
    if cache.max_total_tokens is not None:
        return cache.max_total_tokens // cache.page_size
    if memory_bytes is None:
        if device.type == "cuda":
            memory_bytes = torch.cuda.mem_get_info(device)
        else:
            memory = psutil.virtual_memory()
            memory_bytes = (memory.available, memory.total)
    free_bytes, total_bytes = memory_bytes
    bounds = {f"--mem-fraction-static {cache.mem_fraction_static:g} of free memory":
              int(free_bytes * cache.mem_fraction_static) // bytes_per_token}
    if demand_tokens is not None:
        bounds["max running requests x context length"] = demand_tokens
    if device.type == "cpu":
        bounds["the CPU cap"] = MAX_CPU_KV_TOKENS
        default_fraction = next(f.default for f in dataclasses.fields(CacheConfig)
                                if f.name == "mem_fraction_static")
        if cache.mem_fraction_static == default_fraction:
            bounds[f"1/{round(1 / DEFAULT_CPU_POOL_SHARE)} of total RAM"] = \
                int(total_bytes * DEFAULT_CPU_POOL_SHARE) // bytes_per_token
    reason, tokens = min(bounds.items(), key=lambda item: item[1])
    num_blocks = tokens // cache.page_size
    if num_blocks < 1:
        raise RuntimeError(f"not enough free memory for one KV block ({free_bytes} bytes free, "
                           f"{bytes_per_token * cache.page_size} bytes per block); lower the model "
                           "size or raise --mem-fraction-static")
    logger.info("KV pool: %d tokens (%.1f MiB), bounded by %s; set --max-total-tokens N to choose "
                "the size (or --mem-fraction-static F for a share of free memory)",
                num_blocks * cache.page_size, num_blocks * cache.page_size * bytes_per_token / 2 ** 20,
                reason)
    return num_blocks


class ModelRunner:
    """Runs our model for one EngineConfig and ModelSource."""

    def __init__(self, config: EngineConfig, source: ModelSource, attention_backend: str = "torch_native", *,
                 parallel: ParallelContext | None = None, device: torch.device | None = None,
                 defer_kv_cache: bool = False) -> None:
        self.config = config
        self.thread_governor: ThreadGovernor | None = None
        """Adapts torch's thread count to other processes' load (see --disable-adaptive-threads)."""
        configure_onednn_cache(config.runtime.onednn_primitive_cache_capacity)  # before any op
        self.parallel = dataclasses.replace(parallel or ParallelContext.single(), ep_size=config.parallel.ep_size,
                                            num_redundant_experts=config.parallel.ep_num_redundant_experts)
        self.attention_ranks: AttentionRanks | None = (AttentionRanks(self.parallel.tp_size)
                                                       if config.parallel.enable_dp_attention else None)
        """--enable-dp-attention: each sequence's rank (model/dp_attention.py); None: no DP attention."""
        model_parallel = (dataclasses.replace(ParallelContext.single(), expert_ranks=self.parallel)
                          if self.attention_ranks is not None else self.parallel)
        """What the model is built for: under DP attention every layer whole except the routed experts."""
        if self.parallel.tp_size == 1 and self.parallel.pp_size == 1:  # a rank's threads are placed by its launcher (distributed/)
            threads = configure_engine_threads(config.runtime.num_threads)
            log_openmp_wait_policy(config.runtime.omp_wait_policy)
            if (not config.runtime.disable_adaptive_threads and threads > 1
                    and not config.runtime.enable_deterministic_inference  # fixed reduction splits
                    and ThreadGovernor.supported()):
                self.thread_governor = ThreadGovernor(threads)
        self.device = device or resolve_device(config.model.device)
        self.prequantized = detect_prequantized(source.hf_config)
        """The checkpoint's own quantization (GPTQ, AWQ, FP8, compressed-tensors, bitsandbytes), or None."""
        flag, quantization_reason = resolve_prequantized(config.model.quantization, self.prequantized,
                                                          config.model.load_format)
        if self.prequantized is not None:
            self.quantization = self.prequantized.method
        else:
            self.quantization, quantization_reason = resolve_quantization(
                flag, getattr(source, "gguf_path", None), self.parallel, self.device,
                config.runtime.enable_torch_compile, config.model.dtype,
                has_experts=has_routed_experts(source.hf_config.get_text_config()))
        """``--quantization`` with ``auto`` resolved: gguf (the file's own blocks) or a requantization."""
        if self.attention_ranks is not None and self.quantization in GGUF_MODES:
            if flag != "auto":
                raise ValueError(f"--quantization {flag} with --enable-dp-attention is not built: DP attention "
                                 "runs on float weights; use --quantization none (dequantized)")
            self.quantization, quantization_reason = "none", ("auto: DP attention runs on float weights, so "
                                                              "the GGUF is dequantized")
        if self.parallel.ep_size > 1 and self.quantization in GGUF_MODES and (
                self.parallel.num_redundant_experts or config.parallel.enable_eplb):
            raise ValueError("--ep-num-redundant-experts / --enable-eplb with a GGUF file's blocks: EPLB copies "
                             "and moves float expert stacks, not GGUF blocks; use --quantization none "
                             "(dequantized experts) for EPLB")
        self.dtype = (gguf_model_dtype(config.model.dtype, self.device)[0] if self.quantization in GGUF_MODES
                      else resolve_dtype(config.model.dtype, source.hf_config, self.device))
        self.hf_config = source.hf_config
        self.task = resolve_task(config.model.task, source.hf_config)
        self.pooler: PoolerConfig | None = None
        """How hidden states become embeddings (task embed only)."""
        if self.task == "embed":
            if config.runtime.enable_torch_compile:  # --task auto chose embed (EngineConfig refuses embed)
                raise ValueError(f"--enable-torch-compile compiles decode steps; "
                                 f"{architecture_label(source.hf_config)} serves embeddings (task embed), "
                                 "which have none, so nothing would be compiled")
            self.pooler = resolve_pooler_config(source.model_path, source.hf_config,
                                                config.model.override_pooler_config)
        logger.info("quantization %s (%s)", self.quantization, quantization_reason)
        if self.quantization in GGUF_MODES and source.weights is not None:  # blocks first, then the rest
            self.model = load_gguf_model(source.hf_config, source.gguf_path, self.dtype, self.device,
                                         GGUF_MODES[self.quantization], self.parallel)
        else:
            weights, load_report = source.weights, LoadReport()
            if self.prequantized is not None and weights is not None:
                weights = dequantizing_weights(weights, self.prequantized, load_report)
            self.model = load_model(source.hf_config, weights, self.dtype, self.device,
                                    config.model.seed, model_parallel)
        if self.quantization in GGUF_MODES:
            if source.weights is None:   # --load-format dummy
                apply_gguf_blocks(self.model, source.gguf_path, GGUF_MODES[self.quantization], check=False)
        elif self.prequantized is not None:
            self._serve_prequantized(self.prequantized, load_report)
        else:
            quantize_model(self.model, self.quantization)
        self.residual_dtype, residual_reason = resolve_residual_dtype(config.model.residual_dtype, self.dtype,
                                                                      self.device)
        """The decoder's residual stream dtype (``--residual-dtype``; the model dtype where it has none)."""
        if self.residual_dtype != self.dtype:
            if not set_residual_dtype(self.model, self.residual_dtype):
                if config.model.residual_dtype == "float32":
                    raise ValueError(f"--residual-dtype float32: {type(self.model).__name__} has no decoder "
                                     "residual stream to keep in float32")
                self.residual_dtype = self.dtype
            else:
                logger.info("residual stream %s (%s)", str(self.residual_dtype).removeprefix("torch."),
                            residual_reason)
        if config.model.enable_fp32_lm_head and self.dtype != torch.float32:
            self._set_fp32_lm_head()
        self._moe_blocks = [m for m in self.model.modules() if isinstance(m, RoutedExpertsBlock)]
        """The MoE blocks in layer order (a DP-attention rank with no rows still calls their experts)."""
        if self.attention_ranks is not None and not self._moe_blocks:
            raise ValueError(f"--enable-dp-attention: {type(self.model).__name__} has no mixture-of-experts "
                             "layer, so nothing would run across the ranks (use --dp-size for replicas)")
        self.dense_routes = apply_dense_routes(self.model) if self.device.type == "cpu" else None
        """Float32 dense weights' few-rows kernel vs oneDNN per row class (layers/f32_rows.py), or None."""
        self.expert_load = build_expert_load(self.model, self.parallel, config,
                                             has_routed_experts(source.hf_config.get_text_config()))
        """MoE routing counts: the recorder, /metrics' totals and EPLB (None where no flag asks)."""
        self.lm_head_screen = setup_screen(self.model, config.runtime.disable_lm_head_screen, self.parallel,
                                           self.device, self.task)
        """Greedy rows' exact argmax from a 5-bit copy of a Q8_0 head (None: every row the full head)."""
        if self.parallel.pp_size > 1 and self.task != "generate":
            raise ValueError("--pipeline-parallel-size > 1 serves generation only (--task generate)")
        lm_head = getattr(self.model, "lm_head", None)
        self.vocab_size: int = (lm_head.vocab_size if lm_head is not None
                                else source.hf_config.get_text_config().vocab_size
                                if self.parallel.pp_size > 1 else self.model.vocab_size)
        self.hidden_size: int = source.hf_config.get_text_config().hidden_size
        self.block_size = config.cache.page_size
        self._attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self._attention_layers[0]
        self.num_kv_heads: int = first.num_kv_heads
        """KV heads this rank holds (its shard; replicated heads count once per rank)."""
        self.kv_dtype = self.dtype if config.cache.kv_cache_dtype == "auto" else DTYPES[config.cache.kv_cache_dtype]
        self.lora_dtype = self.dtype if config.lora.lora_dtype == "auto" else DTYPES[config.lora.lora_dtype]
        """Dtype of installed adapters' weights and their deltas (--lora-dtype)."""
        self._pool_class = pool_class(first.latent)
        """The pool's kind: MLA models' latent rows, else per-head K and V."""
        self.kv_bytes_per_token = self._pool_class.bytes_per_token(
            len(self._attention_layers), first.num_kv_heads, first.head_dim, self.kv_dtype, first.v_head_dim)
        context_length = getattr(source, "context_length", None)
        self._demand_tokens = (config.scheduler.max_running_requests * context_length
                               if context_length else None)
        """Tokens the scheduler could ever hold at once (max running requests x context): a
        default pool needs no more."""
        self.attention = get_attention_backend(attention_backend)
        self._prefill_shapes: list[prefill_routes.PrefillShape] = []
        if self.device.type == "cpu" and hasattr(self.attention, "prefill_routing"):
            self._prefill_shapes = prefill_routes.model_shapes(self._attention_layers, self.dtype, self.kv_dtype)
            self.attention.prefill_routing = prefill_routes.build_routing(self._prefill_shapes)
        self._stage = PipelineStage(self.model, self.parallel, self.block_size, self.hidden_size,
                                    self.residual_dtype, self.device, self.attention, self.vocab_size,
                                    config.parallel.pp_max_micro_batch_size,
                                    self.bidirectional_images, self._attach_images)
        """This rank's part of a pipeline step (used at pp > 1 only)."""
        self.encoder_cache = EncoderCache(capacity_items=config.multimodal.encoder_cache_capacity)
        """A vision-language model's encoded images by digest (servelm.multimodal.encoder_cache)."""
        self.tensor_dumper: TensorDumper | None = None
        """--debug-tensor-dump-output-folder: writes every forward pass's tensors."""
        if config.observability.debug_tensor_dump_output_folder is not None:
            self.tensor_dumper = TensorDumper(config.observability.debug_tensor_dump_output_folder,
                                              self.model, self.parallel.tp_rank)
        self.num_blocks = 0
        """Blocks in the KV pool; 0 until ``init_kv_cache``."""
        self.kv_cache: KVCache | None = None
        self.kv_cache_bytes = 0
        if not defer_kv_cache:
            self.init_kv_cache(self.kv_capacity_blocks())

    def kv_capacity_blocks(self, ranks_sharing_memory: int = 1) -> int:
        """Blocks this rank's pool could hold (``--max-total-tokens``, or ``--mem-fraction-static``
        of free memory). ``ranks_sharing_memory``: ranks that size their pools from the same memory
        at once (the TP ranks of one CPU host), each taking its share.

        Under DP attention the answer is the engine's block count, all ranks' pools together: what
        one process would allocate for the same flags (every rank holds every layer's K/V heads, so
        a token costs the same bytes), a multiple of the ranks, each rank's pool holding an equal
        partition (``init_kv_cache``) -- as SGLang divides the budget among DP ranks. The ranks'
        pools thus take the memory one process's pool would (on one CPU host), never N times it."""
        ranks = self.config.parallel.attention_dp_size
        if ranks > 1:
            num_blocks = kv_pool_blocks(self.config.cache, self.kv_bytes_per_token, self.device, self._demand_tokens)
            if num_blocks < ranks:
                raise RuntimeError(f"the KV pool's {num_blocks} blocks do not give each of the {ranks} DP-attention "
                                   "ranks one; raise --max-total-tokens or --mem-fraction-static")
            return num_blocks // ranks * ranks
        num_blocks = kv_pool_blocks(self.config.cache, self.kv_bytes_per_token * ranks_sharing_memory,
                                    self.device, self._demand_tokens)
        if self.task == "embed":  # one step's prompts, each rounded up to whole blocks
            scheduler = self.config.scheduler
            step_blocks = -(-scheduler.max_prefill_tokens // self.block_size)
            num_blocks = min(num_blocks, step_blocks + scheduler.max_running_requests)
        return num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool with the block count the engine chose (once); under DP attention
        this rank's pool holds its partition, ``num_blocks / ranks`` of them."""
        assert self.kv_cache is None, "the KV pool is sized once"
        first = self._attention_layers[0]
        self.num_blocks = num_blocks
        pool_blocks = num_blocks
        if self.attention_ranks is not None:
            assert num_blocks % self.attention_ranks.num_ranks == 0, "equal partitions (kv_capacity_blocks)"
            pool_blocks = self.attention_ranks.blocks_per_rank = num_blocks // self.attention_ranks.num_ranks
        self.kv_cache = self._pool_class(len(self._attention_layers), pool_blocks, self.block_size,
                                         first.num_kv_heads, first.head_dim, self.kv_dtype, self.device,
                                         first_layer=min(layer.layer_id for layer in self._attention_layers),
                                         v_head_dim=first.v_head_dim)
        self.kv_cache_bytes = self.kv_cache.nbytes
        config = self.config
        logger.info("model %s on %s, dtype %s (%s)%s%s; KV pool %d blocks x %d = %d tokens, %.1f MiB "
                    "(%s, %d bytes per token)",
                    type(self.model).__name__, self.device, str(self.dtype).removeprefix("torch."),
                    gguf_model_dtype(config.model.dtype, self.device)[1]
                    if self.quantization in GGUF_MODES
                    else dtype_reason(config.model.dtype, self.device),
                    f", tp rank {self.parallel.tp_rank}/{self.parallel.tp_size}"
                    if self.parallel.tp_size > 1 else "",
                    f", pp stage {self.parallel.pp_rank}/{self.parallel.pp_size} (layers "
                    f"{self._attention_layers[0].layer_id}..{self._attention_layers[-1].layer_id})"
                    if self.parallel.pp_size > 1 else "",
                    pool_blocks, self.block_size, pool_blocks * self.block_size,
                    self.kv_cache_bytes / 2 ** 20, str(self.kv_dtype).removeprefix("torch."),
                    self.kv_bytes_per_token)
        if self.attention_ranks is not None:
            logger.info("DP attention: rank %d's pool holds its own requests' K/V: %d tokens (%d blocks, "
                        "partition %d of %d: the engine's blocks %d..%d); all ranks together %d tokens, %.1f MiB, "
                        "what one process would allocate for the same --max-total-tokens / "
                        "--mem-fraction-static; a request runs on one rank, so it can hold at most %d tokens",
                        self.parallel.tp_rank, pool_blocks * self.block_size, pool_blocks, self.parallel.tp_rank,
                        self.attention_ranks.num_ranks, self.parallel.tp_rank * pool_blocks,
                        (self.parallel.tp_rank + 1) * pool_blocks - 1, num_blocks * self.block_size,
                        num_blocks * self.block_size * self.kv_bytes_per_token / 2 ** 20,
                        pool_blocks * self.block_size)
        if first.latent:
            logger.info("KV pool holds the latent (multi-head latent attention): %s",
                        self.kv_pool_layout()["note"])
        if self.pooler is not None:
            logger.info("task embed: %s pooling%s, %d-dim vectors", self.pooler.pooling_type,
                        " + L2 normalize" if self.pooler.normalize else "", self.hidden_size)
        if config.runtime.enable_torch_compile:
            self._compile(config.runtime.torch_compile_max_bs)

    def kv_pool_layout(self) -> dict[str, Any]:
        """What a token costs in the pool (the start-up log and /get_server_info): per-head K and V,
        or MLA's latent rows beside the per-head K/V they stand for (``--disable-mla``'s pool)."""
        first, num_layers = self._attention_layers[0], len(self._attention_layers)
        layout: dict[str, Any] = {"kind": "latent" if first.latent else "per_head",
                                  "bytes_per_token": self.kv_bytes_per_token}
        if self.attention_ranks is not None:
            ranks = self.attention_ranks
            layout["dp_attention"] = {"ranks": ranks.num_ranks, "blocks_per_rank": ranks.blocks_per_rank,
                                      "tokens_per_rank": ranks.blocks_per_rank * self.block_size,
                                      "total_tokens": ranks.num_ranks * ranks.blocks_per_rank * self.block_size}
        if isinstance(first, LatentAttention):
            k_width, v_width = first.expanded_dims
            expanded = KVCache.bytes_per_token(num_layers, first.num_heads, k_width, self.kv_dtype, v_width)
            layout.update(latent_width=first.head_dim, expanded_bytes_per_token=expanded,
                          note=f"{first.head_dim} values per token and layer, {self.kv_bytes_per_token} bytes "
                               f"per token against {expanded} for the expanded per-head K/V of "
                               f"{first.num_heads} heads ({expanded / self.kv_bytes_per_token:.1f}x smaller)")
        return layout

    def _serve_prequantized(self, spec: QuantSpec, report: LoadReport) -> None:
        """After a pre-quantized checkpoint loaded dequantized: its integer codes take the block
        routes where ``serve_blocks`` allows, else the exact dequantized weights serve."""
        runtime, parallel = self.config.runtime, self.config.parallel
        is_sharded = self.parallel.tp_size > 1 and self.attention_ranks is None   # DP attention: layers whole
        serve, why = serve_blocks(self.config.model.quantization, self.config.model.dtype, self.parallel.tp_size,
                                  self.parallel.pp_size, self.device, runtime.enable_torch_compile, spec,
                                  has_experts=has_routed_experts(self.hf_config.get_text_config()),
                                  is_sharded=is_sharded,
                                  moves_experts=self.parallel.ep_size > 1 and (
                                      self.parallel.num_redundant_experts > 0 or parallel.enable_eplb))
        notes = "; ".join(spec.notes)
        if report.dropped:
            notes = (notes + "; " if notes else "") + f"{report.dropped} activation scale tensors dropped"
        logger.info("pre-quantized %s: %d quantized modules dequantized exactly at load%s; %s%s",
                    spec.description, report.dequantized,
                    f" ({len(report.dense_only)} without integer blocks)" if report.dense_only else "",
                    why, f"; {notes}" if notes else "")
        if serve and report.blocks:
            apply_prequantized_blocks(self.model, report, spec.method, experts_only=is_sharded)

    def _set_fp32_lm_head(self) -> None:
        """--enable-fp32-lm-head on a 16-bit model: the head computes from a float32 copy of its
        weight, with float32 hidden states."""
        lm_head = getattr(self.model, "lm_head", None)
        if lm_head is None:  # an embedding model or an earlier pipeline stage: no head here
            return
        if lm_head.linear_method is not None:
            raise ValueError(f"--enable-fp32-lm-head cannot be combined with --quantization {self.quantization}: "
                             "the LM head's weight is quantized, so there is no float weight to compute from")
        lm_head.fp32_weight = lm_head.weight.detach().float()
        logger.info("LM head computes in float32 (--enable-fp32-lm-head): %.1f MiB float32 copy of its weight",
                    lm_head.fp32_weight.nbytes / 2 ** 20)

    def _compile(self, max_bs: int) -> None:
        """--enable-torch-compile: compile the decode graphs now, so no request waits for them."""
        num_layers = compile_decode_layers(self.model, max_bs)
        seconds = warm_up(self.execute, max_bs)
        if self.expert_load is not None:   # the dummy decodes routed rows no request sent
            self.expert_load.forget()
        logger.info("torch.compile: %d decoder layers compiled (inductor) for decode steps of 1..%d "
                    "sequences in %.1f s; prefill stays eager", num_layers, max_bs, seconds)

    def rank_kv_capacity_blocks(self) -> list[int]:
        """Per rank, the blocks its pool could hold: this one rank (the engine's Runner protocol)."""
        return [self.kv_capacity_blocks()]

    def layout(self) -> dict[str, Any]:
        """The parallel layout, for /get_server_info."""
        return {**self.parallel.describe(), "executor": "in-process",
                "ranks": [{"rank": 0, "pid": os.getpid(), "num_kv_heads": self.num_kv_heads,
                           "num_threads": torch.get_num_threads()}]}

    def routes_summary(self) -> dict[str, Any] | None:
        """The GGUF linears' chosen routes per row class and where they came from (model/routes.py),
        and the prefill attention's per shape and query class (``prefill_attention``:
        attention/prefill_routes.py), for /get_server_info; None where neither is routed."""
        report = next((report for module in self.model.modules()
                       if (report := getattr(getattr(module, "linear_method", None), "route_report", None))
                       is not None), None)
        if self.dense_routes is not None:
            report = {**(report or {}), "float32_dense": self.dense_routes}
        routing = getattr(self.attention, "prefill_routing", None)
        if routing is None or not self._prefill_shapes:
            return report
        return {**(report or {}), "prefill_attention": routing.summary(self._prefill_shapes)}

    def shutdown(self) -> None:
        """Nothing to stop: this runner lives in the engine's process."""

    def set_lora(self, slot: int, entries: Iterable[tuple[int, str, int | str | None, torch.Tensor,
                                                          torch.Tensor, float]]) -> None:
        """Install adapter ``slot`` (> 0): (layer index, linear attribute such as ``qkv_proj``, shard
        id in a fused layer or None, A, B, scale) per target. Replaces what the slot held."""
        assert slot > 0, "slot 0 is the base model"
        if self.parallel.pp_size > 1:
            raise ValueError("LoRA adapters are not supported with --pp-size > 1 yet")
        layers = self._lora_layers()
        self.remove_lora(slot)
        try:
            for layer, attr, shard_id, a, b, scale in entries:
                target = layers.get((layer, attr))
                if target is None:
                    raise ValueError(f"the model has no {attr} in layer {layer} for a LoRA delta")
                target.set_lora(slot, a.to(self.device, self.lora_dtype), b.to(self.device, self.lora_dtype),
                                scale, shard_id)
        except Exception:
            self.remove_lora(slot)
            raise

    def remove_lora(self, slot: int) -> None:
        for target in self._lora_layers().values():
            target.remove_lora(slot)

    def _lora_layers(self) -> dict[tuple[int, str], LinearBase]:
        found: dict[tuple[int, str], LinearBase] = {}
        for name, module in self.model.named_modules():
            parts = name.split(".")
            if isinstance(module, LinearBase) and "layers" in parts[:-1]:
                index = parts.index("layers") + 1
                if parts[index].isdigit():
                    found[(int(parts[index]), parts[-1])] = module
        return found

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> torch.Tensor:
        """Run one forward pass; float32 logits ``[plan.num_logits, vocab_size]`` in plan order."""
        assert self.task == "generate", "an embedding model has no logits"
        assert self.kv_cache is not None, "init_kv_cache first"
        block_copies = (plan.block_copies if self.attention_ranks is None
                        else self.attention_ranks.own_copies(plan.block_copies, self.parallel.tp_rank))
        if block_copies:  # before any write of this step (beam forks: engine/beam.py)
            self.kv_cache.copy_blocks(block_copies)
        if plan.slot_copies:  # a verified draft tree's accepted path (spec/tree.py)
            self.kv_cache.copy_slots(plan.slot_copies)
        if not plan.sequences:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        for sequence in plan.sequences:
            assert max(sequence.block_ids) < self.num_blocks, "block id outside the KV pool"
        if self.parallel.pp_size > 1:
            logits = self._stage.execute(plan, self.kv_cache)
            if self.expert_load is not None:   # after every micro-batch: the pass's routing whole
                self.expert_load.after_pass()
            return logits
        if self.attention_ranks is not None:
            return self._execute_dp_attention(plan)
        if self.thread_governor is not None:
            self.thread_governor.step()
        batch = ForwardBatch.build(plan, self.block_size, self.device, self.kv_cache, self.attention,
                                   bidirectional_images=self.bidirectional_images)
        if batch.image_rows:
            self._attach_images(batch)
        if self.tensor_dumper is not None:
            self.tensor_dumper.begin(batch)
        # the batch says which rows are generation rows (``batch.rows``): they keep unrounded
        # activations; prompt rows may take the int8 GEMM (gguf/gguf_routes.py)
        hidden = self.model(batch)
        if self.expert_load is not None:
            self.expert_load.after_pass()
        rows = hidden.index_select(0, batch.logits_indices)
        logits = head_logits(self.lm_head_screen, self.model, rows, plan.argmax_rows, batch.head_rows,
                             plan.argmax_tokens)
        if self.tensor_dumper is not None:
            self.tensor_dumper.end(logits)
        return logits

    def _execute_dp_attention(self, plan: BatchPlan) -> torch.Tensor:
        """This rank's sequences of ``plan`` (model/dp_attention.py); rank 0 returns the whole
        plan's logits, the other ranks an empty tensor."""
        assert self.attention_ranks is not None
        parallel = self.parallel
        share = rank_share(plan, self.attention_ranks, parallel.tp_rank)
        dp_lm_head = self.config.parallel.enable_dp_lm_head
        if share.plan.sequences:
            batch = ForwardBatch.build(share.plan, self.block_size, self.device, self.kv_cache, self.attention)
            rows = self.model(batch).index_select(0, batch.logits_indices)
            if dp_lm_head:
                rows = self.model.compute_logits(rows, batch.head_rows).float()
        else:
            run_idle_experts(self._moe_blocks, self.hidden_size, self.dtype, self.device)
            rows = (torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device) if dp_lm_head
                    else torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device))
        gathered = parallel.all_gather_counted(rows, share.logits_counts)
        if not parallel.is_driver:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        rows = gathered.index_select(0, share.plan_rows.to(self.device))
        return rows if dp_lm_head else self.model.compute_logits(rows).float()

    @property
    def takes_images(self) -> bool:
        return bool(getattr(self.model, "takes_images", False))

    @property
    def bidirectional_images(self) -> bool:
        """The model's image placeholders attend to their whole image (Gemma 3), not causally."""
        return bool(getattr(self.model, "bidirectional_images", False))

    @torch.inference_mode()
    def encode_images(self, spans: list[Any]) -> list[torch.Tensor]:
        """Each ImageSpan's encoded rows ``[length, hidden]``: from the encoder cache by digest,
        the others encoded together in one call of the model's tower (a repeated digest once)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, Any] = {}
        for span in spans:
            if span.digest in found or span.digest in missing:
                continue
            rows = self.encoder_cache.get(span.digest)
            if rows is None:
                missing[span.digest] = span
            else:
                found[span.digest] = rows
        if missing:
            encoded = self.model.encode_images(list(missing.values()))   # one [tokens, hidden] per image
            self.encoder_cache.num_encoded += len(missing)
            for (digest, span), rows in zip(missing.items(), encoded):
                assert rows.shape[0] == span.length, (
                    f"the tower gave {rows.shape[0]} rows for an image of {span.length} placeholders")
                rows = rows.contiguous()
                found[digest] = rows
                self.encoder_cache.put(digest, rows)
        return [found[span.digest] for span in spans]

    def _attach_images(self, batch: ForwardBatch) -> None:
        """Set ``batch.mm_rows`` / ``mm_embeds`` from its image pieces (``batch.image_rows``)."""
        if not self.takes_images:
            raise ValueError(f"{type(self.model).__name__} does not take images")
        pieces = batch.image_rows
        encoded = self.encode_images([piece.span for piece in pieces])
        rows = torch.cat([torch.arange(piece.row, piece.row + piece.count) for piece in pieces])
        batch.mm_rows = rows.to(self.device)
        batch.mm_embeds = torch.cat([features[piece.first:piece.first + piece.count]
                                     for piece, features in zip(pieces, encoded)])

    @torch.inference_mode()
    def pool(self, plan: BatchPlan) -> torch.Tensor:
        """Run one forward over whole prompts; float32 ``[num_sequences, hidden]`` embeddings."""
        assert self.pooler is not None, "pool() needs --task embed"
        assert self.kv_cache is not None, "init_kv_cache first"
        assert plan.sequences and all(s.is_pooled for s in plan.sequences), "every sequence is pooled"
        for sequence in plan.sequences:
            assert max(sequence.block_ids) < self.num_blocks, "block id outside the KV pool"
        batch = ForwardBatch.build(plan, self.block_size, self.device, self.kv_cache, self.attention)
        hidden = self.model(batch)
        return pool(hidden, batch.query_lens, self.pooler)
