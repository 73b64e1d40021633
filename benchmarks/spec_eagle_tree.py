"""EAGLE trees against the chain, in one run: the accept length (tokens per verify pass) and the
time of a speculative step (thread CPU time of ``engine.step``: head steps + one verify pass),
single stream, greedy, one thread.

    python benchmarks/spec_eagle_tree.py [--model qwen2.5-coder-0.5b] [--tokens 48]

The head is a random-weight EAGLE-3 head in the published format (no trained head exists
offline): its drafts are almost never accepted, so this measures the mechanics' cost, not a
speed-up. ``--copying`` instead runs the tiny one-layer model with the head built to copy it
(``tests/eagle_heads.py``), whose drafts are often accepted: accept lengths of chain vs trees.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.model.eagle_checkpoint import main as write_head
from servelm.sampling.params import SamplingParams

SHAPES = [("plain", None, None, None), ("chain k=3", 1, 3, 3), ("tree topk 2, 3 steps, 4 drafts", 2, 3, 4),
          ("tree topk 4, 3 steps, 8 drafts", 4, 3, 8)]
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def run(model: str, head: str | None, algorithm: str, topk: int | None, steps: int | None,
        num_drafts: int | None, tokens: int, prompt_ids: list[int] | None = None) -> dict:
    flags = dict(model=model, num_threads=1, dtype="float32", max_total_tokens=4096)
    if topk is not None:
        flags.update(speculative_algorithm=algorithm, speculative_draft_model_path=head,
                     speculative_eagle_topk=topk, speculative_num_steps=steps,
                     num_speculative_tokens=num_drafts)
    if prompt_ids is not None:
        flags["skip_tokenizer_init"] = True
    engine = LLMEngine(EngineConfig.from_flat(flags))
    ids = prompt_ids or engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    engine.add_request("0", ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    step_ms: list[float] = []
    output: list[int] = []
    while engine.has_unfinished():
        start = time.thread_time()
        for item in engine.step():
            output.extend(item.new_token_ids)
        step_ms.append((time.thread_time() - start) * 1000)
    stats = engine.stats()
    engine.shutdown()
    decode_steps = step_ms[1:]  # the first step is the prefill
    return {"output": output, "step_ms": statistics.median(decode_steps),
            "ms_per_token": sum(decode_steps) / max(1, len(output) - 1),
            "accept_length": stats.get("spec_accept_length", 1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--copying", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eagle-tree-"))
    if args.copying:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.eagle_heads import make_copying_head, make_one_layer_target
        from tests.e2e.test_speculative_tiny import prompts

        model = str(make_one_layer_target(root))
        head, algorithm = str(make_copying_head(Path(model), root / "copying")), "EAGLE"
        shapes = SHAPES + [("chain k=5", 1, 5, 5), ("tree topk 2, 5 steps, 8 drafts", 2, 5, 8),
                           ("tree topk 2, 5 steps, 14 drafts", 2, 5, 14)]
        prompt_ids = prompts(1)[0]
    else:
        model, head, algorithm, shapes, prompt_ids = args.model, str(root / "head"), "EAGLE3", SHAPES, None
        write_head(["--model", model, "--algorithm", "EAGLE3", "--out", head])
    results = {name: run(model, head, algorithm, topk, steps, n, args.tokens, prompt_ids)
               for name, topk, steps, n in shapes}
    plain = results["plain"]
    print(f"{'copying head, tiny one-layer model' if args.copying else args.model + ', random EAGLE-3 head'}"
          f", float32, one thread, {args.tokens} greedy tokens (noisy shared machine):")
    for name, result in results.items():
        same = "same tokens" if result["output"] == plain["output"] else "DIFFERENT TOKENS"
        print(f"  {name}: accept length {result['accept_length']:.2f}, step {result['step_ms']:.1f} ms "
              f"({result['step_ms'] / plain['step_ms']:.2f}x a decode step), "
              f"{result['ms_per_token']:.1f} ms/token; {same}")


if __name__ == "__main__":
    main()
