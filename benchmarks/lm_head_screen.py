"""The LM head alone, on real hidden states: the greedy screen against the full head.

Generates greedy tokens for a few real prompts (the screen off), keeps the hidden states the LM head
saw, then times on them, for M rows at once: the full head through the int16 kernel, the full
head through the dense copy (the path above the kernel's row limit), and the screen (its bounds
pass, which selects the candidates, plus their exact logits), each the median of ``--repeats``
calls, and the candidates pass's read bandwidth (the 5-bit copy and its scales once per call). It also reports
the candidate-set sizes over all kept hidden states and checks that each screened argmax is the
full head's. The thread clock with 1 thread is the default (a noisy, shared machine).

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
from servelm.model.layers.linear import dense_linear  # noqa: E402
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
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    engine = LLMEngine(EngineConfig.from_flat({"model": args.model, "num_threads": args.threads,
                                               "disable_lm_head_screen": True}))
    runner = engine.runner
    model = runner.model
    head = model.lm_head
    from servelm.model.gguf.lm_head_screen import build_screen
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
    with torch.inference_mode():
        counts, mismatches = [], 0
        for start in range(0, hidden.shape[0], 16):
            rows = hidden[start:start + 16]
            full = head(rows).float()
            screened = screen.logits(head, rows, list(range(rows.shape[0])))
            mismatches += int((full.argmax(-1) != screened.argmax(-1)).sum())
        counts = screen.stats.candidates
        q = statistics.quantiles(counts, n=100)
        print(f"RESULT {args.model}: {len(counts)} hidden states, candidates median {statistics.median(counts):.0f}, "
              f"p90 {q[89]:.0f}, p99 {q[98]:.0f}, max {max(counts)}; rows over {screen.max_candidates} "
              f"(full head): {screen.stats.fallbacks}; argmax different from the full head: {mismatches}")
        kernel = head.linear_method.kernel
        for m in [int(r) for r in args.rows.split(",")]:
            x = hidden[:m].float().contiguous()
            kernel_ms = median_ms(lambda: kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32),
                                  args.repeats, clock)
            rows = hidden[:m].contiguous()
            # the full head as the model routes it (the rows kernel's GEMM for a bf16 model where it
            # is built: such a head keeps no dense copy), else the dense copy
            dense_ms = median_ms(lambda: head.linear_method.apply(head, rows, None) if head.gguf_dense is None
                                 else dense_linear(x.to(head.gguf_dense.dtype), head.gguf_dense),
                                 args.repeats, clock)
            screen_ms = median_ms(lambda: screen.logits(head, x, list(range(m))), args.repeats, clock)
            candidates_ms = median_ms(lambda: screen.screen_kernel.screen_candidates(
                x, screen.packed, screen.tiled_scales, weight.codes.shape[0], screen.code_error, screen.max_candidates),
                args.repeats, clock)
            print(f"RESULT M={m}: full head int16 kernel {kernel_ms:.2f} ms, "
                  f"{'routed (' + str(rows.dtype)[6:] + ' rows)' if head.gguf_dense is None else 'dense copy'} "
                  f"{dense_ms:.2f} ms, screen {screen_ms:.2f} ms ({screen_ms / m:.2f} a row; candidates "
                  f"pass {candidates_ms:.2f} ms, {screen.nbytes / candidates_ms / 1e6:.1f} GB/s)")
    print(f"RESULT {args.threads} threads, {args.clock} clock, load {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
          "(noisy, shared machine)")
    engine.shutdown()


if __name__ == "__main__":
    main()
