"""Where one batched decode step goes: per stage, per layer and per op, in-process through LLMEngine.

``--streams`` prompts of ``--input-len`` random tokens are admitted and prefilled first; then
``--steps`` pure decode steps are timed. Stages are timed around the engine's own calls (schedule,
ForwardBatch.build + attention metadata, the layers, the LM head, sampling, update); ops inside the
layers are timed with forward hooks on the module kinds (inclusive wall time, synchronous CPU, so
the hooks' own cost -- a few microseconds per call -- is included). Medians over the steps.
``--clock thread`` reads the calling thread's CPU time instead of the wall clock: with
``--threads 1`` that is the work itself, unaffected by other processes on a shared machine.

    .venv/bin/python benchmarks/profile_decode.py [--model gemma3-270m] [--quantization w8a8_int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench_common import random_prompts  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.forward_batch import ForwardBatch  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402

# module attribute name -> row of the op table
OP_KINDS = {
    "qkv_proj": "QKV GEMM", "o_proj": "O GEMM", "gate_up_proj": "gate_up GEMM",
    "down_proj": "down GEMM", "act": "GELU * up", "q_norm": "q/k norm", "k_norm": "q/k norm",
    "rotary_emb": "RoPE", "attn": "attention (KV write + gather + SDPA)",
    "input_layernorm": "layer norms", "post_attention_layernorm": "layer norms",
    "pre_feedforward_layernorm": "layer norms", "post_feedforward_layernorm": "layer norms",
    "embed_tokens": "embedding", "lm_head": "LM head",
}


CLOCK = time.perf_counter


class Timers:
    """Accumulates wall time per key for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.enabled = False

    def add(self, key: str, seconds: float) -> None:
        if self.enabled:
            self.step[key] += seconds

    def end_step(self) -> None:
        if self.enabled:
            self.steps.append(dict(self.step))
        self.step = defaultdict(float)

    def median_ms(self, key: str) -> float:
        return 1000 * statistics.median(s.get(key, 0.0) for s in self.steps)


def instrument(engine: LLMEngine, timers: Timers, op_hooks: bool = True) -> None:
    """Wrap the engine's stages and hook the model's modules (layers and ops only when ``op_hooks``:
    a hook inside a compiled layer would split its graph, and one on a layer or op sends a step of a
    few bf16 rows on GGUF blocks through the layer modules instead of the flat decode path)."""
    runner: Any = engine.runner
    model = runner.model
    starts: dict[int, float] = {}

    def pre(module: torch.nn.Module, _args: Any) -> None:
        starts[id(module)] = CLOCK()

    def post_for(key: str) -> Any:
        def post(module: torch.nn.Module, _args: Any, _out: Any) -> None:
            timers.add(key, CLOCK() - starts[id(module)])
        return post

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in OP_KINDS and (op_hooks or leaf in ("embed_tokens", "lm_head")):
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post_for("op:" + OP_KINDS[leaf]))
        if op_hooks and leaf.isdigit() and name.endswith(f"layers.{leaf}"):
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post_for(f"layer:{int(leaf):02d}"))

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = CLOCK()
            result = fn(*args, **kwargs)
            timers.add(key, CLOCK() - start)
            return result
        return wrapper

    original_build = ForwardBatch.build.__func__  # type: ignore[attr-defined]
    ForwardBatch.build = classmethod(timed("stage:ForwardBatch.build + attention metadata",  # type: ignore[method-assign]
                                           original_build))
    engine.scheduler.schedule = timed("stage:schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    runner.execute = timed("stage:runner.execute (forward + LM head)", runner.execute)
    engine.executor.sampler.__class__.__call__ = timed(  # type: ignore[method-assign]
        "stage:sampling", engine.executor.sampler.__class__.__call__)
    engine.executor.execute = timed("stage:executor.execute", engine.executor.execute)  # type: ignore[method-assign]
    engine.apply = timed("stage:update + detokenize", engine.apply)  # type: ignore[method-assign]
    model.forward = timed("stage:layers (model.forward)", model.forward)


def run(args: argparse.Namespace) -> tuple[Timers, float, int]:
    total_len = args.input_len + args.warmup_steps + args.steps + 2
    engine = LLMEngine(EngineConfig.from_flat({
        "model": args.model, "quantization": args.quantization,
        "max_total_tokens": 2 * args.streams * total_len + 256,
        "max_running_requests": args.streams, "max_prefill_tokens": args.streams * args.input_len,
        "chunked_prefill_size": args.input_len, "num_threads": args.threads,
        **{key: json.loads(value) for key, value in (kv.split("=", 1) for kv in args.extra)}}))
    timers = Timers()
    instrument(engine, timers, op_hooks=args.op_hooks and not engine.config.runtime.enable_torch_compile)
    vocab_size = min(50000, engine.runner.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup_steps + args.steps + 1, ignore_eos=True)
    for index, prompt in enumerate(random_prompts(args.streams, args.input_len, vocab_size, 0)):
        assert engine.add_request(f"p{index}", prompt, params) is None
    engine.step()          # prefill all
    timers.end_step()
    for _ in range(args.warmup_steps):
        engine.step()
        timers.end_step()
    timers.enabled = True
    start = CLOCK()
    for _ in range(args.steps):
        step_start = CLOCK()
        engine.step()
        timers.add("step", CLOCK() - step_start)
        timers.end_step()
    elapsed = CLOCK() - start
    return timers, elapsed, args.streams * args.steps


def run_prefill(args: argparse.Namespace) -> tuple[Timers, float, int]:
    """``--phase prefill``: ``--steps`` prompts of ``--input-len`` tokens, one after another, each
    with max_tokens 1 (its prefill chunks plus the first token); a timed "step" is one whole prompt."""
    engine = LLMEngine(EngineConfig.from_flat({
        "model": args.model, "quantization": args.quantization, "num_threads": args.threads,
        **{key: json.loads(value) for key, value in (kv.split("=", 1) for kv in args.extra)}}))
    timers = Timers()
    instrument(engine, timers, op_hooks=args.op_hooks and not engine.config.runtime.enable_torch_compile)
    vocab_size = min(50000, engine.runner.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(args.warmup_steps + args.steps, args.input_len, vocab_size, 0)
    elapsed = 0.0
    for index, prompt in enumerate(prompts):  # distinct prompts: no prefix-cache hits
        timers.enabled = index >= args.warmup_steps
        assert engine.add_request(f"p{index}", prompt, params) is None
        start = CLOCK()
        while engine.has_unfinished():
            engine.step()
        seconds = CLOCK() - start
        timers.add("step", seconds)
        timers.end_step()
        elapsed += seconds if timers.enabled else 0.0
    return timers, elapsed, args.steps * args.input_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--quantization", default="w8a8_int8")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-op-hooks", dest="op_hooks", action="store_false",
                        help="time stages only (no per-layer or per-op hooks, which cost a little, "
                        "are always off with torch.compile and keep steps off the flat decode path)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                        help="prefill: time whole prompts of --input-len tokens, one at a time "
                        "(--streams is ignored; the server's default chunking)")
    parser.add_argument("--extra", nargs="*", default=[], help="more engine options as field=JSON value, e.g. enable_torch_compile=true")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    load_before = os.getloadavg()[0]
    timers, elapsed, tokens = (run_prefill if args.phase == "prefill" else run)(args)
    load_after = os.getloadavg()[0]
    step_ms = timers.median_ms("step")
    print(f"# {args.model} {args.quantization}, {args.phase}, {args.streams if args.phase == 'decode' else 1} streams, context {args.input_len}+, "
          f"{args.threads} threads, {args.clock} clock, load {load_before:.2f} -> {load_after:.2f}: {tokens / elapsed:.1f} "
          f"tok/s, median step {step_ms:.1f} ms")
    print("| part | median ms per step | share of step |")
    print("|---|---|---|")
    keys = sorted({k for s in timers.steps for k in s if k != "step"})
    for prefix in ("stage:", "op:", "layer:"):
        rows = [(k, timers.median_ms(k)) for k in keys if k.startswith(prefix)]
        if prefix == "op:":
            rows.sort(key=lambda kv: -kv[1])
        for key, ms in rows:
            print(f"| {key} | {ms:.2f} | {100 * ms / step_ms:.0f}% |")


if __name__ == "__main__":
    main()
