"""Where one real decode step goes, call by call, on the path serving takes (the flat decode included).

profile_decode.py's op hooks time modules, which keeps a step off the flat decode path; this script
instead wraps the calls a flat step makes (each prepared block GEMM, the fused ops, the attention
kernel, the batch build, the LM-head screen, the sampler, the engine's stages) with a wall-clock timer
and prints, per call kind, the milliseconds per step, the calls per step and the microseconds per call.
The wrappers cost well under a microsecond a call; the step's own figure includes them. The GEMMs run
in layer order, so their weights are as cold as serving reads them.

    .venv/bin/python benchmarks/step_calls.py [--model qwen2.5-coder-0.5b] [--steps 150] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench_common import random_prompts  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model import runner as runner_module  # noqa: E402
from servelm.model.architectures import flat_decode  # noqa: E402
from servelm.model.forward_batch import ForwardBatch  # noqa: E402
from servelm.model.gguf.gguf_linear import PreparedCall  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402

GEMMS = ("qkv_call", "o_call", "gate_up_call", "down_call")


class CallTimes:
    """Wall seconds and calls per name, summed over the timed steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return result
        return timed


class _TimedOps:
    """The fused ops' module with each function timed."""

    def __init__(self, ops: Any, times: CallTimes) -> None:
        self._ops, self._times = ops, times

    def __getattr__(self, name: str) -> Any:
        return self._times.wrap(f"ops.{name}", getattr(self._ops, name))


def instrument(engine: LLMEngine, times: CallTimes) -> None:
    """Wrap the calls of ``engine``'s decode step (its flat plan must exist: one step has run)."""
    model = engine.runner.model
    inner = getattr(model, "model", model)
    plan = inner.__dict__.get("decode_plan")
    if plan is None:
        raise SystemExit("the model has no flat decode plan: its steps take the module path (profile_decode.py)")
    for layer in plan.layers or []:
        if getattr(layer, "mlp_run", None) is not None:   # o .. down and the norms in one call
            layer.mlp_run = times.wrap("mlp_run (o, norm, gate_up, SiLU, down, norm)", layer.mlp_run)
        for name in GEMMS:
            call = getattr(layer, name)
            setattr(layer, name, PreparedCall.of((times.wrap(name, call[0]), *call[1:]), call.dtype,
                                                 call.generation_rows, call.prompt_rows, call.takes_bias))
    original_init = flat_decode.DecodeStep.__init__

    def init(step: Any, *args: Any, **kwargs: Any) -> None:
        original_init(step, *args, **kwargs)
        step.ops = _TimedOps(step.ops, times)
        step.write_and_attend = times.wrap("attention kernel (write_and_attend_qkv)", step.write_and_attend)

    flat_decode.DecodeStep.__init__ = init  # type: ignore[method-assign]
    step_attend = times.wrap("attention (DecodeStep.attend: the kernel's call and its Python)", flat_decode.DecodeStep.attend)
    flat_decode.DecodeStep.attend = step_attend  # type: ignore[method-assign]
    plan.run = times.wrap("layers (plan.run)", plan.run)
    build = ForwardBatch.build.__func__  # type: ignore[attr-defined]
    ForwardBatch.build = classmethod(times.wrap("ForwardBatch.build", build))  # type: ignore[method-assign]
    runner_module.head_logits = times.wrap("LM head (screen or full, as measured)", runner_module.head_logits)
    engine.runner.execute = times.wrap("runner.execute", engine.runner.execute)  # type: ignore[method-assign]
    sampler = engine.executor.sampler
    sampler.__class__.__call__ = times.wrap("sampler", sampler.__class__.__call__)  # type: ignore[method-assign]
    engine.scheduler.schedule = times.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.apply = times.wrap("engine.apply", engine.apply)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_flat({
        "model": args.model, "quantization": args.quantization, "num_threads": args.threads,
        "max_total_tokens": args.input_len + args.steps + 512, "max_running_requests": 1}))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    vocab_size = min(50000, engine.runner.vocab_size)
    assert engine.add_request("p", random_prompts(1, args.input_len, vocab_size, 0)[0], params) is None
    for _ in range(5):   # the prefill, then warm decode steps (the plan is built at the first)
        engine.step()
    times = CallTimes()
    instrument(engine, times)
    steps = []
    load_before = os.getloadavg()[0]
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    n = args.steps
    print(f"# {args.model} {args.quantization}, 1 stream, {args.threads} threads, load {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f}: median step {statistics.median(steps) * 1e3:.2f} ms "
          f"(mean {statistics.mean(steps) * 1e3:.2f})")
    print("| call | ms per step | calls per step | us per call |")
    print("|---|---|---|---|")
    for name, seconds in sorted(times.seconds.items(), key=lambda item: -item[1]):
        calls = times.calls[name]
        print(f"| {name} | {seconds / n * 1e3:.2f} | {calls / n:.0f} | {seconds / calls * 1e6:.1f} |")


if __name__ == "__main__":
    main()
