"""A/B of one engine change within one run: the same engine, steps timed with the change on and
off alternately (a noisy, shared machine moves both sides alike), medians and their ratio.

``--phase prefill``: whole prompts of ``--input-len`` tokens (default chunking), one at a time.
``--phase decode``: ``--streams`` running requests, pure decode steps.
``--phase greedy``: ``--streams`` prompts of ``--input-len`` tokens, ``--greedy-tokens`` (24) greedy tokens each, generated
with and without the change (prefix cache off), and whether every output is identical.
``--change`` (comma-separated) names what is switched off for the B side (benchmark-only monkeypatches):

- ``list_rows``: a batch's positions and slots and its attention groups' tensors by torch's ops at every
  batch size, instead of from Python's lists up to ``LIST_ROWS`` rows (the same values).
- ``packed_rows``: a GGUF embedding's lookup unpacks and scales its rows by torch's ops
  (servelm.model.gguf.gguf_linear.BlockRows) instead of the fused ops' ``packed_rows`` call (the same floats).
- ``final_norm``: the Llama family's flat decode adds the last layer's residual with torch and calls the
  final norm's module, instead of one fused ``add_rms_norm`` with the final norm's weight (the same floats).
- ``decode_mlp``: a float32 model's one-row flat decode makes each layer's MLP half as separate calls
  instead of the AVX2 block kernel's one ``DecodeMlp.run`` (servelm.model.architectures.flat_decode
  ``decode_mlp``; the same floats; no ``DecodeStack`` either, whose layers are those calls). The plan is
  built at the engine's first decode step (warm-up).
- ``decode_stack``: a float32 model's one-row flat decode calls each layer's QKV, norm + RoPE, attention
  and ``DecodeMlp.run`` from Python instead of all layers in the AVX2 block kernel's one
  ``DecodeStack.run`` (servelm.model.architectures.flat_decode ``decode_stack``; the same floats).
- ``native_argmax``: greedy rows' argmax by servelm.sampling.argmax's torch ops instead of the fused
  ops' ``first_argmax`` call (the same ids).
- ``fused_ops``: RMSNorm (+ residual add), q/k norm + RoPE and act * up as torch's ops instead of
  the fused calls of servelm.model.layers.fused (decode and prefill rows alike).
- ``gguf_bf16_io``: bf16 activations converted to float32 before the GGUF block kernel and its
  output back to bf16 by torch ops, instead of inside the kernel.
- ``prefill_gemm``: multi-token attention through SDPA with the view's mask instead of
  servelm.model.attention.prefill_gemm.
- ``prefill_attention``: multi-token attention through the next route of the measured ranking (prefill_gemm's
  oneDNN tiles or SDPA over gathered K/V) instead of servelm.model.attention.prefill_attention's kernels
  (AVX512-BF16 on bf16 pools, FMA tiles on float32 ones).
- ``gelu_contiguous``: GELU on the strided half of gate_up (servelm.model.layers.activation).
- ``paged_decode``: decodes gather their context and call SDPA instead of the paged kernel.
- ``screen_way_choice``: a step both LM-head screens could take is offered the 5-bit one or the full
  head only (as before session 46), not the int8 screen as well (each measured: the same tokens).
- ``dense_calls``: a GGUF layer's dense copy takes a prompt chunk in one oneDNN call even where its
  measured table cuts it into calls of ``DENSE_CALL_ROWS`` rows (servelm/model/routes.py).
- ``write_and_attend``: the flat decode path writes K/V by two ``index_copy_`` and calls
  ``paged_decode.attend`` (q copied contiguous, the output converted and viewed) instead of
  ``paged_decode.write_and_attend_qkv``'s one call (the same floats).
- ``qkv_rows``: the flat decode path splits the QKV rows into q, k, v views for ``norm_rope_`` and
  ``paged_decode.write_and_attend`` instead of passing the rows whole (``norm_rope_qkv_``,
  ``write_and_attend_qkv``; the same floats).
- ``paged_decode_tiled``: the paged kernel's plain arrangement instead of its tiled one (the same
  floats; servelm.model.attention.paged_decode.TILED).
- ``prefill_v_mm``: prefill attention copies V transposed per tile for oneDNN's linear instead of
  ``torch.mm`` on V as it lies (bf16 only).
- ``prefill_softmax``: prefill attention's tiles take float32 copy + mask + softmax + rounding as
  torch ops instead of fused_ops.cpp's ``causal_softmax``.
- ``gguf_defaults``: every GGUF layer's routes (servelm/model/gguf/gguf_routes.py) resolved from
  the constant ranking of earlier sessions (Zen 5, ``default_ranking``) instead of the table measured
  on this machine (servelm/model/routes.py), among the copies the layer keeps (its prepared decode call
  too). Replaces the row-limit knobs ``gguf_rows``, ``rows_kernel``, ``rows_gemm``, ``i8_gemm`` and
  ``gguf_decode_call``, whose constants session 12 turned into measured routes.
- ``gguf_tiles``: every GGUF layer's routes resolved from the measured ranking without the ``tiles``
  route (servelm/model/gguf/gguf_routes.py), the next route of each cell instead, a dense copy made for
  the B side where one then serves and the layer held none.
- ``gguf_int8``: every GGUF layer's routes resolved from the measured ranking without the ``int8`` route
  (the int8 GEMM: AVX512-VNNI, or the AVX2 build) and no QKV projection's queries apart on it, the next
  route of each cell instead (a dense copy made for the B side where one then serves and the layer held none).
  ``gguf_int8_lead``: only the QKV projections' queries kept off it (the layer's own route for the whole call).
- ``prefill_routes``: multi-token attention in the constant order (the AVX512-BF16 kernel where
  built, else prefill_gemm's tiles, else SDPA) instead of the order measured on this machine
  (servelm/model/attention/prefill_routes.py).
- ``lm_head_screen``: greedy rows take the full LM head (servelm.model.gguf.lm_head_screen off).
- ``i8_screen``: the LM-head screen without its int8 GEMM for many greedy rows (``LMHeadScreen.i8``): the
  5-bit copy up to its row limit, the full head above.
- ``gemma3_decode``: Gemma 3's decode steps go through the layer modules instead of the flat calls
  of servelm.model.architectures.gemma3_decode.
- ``llama_decode``: the Llama family's (Llama, Mistral, Qwen2, Qwen3) decode steps go through the layer
  modules instead of the flat calls of servelm.model.architectures.llama_decode.
- ``gguf_compact_scales``: the AVX2 block kernel reads each GGUF layer's float32 scales and offsets
  instead of their compact layouts (fp16, int8 sub-scales x a float32 per 256 inputs; the same values),
  and the LM-head screen its scales tiled as float32 instead of fp16.
- ``first_argmax``: greedy rows take ``torch.argmax`` instead of servelm.sampling.argmax's chunked
  pass (the same token ids).

    .venv/bin/python benchmarks/step_ab.py --change prefill_gemm --phase prefill --input-len 1019
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench_common import random_prompts  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402


@contextlib.contextmanager
def without(change: str) -> Iterator[None]:
    """The engine as it was before ``change`` (comma-separated: before all of them)."""
    if "," in change:
        with contextlib.ExitStack() as stack:
            for one in change.split(","):
                stack.enter_context(without(one))
            yield
        return
    if change == "prefill_gemm":
        from servelm.model.attention import prefill_gemm
        original: Any = prefill_gemm.supports
        prefill_gemm.supports = lambda q: False  # type: ignore[assignment]
        try:
            yield
        finally:
            prefill_gemm.supports = original
    elif change == "prefill_attention":
        from servelm.model.attention import prefill_attention
        prefill_attention.ENABLED = False
        try:
            yield
        finally:
            prefill_attention.ENABLED = True
    elif change == "paged_decode":
        from servelm.model.attention import paged_decode
        supports: Any = paged_decode.supports
        paged_decode.supports = lambda q, k_cache: False  # type: ignore[assignment]
        try:
            yield
        finally:
            paged_decode.supports = supports
    elif change == "paged_decode_tiled":
        from servelm.model.attention import paged_decode as decode_module
        decode_module.TILED = False
        try:
            yield
        finally:
            decode_module.TILED = True
    elif change == "dense_calls":
        from servelm.model.gguf import gguf_linear as linear_module
        cut: Any = linear_module.dense_calls
        linear_module.dense_calls = lambda x, weight, call_rows: cut(x, weight, 0)  # type: ignore[assignment]
        try:
            yield
        finally:
            linear_module.dense_calls = cut
    elif change == "write_and_attend":
        from servelm.model.attention import paged_decode as attend_module
        joined: Any = attend_module.write_and_attend_qkv

        def separate(qkv: Any, num_heads: int, k_cache: Any, v_cache: Any, slot_mapping: Any, slots: Any,
                     spans: Any, scale: float) -> Any:
            q, k, v = _qkv_views(qkv, num_heads, k_cache.shape[1], k_cache.shape[2])
            k_cache.index_copy_(0, slot_mapping, k)
            v_cache.index_copy_(0, slot_mapping, v)
            return attend_module.attend(q, k_cache, v_cache, slots, spans, scale).view(q.shape[0], -1)

        attend_module.write_and_attend_qkv = separate  # type: ignore[assignment]
        try:
            yield
        finally:
            attend_module.write_and_attend_qkv = joined
    elif change == "qkv_rows":
        from servelm.model.attention import paged_decode as attend_module
        from servelm.model.layers import fused as fused_module
        ops: Any = fused_module.load_kernel()
        rows_attend: Any = attend_module.write_and_attend_qkv
        rows_rope: Any = ops.norm_rope_qkv_

        def views_attend(qkv: Any, num_heads: int, k_cache: Any, v_cache: Any, *rest: Any) -> Any:
            q, k, v = _qkv_views(qkv, num_heads, k_cache.shape[1], k_cache.shape[2])
            return attend_module.write_and_attend(q, k, v, k_cache, v_cache, *rest)

        def views_rope(qkv: Any, num_heads: int, num_kv_heads: int, cos: Any, *rest: Any) -> None:
            q, k, _ = _qkv_views(qkv, num_heads, num_kv_heads, cos.shape[-1])
            ops.norm_rope_(q, k, cos, *rest)

        attend_module.write_and_attend_qkv = views_attend  # type: ignore[assignment]
        ops.norm_rope_qkv_ = views_rope
        try:
            yield
        finally:
            attend_module.write_and_attend_qkv = rows_attend
            ops.norm_rope_qkv_ = rows_rope
    elif change == "list_rows":
        from servelm.model import forward_batch as batch_module
        rows = batch_module.LIST_ROWS
        batch_module.LIST_ROWS = 0   # the batch's and the attention groups' limit
        try:
            yield
        finally:
            batch_module.LIST_ROWS = rows
    elif change == "packed_rows":
        from servelm.model.layers import fused as rows_module
        one_call: Any = rows_module.packed_rows
        rows_module.packed_rows = lambda *args: None
        try:
            yield
        finally:
            rows_module.packed_rows = one_call
    elif change == "final_norm":
        from servelm.model.architectures.llama_decode import LlamaDecodePlan
        fuses: Any = LlamaDecodePlan.fuses_final_norm
        LlamaDecodePlan.fuses_final_norm = lambda self, norm: False  # type: ignore[method-assign]
        try:
            yield
        finally:
            LlamaDecodePlan.fuses_final_norm = fuses  # type: ignore[method-assign]
    elif change == "decode_mlp":
        plan: Any = _ENGINE.runner.model.model.__dict__.get("decode_plan")
        layers = (plan.layers or []) if plan is not None else []
        runs = [layer.mlp_run for layer in layers]
        for layer in layers:
            layer.mlp_run = None
        try:
            with without("decode_stack"):   # its layers' MLP halves are DecodeMlp calls too
                yield
        finally:
            for layer, run in zip(layers, runs):
                layer.mlp_run = run
    elif change == "decode_stack":
        plan = _ENGINE.runner.model.model.__dict__.get("decode_plan")
        stack = plan.stack if plan is not None else None
        if plan is not None:
            plan.stack = None
        try:
            yield
        finally:
            if plan is not None:
                plan.stack = stack
    elif change == "native_argmax":
        sampler = _ENGINE.executor.sampler
        native = sampler.native_argmax
        sampler.native_argmax = None
        try:
            yield
        finally:
            sampler.native_argmax = native
    elif change == "fused_ops":
        from servelm.model.layers import fused
        fused.set_enabled(False)
        try:
            yield
        finally:
            fused.set_enabled(True)
    elif change == "gguf_bf16_io":
        from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
        original_apply: Any = GGUFBlockLinearMethod.apply

        def float_apply(self: Any, layer: Any, x: Any, bias: Any) -> Any:
            if x.dtype != torch.bfloat16 or getattr(layer, "gguf_float_output", False):
                return original_apply(self, layer, x, bias)
            return original_apply(self, layer, x.float(), bias).to(x.dtype)

        GGUFBlockLinearMethod.apply = float_apply  # type: ignore[method-assign]
        try:
            yield
        finally:
            GGUFBlockLinearMethod.apply = original_apply  # type: ignore[method-assign]
    elif change == "gelu_contiguous":
        from servelm.model.layers import activation
        saved = dict(activation._CONTIGUOUS_GELU)
        activation._CONTIGUOUS_GELU.clear()
        try:
            yield
        finally:
            activation._CONTIGUOUS_GELU.update(saved)
    elif change == "prefill_v_mm":
        from servelm.model.attention import prefill_gemm as tiles_module
        tiles_module.BF16_MM_V = False
        try:
            yield
        finally:
            tiles_module.BF16_MM_V = True
    elif change == "prefill_softmax":
        from servelm.model.attention import prefill_gemm as softmax_module
        softmax_module.FUSED_SOFTMAX = False
        try:
            yield
        finally:
            softmax_module.FUSED_SOFTMAX = True
    elif change == "gguf_defaults":
        with _gguf_defaults():
            yield
    elif change == "gguf_tiles":
        from servelm.model.gguf.gguf_routes import Route
        with _gguf_without(Route.TILES):
            yield
    elif change in ("gguf_int8", "gguf_int8_lead"):
        from servelm.model.gguf.gguf_routes import Route
        leads = {module: module.__dict__["gguf_lead"] for module in _ENGINE.runner.model.modules()
                 if module.__dict__.get("gguf_lead") is not None}
        for module in leads:   # a QKV projection's queries: the layer's own route for the call
            module.__dict__["gguf_lead"] = None
        try:
            with _gguf_without(Route.INT8) if change == "gguf_int8" else contextlib.nullcontext():
                yield
        finally:
            for module, lead in leads.items():
                module.__dict__["gguf_lead"] = lead
    elif change == "prefill_routes":
        from servelm.model.attention.prefill_routes import PrefillRouting
        backend = _ENGINE.runner.attention
        measured = backend.prefill_routing
        backend.prefill_routing = PrefillRouting()
        try:
            yield
        finally:
            backend.prefill_routing = measured
    elif change == "lm_head_screen":
        from servelm.model.gguf import lm_head_screen
        limit = lm_head_screen.MAX_SCREEN_ROWS
        lm_head_screen.MAX_SCREEN_ROWS = 0
        try:
            yield
        finally:
            lm_head_screen.MAX_SCREEN_ROWS = limit
    elif change == "i8_screen":
        screen = _ENGINE.runner.lm_head_screen
        assert screen is not None and screen.i8 is not None, "no int8 screen in this engine"
        i8, screen.i8 = screen.i8, None
        try:
            yield
        finally:
            screen.i8 = i8
    elif change == "screen_way_choice":
        from servelm.model.gguf import lm_head_screen as screen_module
        suits: Any = screen_module.int8_screen_suits
        screen_module.int8_screen_suits = lambda *args: False  # type: ignore[assignment]
        try:
            yield
        finally:
            screen_module.int8_screen_suits = suits
    elif change == "gemma3_decode":
        from servelm.model.architectures.gemma3_decode import DecodePlan
        original_applies: Any = DecodePlan.applies
        DecodePlan.applies = lambda self, hidden, batch: False  # type: ignore[method-assign]
        try:
            yield
        finally:
            DecodePlan.applies = original_applies  # type: ignore[method-assign]
    elif change == "gguf_compact_scales":
        with _gguf_float32_scales():
            yield
    elif change == "first_argmax":
        from servelm.sampling import sampler as sampler_module
        fast: Any = sampler_module.first_argmax
        sampler_module.first_argmax = lambda logits, native=None: logits.argmax(dim=-1)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            sampler_module.first_argmax = fast
    elif change == "llama_decode":
        from servelm.model.architectures.llama_decode import LlamaDecodePlan
        llama_applies: Any = LlamaDecodePlan.applies
        LlamaDecodePlan.applies = lambda self, hidden, batch: False  # type: ignore[method-assign]
        try:
            yield
        finally:
            LlamaDecodePlan.applies = llama_applies  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown change {change!r}")


_ENGINE: Any = None
"""The engine ``main`` built (the changes that swap its state read it)."""


@contextlib.contextmanager
def _gguf_routes_swapped(resolve: Callable[[nn.Module, Any, Any], Any]) -> Iterator[None]:
    """Each GGUF layer's routes replaced by ``resolve(module, method, routes)`` (None: kept), its prepared
    decode call made from them; the flat decode plans (built from the prepared calls) made again on each
    side, and everything put back after."""
    from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
    from servelm.model.gguf.gguf_routes import LayerRoutes
    model = _ENGINE.runner.model
    saved = []
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        routes = module.__dict__.get("gguf_routes")
        if not isinstance(method, GGUFBlockLinearMethod) or not isinstance(routes, LayerRoutes):
            continue
        swapped = resolve(module, method, routes)
        if swapped is None:
            continue
        saved.append((module, routes, module.__dict__["gguf_decode_args"]))
        module.__dict__["gguf_routes"] = swapped
        module.__dict__["gguf_decode_args"] = method._decode_args(module, swapped, _ENGINE.runner.dtype)
    plans = {id(m): m.__dict__.pop("decode_plan") for m in model.modules() if "decode_plan" in m.__dict__}
    try:
        yield
    finally:
        for module, routes, decode_args in saved:
            module.__dict__["gguf_routes"] = routes
            module.__dict__["gguf_decode_args"] = decode_args
        for m in model.modules():
            m.__dict__.pop("decode_plan", None)
        del plans


def _gguf_defaults() -> contextlib.AbstractContextManager[None]:
    """Each GGUF layer's routes resolved from the constant ranking (``--change gguf_defaults``):
    ``LayerRoutes.resolve`` over the routes whose copies the layer keeps."""
    from servelm.model.gguf.gguf_routes import LayerRoutes

    def resolve(module: nn.Module, method: Any, routes: Any) -> Any:
        return LayerRoutes.resolve(routes.shape, routes.held, method.default_ranking,
                                   _ENGINE.runner.dtype == torch.bfloat16, method.activations,
                                   method.dense_dtype == torch.bfloat16)
    return _gguf_routes_swapped(resolve)


def _gguf_without(route: Any) -> contextlib.AbstractContextManager[None]:
    """Each GGUF layer's routes resolved from its measured ranking less ``route`` (``--change gguf_tiles``,
    ``gguf_int8``), over its held copies plus a dense copy (made here, kept for the run's later B sides)."""
    from servelm.model.gguf.gguf_routes import LayerRoutes, Route

    def resolve(module: nn.Module, method: Any, routes: Any) -> Any:
        if route not in routes.held:
            return None
        def ranking(shape: Any, x_bf16: bool, rows: int) -> tuple[Route, ...]:
            return tuple(other for other in method.ranking(shape, x_bf16, rows) if other is not route)
        without = LayerRoutes.resolve(routes.shape, (routes.held - {route}) | {Route.DENSE}, ranking,
                                      _ENGINE.runner.dtype == torch.bfloat16, method.activations,
                                      method.dense_dtype == torch.bfloat16)
        if Route.DENSE in without.held and module.__dict__.get("gguf_dense") is None:
            module.__dict__["gguf_dense"] = module.gguf_weight.dequantize(dtype=method.dense_dtype)
        return without
    return _gguf_routes_swapped(resolve)


@contextlib.contextmanager
def _gguf_float32_scales() -> Iterator[None]:
    """Every GGUF layer's block calls (its prepared decode call too) on the float32 scales and offsets
    (``--change gguf_compact_scales``); the flat decode plans made again on each side."""
    from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
    model = _ENGINE.runner.model
    saved = []
    methods: dict[int, tuple[Any, bool]] = {}   # the layers share a method: its own flag, saved once
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if not isinstance(method, GGUFBlockLinearMethod) or "gguf_routes" not in module.__dict__:
            continue
        methods.setdefault(id(method), (method, method.compact_scales))
        saved.append((module, module.__dict__["gguf_decode_args"]))
        method.compact_scales = False
        module.__dict__["gguf_decode_args"] = method._decode_args(module, module.__dict__["gguf_routes"],
                                                                  _ENGINE.runner.dtype)
    for m in model.modules():
        m.__dict__.pop("decode_plan", None)
    screen = _ENGINE.runner.lm_head_screen
    tiled = screen.tiled_scales if screen is not None else None
    if screen is not None:
        screen.tiled_scales = screen.screen_kernel.pack_scales(screen.weight.scales)
    try:
        yield
    finally:
        if screen is not None:
            screen.tiled_scales = tiled
        for method, compact in methods.values():
            method.compact_scales = compact
        for module, decode_args in saved:
            module.__dict__["gguf_decode_args"] = decode_args
        for m in model.modules():
            m.__dict__.pop("decode_plan", None)


def _qkv_views(qkv: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """q ``[T, H, D]``, k and v ``[T, Hkv, D]``: views of the QKV rows, as ``LayerPlan.heads``."""
    q, k, v = qkv.split_with_sizes([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", required=True)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--phase", choices=["prefill", "decode", "greedy"], default="prefill")
    parser.add_argument("--input-len", type=int, default=1019)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--greedy-tokens", type=int, default=24, help="--phase greedy: tokens per prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engine (auto: the default)")
    parser.add_argument("--quantization", default="auto", help="--quantization of the engine (none: a GGUF "
                        "dequantized, dense weights)")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    global _ENGINE
    engine = _ENGINE = LLMEngine(EngineConfig.from_flat({"model": args.model, "num_threads": args.threads,
                                                         "dtype": args.dtype, "quantization": args.quantization,
                                                         "disable_radix_cache": args.phase == "greedy"}))
    vocab_size = min(50000, engine.runner.vocab_size)
    times: dict[str, list[float]] = {"with": [], "without": []}
    load_before = os.getloadavg()[0]
    if args.phase == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens)
        prompts = random_prompts(args.streams, args.input_len, vocab_size, 1)
        outputs: dict[str, list[list[int]]] = {}
        for side in ("with", "without"):
            with contextlib.ExitStack() as stack:
                if side == "without":
                    for change in args.change.split(","):
                        stack.enter_context(without(change))
                for index, prompt in enumerate(prompts):
                    assert engine.add_request(f"{side}{index}", prompt, params) is None
                tokens: dict[str, list[int]] = {}
                while engine.has_unfinished():
                    for output in engine.step():
                        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                outputs[side] = [tokens[f"{side}{index}"] for index in range(len(prompts))]
        same = sum(a == b for a, b in zip(outputs["with"], outputs["without"]))
        print(f"RESULT {args.model} --dtype {args.dtype}, {args.change}: {same} of {len(prompts)} "
              f"greedy outputs ({args.input_len}-token prompts, {args.greedy_tokens} tokens, batched) identical")
        return
    if args.phase == "prefill":
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompts = random_prompts(2 * args.rounds + 2, args.input_len, vocab_size, 0)
        for index, prompt in enumerate(prompts):
            side = "with" if index % 2 == 0 else "without"
            with contextlib.nullcontext() if side == "with" else without(args.change):
                assert engine.add_request(f"p{index}", prompt, params) is None
                start = clock()
                while engine.has_unfinished():
                    engine.step()
                if index >= 2:  # the first pair warms up
                    times[side].append(clock() - start)
        unit = f"s per {args.input_len}-token prompt"
    else:
        steps = 2 * args.rounds + 4
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        for index, prompt in enumerate(random_prompts(args.streams, args.input_len, vocab_size, 0)):
            assert engine.add_request(f"d{index}", prompt, params) is None
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()
        for index in range(steps):
            side = "with" if index % 2 == 0 else "without"
            with contextlib.nullcontext() if side == "with" else without(args.change):
                start = clock()
                engine.step()
                if index >= 4:
                    times[side].append(clock() - start)
        unit = f"s per {args.streams}-stream decode step"
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    print(f"RESULT {args.model} --dtype {args.dtype}, {args.change}, {args.phase}, {args.threads} threads, {args.clock} clock, "
          f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"RESULT without: {without_s:.4f} {unit}; with: {with_s:.4f}; speed-up {without_s / with_s:.2f}x")


if __name__ == "__main__":
    main()
