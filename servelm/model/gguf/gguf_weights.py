"""Serving a GGUF file at the precision it carries (``--quantization auto``/``gguf``), as llama.cpp does.

``resolve_quantization`` decides, at start-up and with a logged reason, whether a model's linear
layers, LM head and embedding keep the file's quantized blocks (``gguf``) or are dequantized to the
model dtype (``none``, the old path, which ``--quantization none`` forces). ``apply_gguf_blocks``
then replaces the loaded float weights by the lossless int8-code repack of each GGUF tensor
(servelm/model/gguf/gguf_blocks.py) run by ``GGUFBlockLinearMethod`` (gguf_linear.py).

``load_gguf_model`` builds the model with uninitialised parameters, puts the blocks in place of its
linear, head and embedding weights first and only then loads the rest (norms, biases, tensors
without a repack) from the file: the tensors served in blocks are read once, never dequantized to a
float32 model (whose pages, never touched, cost no memory).

Invariants:
- Each block weight is the lossless repack of its GGUF tensor: ``repack`` checks that it rebuilds
  gguf's own dequantization of the same bytes; the row order (fused shards, llama's Q/K permutation)
  is the float loader's, checked layer by layer against it in tests/unit/model/test_gguf_blocks.py.
- A tensor whose GGUF type has no repack (Q2_K, Q3_K, IQ*, float) keeps its float weight (logged).
- At tp > 1 only a MoE model's routed experts keep blocks (``experts_only``: the tensor-parallel
  rest is dequantized; a model without experts is dequantized by ``auto``, refused by ``gguf``).
  Under expert parallelism (``--ep-size`` = tp) a rank holds whole experts, served as they are,
  without redundant slots or EPLB (they move float stacks). Otherwise a rank holds some
  intermediate columns of its experts: gate/up blocks narrowed by output rows, down by inputs
  along whole blocks; a layer whose down shard would cut blocks is dequantized
  (``shard_expert_blocks``, logged per rank).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.gguf.gguf_file import (GGUFFile, expert_tensor_names, gguf_to_hf_name, is_expert_stack, is_kv_b_half,
                                          reverse_llama_permute)
from servelm.model.layers.embedding import LMHead, VocabEmbedding
from servelm.model.gguf.gguf_blocks import BlockWeight, concat_rows, repack
from servelm.model.gguf.block_builds import choose_block_build
from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel
from servelm.model.gguf import gguf_i8gemm, gguf_rows
from servelm.model.gguf.gguf_linear import BlockRows, GGUFBlockLinearMethod
from servelm.model.gguf.gguf_routes import I8_GEMM_LEAD, I8_GEMM_SKIPPED, LayerRoutes, LinearShape
from servelm.model.layers.linear import LinearBase
from servelm.model.layers.moe import FusedMoE
from servelm.model.loader import build_model, cpu_bf16_feature, resolve_dtype
from servelm.model.routes import STARTUP_BUDGET_S, ShapeSpec, build_table, format_report, route_summary

logger = logging.getLogger(__name__)

GGUF_MODES = {"gguf": "int16", "gguf_a8": "int8"}
"""``--quantization`` values that serve the file's blocks -> how the kernel takes activations
(``GGUFBlockLinearMethod.activations``)."""

_FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def resolve_quantization(quantization: str, gguf_path: str | None, parallel: ParallelContext,
                         device: torch.device, compile_enabled: bool, dtype: str = "auto", *,
                         has_experts: bool = False) -> tuple[str, str]:
    """(``--quantization`` to apply, why) where ``auto`` becomes ``gguf`` or ``none``.

    ``auto`` keeps a GGUF file's blocks only with ``--dtype auto``: a named ``--dtype`` asks for the
    model in that dtype, i.e. dequantized (the parity tests against transformers rely on it). At
    tp > 1 only a MoE model's routed experts (``has_experts``) keep blocks."""
    if quantization in GGUF_MODES:
        if gguf_path is None:
            raise ValueError(f"--quantization {quantization} serves a GGUF file's own blocks; this model "
                             "is not a GGUF file")
        if parallel.tp_size > 1 and not has_experts:
            raise ValueError(f"--quantization {quantization} runs at --tp-size 1 only, or on a mixture-of-experts "
                             "model's routed experts (blocks are split by output rows and along whole input "
                             "blocks, which the other layers' tensor-parallel shards do not keep); use "
                             "--quantization none (dequantized weights) with tensor parallelism")
        return quantization, f"--quantization {quantization}"
    if quantization != "auto":
        return quantization, f"--quantization {quantization}"
    if gguf_path is None:
        return "none", "auto: not a GGUF file, weights in the model dtype"
    if dtype != "auto":
        return "none", f"auto: --dtype {dtype} asks for the weights in that dtype, so the GGUF is dequantized"
    if parallel.tp_size > 1 and not has_experts:
        return "none", ("auto: GGUF blocks are served at --tp-size 1 only, or in a mixture-of-experts model's "
                        "routed experts, so the weights are dequantized")
    if device.type != "cpu":
        return "none", "auto: GGUF block kernels are CPU kernels, so the weights are dequantized on " + device.type
    if compile_enabled:
        return "none", "auto: --enable-torch-compile compiles dequantized weights"
    if load_kernel() is None:  # without it every call would dequantize: slower than doing it once
        return "none", f"auto: the GGUF block kernel is unavailable ({kernel_status()}), so the weights are dequantized"
    if parallel.tp_size > 1:
        return "gguf", ("auto: each rank serves its experts (whole under --ep-size, else its intermediate "
                        "columns where they keep whole blocks) in the file's blocks; the tensor-parallel rest is "
                        "dequantized (--quantization none dequantizes all)")
    return "gguf", "auto: a GGUF file is served in its own quantized blocks (--quantization none dequantizes)"


def has_routed_experts(hf_config: Any) -> bool:
    """Whether a config has routed experts (Qwen-MoE/OLMoE ``num_experts``, Mixtral's
    ``num_local_experts``, DeepSeek's ``n_routed_experts``)."""
    return any(getattr(hf_config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def gguf_model_dtype(dtype: str, device: torch.device,
                     flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """(dtype of everything but the blocks, why) under ``--quantization gguf``/``gguf_a8``.

    With ``--dtype auto`` it is ``resolve_dtype``'s choice: bfloat16 where the CPU has a native bf16
    GEMM (AMX, AVX512-BF16), so activations, norms (float32 inside), attention and the KV cache run
    in bf16 and the dense copies above the kernel's rows take bf16 inputs with no conversion around
    each GEMM (float32 rest: 0.90x the bf16 model's 32-stream throughput); float32 without one.
    ``flags`` replaces the CPU's feature flags (tests force each branch with it)."""
    chosen = resolve_dtype(dtype, None, device, flags)
    if dtype != "auto":
        return chosen, f"--dtype {dtype}"
    if chosen == torch.bfloat16:
        return chosen, (f"auto: this CPU has {cpu_bf16_feature(flags)}, so the GGUF blocks run their "
                        "own kernels and everything else (matmul inputs, attention, KV cache) runs in bf16 but the "
                        "residual stream (--residual-dtype)")
    return chosen, ("auto: the GGUF blocks run their own kernels, everything else in float32 (this CPU "
                    "has no native bf16 GEMM)")


def read_block_weights(path: str | Path, experts_only: bool = False
                       ) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """(HF name -> BlockWeight for every repackable 2-D tensor, HF name -> GGUF type of the others);
    ``experts_only``: the routed experts' tensors only (a tensor-parallel model under --ep-size)."""
    from gguf import GGMLQuantizationType

    gguf = GGUFFile.open(path)
    config = gguf.config_dict()
    blocks: dict[str, BlockWeight] = {}
    others: dict[str, str] = {}
    for info in gguf.tensor_infos:
        name = gguf_to_hf_name(info.name, gguf.architecture)
        # DeepSeek's kv_b halves: its weight stays float (latent attention reads it per head)
        if name is None or len(info.shape) not in (2, 3) or is_kv_b_half(info.name) \
                or experts_only and not is_expert_stack(info.name):
            continue
        kind = GGMLQuantizationType(info.ggml_type).name
        raw = gguf._blob[info.offset:info.offset + info.num_bytes]
        if is_expert_stack(info.name):   # stacked experts: each expert's rows are a contiguous slice
            names = expert_tensor_names(name, info.shape[0])
            for expert_name, expert_raw in zip(names, np.split(raw, info.shape[0])):
                _repack_into(blocks, others, expert_name, expert_raw, info.shape[1:], kind)
            continue
        weight = _repack_into(blocks, others, name, raw, info.shape, kind)
        if weight is None:
            continue
        if gguf.architecture == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
            heads = config["num_attention_heads"]
            if ".attn_k." in info.name:
                heads = config.get("num_key_value_heads", heads)
            blocks[name] = weight.permute_rows(reverse_llama_permute(torch.arange(info.shape[0]), heads))
    return blocks, others


def _repack_into(blocks: dict[str, BlockWeight], others: dict[str, str], name: str, raw: np.ndarray,
                 shape: tuple[int, ...], kind: str) -> BlockWeight | None:
    """Repack one 2-D tensor's bytes into ``blocks[name]``; a type without a repack goes to ``others``."""
    try:
        blocks[name] = repack(raw, (shape[0], shape[1]), kind)
    except ValueError:
        others[name] = kind
        return None
    return blocks[name]


def _checkpoint_names(module_name: str, leaves: dict[str, str]) -> list[str]:
    """The checkpoint tensors a module's weight is made of; ``leaves``: the model's own module names
    for checkpoint ones (``checkpoint_leaves``, e.g. DeepSeek's ``q_head_proj`` for ``q_proj``)."""
    prefix, _, leaf = module_name.rpartition(".")
    shards = _FUSED_SHARDS.get(leaf)
    if shards is None:
        return [f"{prefix}.{leaves.get(leaf, leaf)}.weight" if prefix else f"{module_name}.weight"]
    return [f"{prefix}.{shard}.weight" for shard in shards]


def check_same(block: BlockWeight, weight: torch.Tensor, name: str) -> None:
    """The block weight must equal the float weight it replaces (to the model dtype's rounding)."""
    if tuple(block.codes.shape) != tuple(weight.shape):
        raise ValueError(f"{name}: GGUF blocks {tuple(block.codes.shape)} do not match the loaded "
                         f"weight {tuple(weight.shape)}")
    step = max(1, block.codes.shape[0] // 64)   # a sample of rows spread over the whole weight
    rows = slice(0, None, step)
    expected = block.dequantize(rows).to(weight.dtype).float()
    if not torch.equal(expected, weight[rows].float()):
        error = (expected - weight[rows].float()).abs().max().item()
        raise ValueError(f"{name}: GGUF blocks differ from the loaded weight (max {error:g})")


def load_gguf_model(hf_config: Any, path: str | Path, dtype: torch.dtype, device: torch.device,
                    activations: str = "int16", parallel: ParallelContext | None = None) -> nn.Module:
    """The model of GGUF file ``path`` with its blocks in place (see the module docstring): built,
    blocks applied, then only the tensors left as float weights read and dequantized."""
    model = build_model(hf_config, dtype, device, parallel)
    summary = apply_gguf_blocks(model, path, activations, check=False,
                                experts_only=parallel is not None and parallel.tp_size > 1)
    with torch.no_grad():
        model.load_weights(GGUFFile.open(path).tensors(skip=summary["checkpoint_names"]))
    return model


def _served_modules(model: nn.Module, blocks: dict[str, BlockWeight]) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(name, module, checkpoint names) of every linear, head and embedding with a float weight."""
    leaves: dict[str, str] = getattr(model, "checkpoint_leaves", {})
    for module_name, module in model.named_modules():
        if not isinstance(module, (LinearBase, LMHead, VocabEmbedding)) or module.weight is None:
            continue
        names = _checkpoint_names(module_name, leaves)
        if isinstance(module, LMHead) and module.is_tied:
            names = [names[0].replace("lm_head.", "model.embed_tokens.")]
        yield module_name, module, names


def split_block_experts(model: nn.Module, blocks: dict[str, BlockWeight]) -> list[FusedMoE]:
    """Split the experts of every MoE layer whose expert weights all have blocks into per-expert
    linears (``FusedMoE.split_experts``: then served like any other linear); returns those layers.
    A layer holding some intermediate columns of its experts (tensor parallelism) first narrows
    their blocks to them (``shard_expert_blocks``), or, where that would cut blocks, leaves them out.
    A second call finds the layers the first split (their blocks already narrowed) and returns them."""
    split = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.expert_layers is not None:
            split.append(module)   # split (and its blocks narrowed) by an earlier call
        elif isinstance(module, FusedMoE) and all(
                f"{name}.{expert}.{projection}.weight" in blocks for expert in module.checkpoint_experts
                for projection in ("gate_proj", "up_proj", "down_proj")) and shard_expert_blocks(name, module, blocks):
            module.split_experts()
            split.append(module)
    return split


def shard_expert_blocks(name: str, module: FusedMoE, blocks: dict[str, BlockWeight]) -> bool:
    """Narrow layer ``name``'s expert blocks to the rank's intermediate columns (``module``'s
    ``intermediate_shard``): gate and up to those rows (whole blocks always), down to those inputs,
    whole blocks only where the shard's start and size are multiples of its block (Q8_0, Q4_K: 32
    inputs a scale; Q6_K: 16). Where they are not, the layer's expert blocks are dropped from
    ``blocks`` (the layer loads dequantized) and False is returned; the route is logged either way."""
    shard, full = module.intermediate_shard, module.full_intermediate_size
    if shard.size == full:
        return True
    names = {(expert, projection): f"{name}.{expert}.{projection}.weight" for expert in module.checkpoint_experts
             for projection in ("gate_proj", "up_proj", "down_proj")}
    down = blocks[names[module.checkpoint_experts[0], "down_proj"]]
    where = f"{name}: experts' intermediate columns {shard.start}..{shard.start + shard.size} of {full}"
    try:
        narrowed = {key: blocks[n].narrow(1 if key[1] == "down_proj" else 0, shard.start, shard.size)
                    for key, n in names.items()}
    except ValueError as error:
        for n in names.values():
            del blocks[n]
        logger.info("%s: dequantized (down_proj's %s)", where, error)
        return False
    blocks.update({names[key]: weight for key, weight in narrowed.items()})
    logger.info("%s: the file's blocks kept (gate/up rows; down_proj inputs along whole %s blocks of %d)",
                where, down.kind, down.block)
    return True


def expert_weight_names(model: nn.Module, split: list[FusedMoE]) -> set[str]:
    """Every checkpoint expert tensor of the split layers, this rank's or not (a rank under
    --ep-size reads none of the others': they are other ranks' blocks)."""
    names = {id(module): name for name, module in model.named_modules()}
    return {f"{names[id(moe)]}.{expert}.{projection}.weight" for moe in split
            for expert in range(moe.num_checkpoint_experts) for projection in ("gate_proj", "up_proj", "down_proj")}


def _route_table(method: GGUFBlockLinearMethod, model: nn.Module, blocks: dict[str, BlockWeight],
                 budget_s: float | None, fresh: bool = False) -> tuple[str, torch.dtype]:
    """Measure (or read from the cache) the routes of the model's distinct GGUF linears and hand the
    ranking to ``method``; returns where the table came from and the rows' (model) dtype."""
    specs: dict[LinearShape, ShapeSpec] = {}
    model_dtype = torch.float32
    for module_name, module, names in _served_modules(model, blocks):
        if isinstance(module, VocabEmbedding) or any(name not in blocks for name in names):
            continue
        first = blocks[names[0]]
        kind = "+".join(dict.fromkeys(blocks[name].kind for name in names))
        n = sum(blocks[name].codes.shape[0] for name in names)
        weights = [blocks[name] for name in names]
        shape = LinearShape(first.codes.shape[1], n, kind, isinstance(module, LMHead),
                            module_name.rpartition(".")[2] not in I8_GEMM_SKIPPED
                            and not isinstance(module, LMHead) and method.activations != "float"
                            and method.int8_fits(*weights))
        lead = _int8_lead(module_name, names, blocks)
        parts = [(shape, weights)] + ([(method.shape(lead), [lead])] if lead is not None else [])
        for part_shape, part_weights in parts:
            if part_shape not in specs:
                specs[part_shape] = ShapeSpec(part_shape, first.block, first.offsets is not None,
                                              gguf_i8gemm.code_range(*part_weights))
        model_dtype = module.weight.dtype
    table, source = build_table(method, list(specs.values()), model_dtype, budget_s, fresh=fresh,
                                working_bytes=sum(weight.nbytes for weight in blocks.values()))
    method.ranking = table.ranking(method.default_ranking)
    return source, model_dtype


def _int8_lead(module_name: str, names: list[str], blocks: dict[str, BlockWeight]) -> BlockWeight | None:
    """The leading part of a merged layer that may take the int8 GEMM on its own (``I8_GEMM_LEAD``:
    a QKV projection's queries), else None."""
    if module_name.rpartition(".")[2] in I8_GEMM_LEAD and len(names) > 1:
        return blocks[names[0]]
    return None


def _decoder_weights(model: nn.Module, blocks: dict[str, BlockWeight]) -> tuple[list[BlockWeight], torch.dtype]:
    """The block weights of the model's linears but the head, in call order (a fused layer's parts
    one by one), and the rows' dtype: what ``choose_block_build`` times."""
    weights: list[BlockWeight] = []
    dtype = torch.float32
    for _, module, names in _served_modules(model, blocks):
        if isinstance(module, (LMHead, VocabEmbedding)) or any(name not in blocks for name in names):
            continue
        weights.extend(blocks[name] for name in names)
        dtype = module.weight.dtype
    return weights, dtype


def _packed_note(weights: Iterable[BlockWeight]) -> str:
    """Which weights hold their codes packed (their int8 codes dropped once their copies were made:
    the block route reads the packed bytes, the embedding unpacks its rows) and the bytes, for the
    start-up log."""
    by_kind: dict[str, int] = {}
    held = int8_bytes = 0
    for weight in weights:
        if weight.packed is None:
            continue
        key = f"{weight.kind} {weight.packed.bits}-bit"
        by_kind[key] = by_kind.get(key, 0) + 1
        held += weight.packed.data.nbytes
        int8_bytes += weight.shape[0] * weight.shape[1]
    if not by_kind:
        return "codes as int8 bytes"
    kinds = ", ".join(f"{key} x{count}" for key, count in sorted(by_kind.items()))
    return (f"codes packed at their bit width: {kinds}; {held / 2 ** 20:.1f} MiB packed in place of "
            f"{int8_bytes / 2 ** 20:.1f} MiB of int8 codes")


def apply_gguf_blocks(model: nn.Module, path: str | Path, activations: str = "int16",
                      check: bool = True, route_budget_s: float | None = STARTUP_BUDGET_S,
                      fresh_routes: bool = False, experts_only: bool = False) -> dict[str, Any]:
    """Replace ``model``'s float linear, head and embedding weights by the file's blocks; logs and
    returns a summary (kinds per role, bytes before and after, the kernel's status, and
    ``checkpoint_names``: the HF tensors now served in blocks). ``activations``:
    ``GGUFBlockLinearMethod.activations``. ``check``: compare each block weight with the float
    weight it replaces (only when that was loaded; ``load_gguf_model`` applies blocks first).
    ``route_budget_s``: seconds the route table's missing cells may take (model/routes.py; None: no limit);
    ``fresh_routes``: measure every cell again (``servelm tune``); ``experts_only``: only the routed
    experts get blocks (``read_block_weights``)."""
    blocks, others = read_block_weights(path, experts_only)
    return apply_block_weights(model, blocks, others, activations, check, route_budget_s, fresh_routes)


def apply_block_weights(model: nn.Module, blocks: dict[str, BlockWeight], others: dict[str, str],
                        activations: str = "int16", check: bool = True,
                        route_budget_s: float | None = STARTUP_BUDGET_S, fresh_routes: bool = False,
                        label: str = "GGUF") -> dict[str, Any]:
    """``apply_gguf_blocks`` on block weights from anywhere (``blocks``: HF checkpoint name ->
    BlockWeight; ``others``: names kept float -> their type, for the log): a GGUF file's repack,
    or a pre-quantized checkpoint's integer codes (servelm/model/prequantized.py). ``label``
    names the source in the log."""
    split = split_block_experts(model, blocks)
    started = time.perf_counter()
    decoder_weights, rows_dtype = _decoder_weights(model, blocks)
    build = choose_block_build(decoder_weights, activations, rows_dtype, fresh=fresh_routes)
    kernel = build.module
    dense_dtype = torch.bfloat16 if cpu_bf16_feature() is not None else torch.float32
    # the rows kernel only serves bf16 rows, so only where the model may run in bf16
    rows_kernel = gguf_rows.load_kernel() if dense_dtype == torch.bfloat16 else None
    # the int8 GEMM where the CPU has the instructions of a build (VNNI, else AVX2; asked of the CPU's
    # flags, not of a loaded module: one loaded earlier in the process stays loaded whatever flags),
    # beside either block build
    i8_kernel = (gguf_i8gemm.load_gemm() if kernel is not None and not gguf_i8gemm.gemm_missing_flags()
                 and activations != "float" else None)
    method = GGUFBlockLinearMethod(kernel, dense_dtype, activations, rows_kernel, i8_kernel)
    route_source, model_dtype = _route_table(method, model, blocks, route_budget_s, fresh_routes)
    route_seconds = time.perf_counter() - started
    kinds: Counter[str] = Counter()
    kept_float: list[str] = []
    float_bytes = dense_bytes = 0
    by_weight: dict[int, BlockWeight] = {}
    replaced: set[str] = set()
    head_kind = embedding_kind = "float"
    with torch.no_grad():
        for module_name, module, names in list(_served_modules(model, blocks)):
            if isinstance(module, (LMHead, VocabEmbedding)) and module.vocab_shard.size != module.vocab_size:
                kept_float.append(f"{module_name} (padded vocabulary)")
                continue
            if any(name not in blocks for name in names):
                kept_float.append(f"{module_name} ({', '.join(others.get(n, 'float') for n in names)})")
                continue
            weight = by_weight.get(id(module.weight))
            if weight is None:
                weight = concat_rows([blocks[name] for name in names]) if len(names) > 1 else blocks[names[0]]
                if check:
                    check_same(weight, module.weight, module_name)
                by_weight[id(module.weight)] = weight
                replaced.update(names)
                float_bytes += module.weight.numel() * 4
            if isinstance(module, VocabEmbedding):
                if method.packs:   # rows unpacked per lookup
                    weight.with_packed()
                weight.drop_codes()
                module.quantized_rows = BlockRows(weight, module.weight.dtype)
                del module.weight
                module.register_parameter("weight", None)
                embedding_kind = f"{weight.kind} rows"
            else:
                dense_bytes += method.process(
                    module, weight, float_output=isinstance(module, LMHead),
                    int8_rows=module_name.rpartition(".")[2] not in I8_GEMM_SKIPPED,
                    int8_lead=_int8_lead(module_name, names, blocks)) - weight.nbytes
                weight.drop_codes()   # its copies are made; a module sharing it unpacks what it needs
                if isinstance(module, LMHead):
                    head_kind = weight.kind
                else:
                    kinds[weight.kind] += 1
    packed_note = _packed_note(by_weight.values())
    stored = sum(weight.nbytes for weight in by_weight.values())
    for moe in split:
        moe.drop_stacked()
    replaced |= expert_weight_names(model, split)
    routes_by_shape: dict[LinearShape, LayerRoutes] = {
        routes.shape: routes for module in model.modules()
        for routes in (module.__dict__.get("gguf_routes"), (module.__dict__.get("gguf_lead") or (0, None))[1])
        if isinstance(routes, LayerRoutes)}
    x_bf16 = model_dtype == torch.bfloat16
    method.route_report = route_summary(routes_by_shape, x_bf16, route_source)
    kernel_note = (f"block kernel build: {build.note}; routes ({route_source}; {route_seconds:.2f} s):\n  "
                   + "\n  ".join(format_report(method.route_report)))
    summary = {"linears": dict(kinds), "head": head_kind, "embedding": embedding_kind,
               "kept_float": kept_float, "bytes": stored, "dense_bytes": dense_bytes,
               "float32_bytes": float_bytes, "checkpoint_names": replaced,
               "kernel": build.status(), "kernel_build": build.note, "activations": activations,
               "routes": method.route_report, "packed": packed_note}
    logger.info("%s weights served in their own blocks: linears %s, LM head %s, embedding %s; "
                "%.1f MiB of blocks + %.1f MiB of dense and packed copies (float32: %.1f MiB); %s; block kernel: %s%s; %s",
                label, ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items())) or "none",
                head_kind, embedding_kind, stored / 2 ** 20, dense_bytes / 2 ** 20, float_bytes / 2 ** 20,
                packed_note, build.status(), f"; kept float: {', '.join(kept_float)}" if kept_float else "",
                kernel_note)
    return summary
