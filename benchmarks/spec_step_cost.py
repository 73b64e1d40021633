"""What a speculative verify step of k drafts costs against a plain one-token step, in-process.

One greedy request (the n-gram benchmark's refactor prompt) decodes with a proposer that drafts
exactly k tokens each step, k cycling through ``--drafts`` (so every k sees the same machine state
and context length); each step's time is split into the engine's stages: the proposer, schedule,
the layers (model.forward), the LM head (screen or full head: runner.execute less the layers and
the batch build), sampling + verification (executor less runner), and update. Drafts are the
model's own next tokens (from a plain greedy run first), so every draft is accepted and the
request advances k + 1 tokens per step as in a copy; ``--reject`` drafts a wrong token instead
(one token per step). Medians per k; ``--clock thread`` with ``--num-threads 1`` is the work itself.

    .venv/bin/python benchmarks/spec_step_cost.py --num-threads 1 --clock thread --drafts 0,1,2,3,5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spec_ngram import prompts  # noqa: E402
from servelm.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig,  # noqa: E402
                            RuntimeConfig, SchedulerConfig, SpeculativeConfig)
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.forward_batch import ForwardBatch  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402
from servelm.spec.proposer import Draft, DraftRequest  # noqa: E402


class ScriptedProposer:
    """Drafts the next ``k`` tokens of a known greedy continuation (or k wrong tokens)."""

    name = "NGRAM"

    def __init__(self, continuation: list[int], reject: bool) -> None:
        self.continuation = continuation
        self.reject = reject
        self.k = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            done = len(request.output_token_ids)
            tokens = self.continuation[done:done + self.k]
            if self.reject:
                tokens = [(t + 1) % 1000 for t in tokens]
            drafts.append(Draft(tokens[:request.max_draft_tokens]))
        return drafts

    def release(self, request_id: str) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafts", default="0,1,2,3,4,5")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    parser.add_argument("--reject", action="store_true")
    parser.add_argument("--disable-lm-head-screen", action="store_true")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    ks = [int(k) for k in args.drafts.split(",")]
    proposer = ScriptedProposer([], args.reject)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(max_total_tokens=16384, disable_radix_cache=True),
        scheduler=SchedulerConfig(max_prefill_tokens=4096, chunked_prefill_size=4096),
        runtime=RuntimeConfig(num_threads=args.num_threads,
                              disable_lm_head_screen=args.disable_lm_head_screen),
        speculative=SpeculativeConfig(speculative_algorithm="NGRAM",
                                      num_speculative_tokens=max(ks) or 1)), proposer=proposer)
    prompt = prompts(engine.tokenizer, 1)[0]
    total = args.rounds * sum(k + 1 for k in ks) + 16 if not args.reject else args.rounds * len(ks) + 16
    params = SamplingParams(temperature=0.0, max_tokens=total + 8, ignore_eos=True)
    engine.add_request("plain", prompt, params)
    continuation: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            continuation.extend(output.new_token_ids)
    proposer.continuation = continuation

    stage: dict[str, float] = defaultdict(float)

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = clock()
            result = fn(*a, **kw)
            stage[key] += clock() - start
            return result
        return wrapper

    runner: Any = engine.runner
    original_build = ForwardBatch.build.__func__  # type: ignore[attr-defined]
    ForwardBatch.build = classmethod(timed("build", original_build))  # type: ignore[method-assign]
    runner.model.forward = timed("layers", runner.model.forward)
    runner.execute = timed("runner", runner.execute)
    engine.executor.execute = timed("executor", engine.executor.execute)  # type: ignore[method-assign]
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.speculation.propose = timed("propose", engine.speculation.propose)  # type: ignore[method-assign]
    engine._update = timed("update", engine._update)  # type: ignore[method-assign]

    engine.add_request("timed", prompt, params)
    outputs = [t for _ in range(2) for o in engine.step() for t in o.new_token_ids]  # prefill, 1 decode
    samples: dict[int, list[dict[str, float]]] = defaultdict(list)
    emitted: dict[int, list[int]] = defaultdict(list)
    for round_index in range(args.rounds + 1):
        for k in ks:
            proposer.k = k
            stage.clear()
            start = clock()
            new = [t for o in engine.step() for t in o.new_token_ids]
            elapsed = clock() - start
            outputs.extend(new)
            if round_index:  # the first round warms every shape
                samples[k].append({"step": elapsed, **stage})
                emitted[k].append(len(new))
    same = continuation[:len(outputs)] == outputs

    def med(k: int, key: str) -> float:
        return 1000 * statistics.median(s.get(key, 0.0) for s in samples[k])

    print(f"{args.model} ({engine.model_info.get('dtype', args.dtype)}), {args.num_threads} threads, "
          f"{args.clock} clock, {args.rounds} rounds; drafts {'rejected' if args.reject else 'accepted'}; "
          f"outputs equal to plain: {same}; LM-head screen "
          f"{'off' if args.disable_lm_head_screen else 'on'}")
    print("| drafts k | rows | step ms | x 1-row step | tokens/step | ms/token | propose | schedule | "
          "build | layers | LM head | sample+verify | update |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = med(ks[0], "step")
    for k in ks:
        step = med(k, "step")
        layers, runner_ms, build = med(k, "layers"), med(k, "runner"), med(k, "build")
        tokens = statistics.median(emitted[k])
        print(f"| {k} | {k + 1} | {step:.2f} | {step / base:.2f} | {tokens:.0f} | {step / tokens:.2f} | "
              f"{med(k, 'propose'):.2f} | {med(k, 'schedule'):.2f} | {build:.2f} | {layers:.2f} | "
              f"{runner_ms - layers - build:.2f} | {med(k, 'executor') - runner_ms:.2f} | "
              f"{med(k, 'update'):.2f} |")


if __name__ == "__main__":
    main()
