"""The LM head alone, on real hidden states: the greedy screen against the full head.

Generates greedy tokens for a few real prompts (the screen off), keeps the hidden states the LM head
saw, then reports, for each way the screen finds candidates (its 5-bit copy; the int8 GEMM where it is
built), the candidate-set sizes over all kept hidden states and whether each screened argmax is the
int16 kernel's; and times, for M rows at once, the full head through the int16 kernel, the full head
as its routes take M rows, and each screen way (candidates plus their exact logits), each the median
of ``--repeats`` calls. The thread clock with 1 thread is the default (a noisy, shared machine).

    .venv/bin/python benchmarks/lm_head_screen.py --model gemma3-270m --rows 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.gguf import gguf_i8gemm  # noqa: E402
from servelm.model.gguf.lm_head_screen import FIVE_BITS, INT8, ScreenStats, build_screen  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402

PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "Once upon a time, in a land far away,",
    "import numpy as np\n\nx = np.", "Explain the theory of relativity in simple terms.",
    "SELECT name, email FROM users WHERE", "The three primary colors are",
    "class Stack:\n    def __init__(self):",
]


def median_ms(call, repeats: int, clock) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--screen-levels", type=int, default=None,
                        help="the AVX2 build's int8 screen rounds activations to this many levels (default: "
                             "gguf_i8gemm.AVX2_SCREEN_LEVELS)")
    args = parser.parse_args()
    if args.screen_levels is not None:
        gguf_i8gemm.AVX2_SCREEN_LEVELS = args.screen_levels
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    engine = LLMEngine(EngineConfig.from_flat({"model": args.model, "num_threads": args.threads,
                                               "disable_lm_head_screen": True}))
    runner = engine.runner
    model = runner.model
    head = model.lm_head
    screen, reason = build_screen(model, getattr(head.linear_method, "activations", None), disabled=False,
                                  tp_size=1, pp_size=1, device=runner.device)
    weight = getattr(head, "gguf_weight", None)
    print(f"RESULT {args.model}: head {getattr(weight, 'kind', 'float')} {tuple(weight.codes.shape) if weight is not None else ''}; "
          f"screen {reason}")
    if screen is None:
        return
    captured: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden, *rest: (captured.append(hidden.detach().clone()),
                                                   compute_logits(hidden, *rest))[1]
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), engine.tokenizer.encode(prompt),
                           SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    model.compute_logits = compute_logits
    hidden = torch.cat(captured)
    load_before = os.getloadavg()[0]
    ways = [FIVE_BITS] + ([INT8] if screen.i8 is not None else [])
    with torch.inference_mode():
        for way in ways:
            screen.stats = ScreenStats()
            mismatches = 0
            for start in range(0, hidden.shape[0], 16):
                rows = hidden[start:start + 16].float().contiguous()
                exact = head.linear_method.kernel.block_linear_a16(rows, weight.codes, weight.scales, None, 32)
                screened = screen.logits(head, rows, list(range(rows.shape[0])), way)
                mismatches += int((exact.argmax(-1) != screened.argmax(-1)).sum())
            counts = screen.stats.candidates
            q = statistics.quantiles(counts, n=100)
            print(f"RESULT {args.model} {way}: {len(counts)} hidden states, candidates median "
                  f"{statistics.median(counts):.0f}, mean {statistics.mean(counts):.0f}, p90 {q[89]:.0f}, "
                  f"p99 {q[98]:.0f}, max {max(counts)}; rows over {screen.max_candidates} (full head): "
                  f"{screen.stats.fallbacks}; argmax different from the int16 kernel's: {mismatches}")
        kernel = head.linear_method.kernel
        for m in [int(r) for r in args.rows.split(",")]:
            x = hidden[:m].float().contiguous()
            if x.shape[0] < m:   # fewer kept states than rows: repeat them
                x = x.repeat(-(-m // x.shape[0]), 1)[:m].contiguous()
            times = {"int16 kernel": median_ms(lambda: kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32),
                                               args.repeats, clock),
                     f"routed ({head.gguf_routes.pick(m, False, False).value})":
                         median_ms(lambda: head(x), args.repeats, clock)}
            for way in ways:
                times[f"screen {way}"] = median_ms(lambda: screen.logits(head, x, list(range(m)), way),
                                                   args.repeats, clock)
            print(f"RESULT M={m}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()))
    print(f"RESULT {args.threads} threads, {args.clock} clock, load {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
          "(noisy, shared machine)")
    engine.shutdown()


if __name__ == "__main__":
    main()
