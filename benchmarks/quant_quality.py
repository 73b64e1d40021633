"""Quality of the CPU quantization modes against float32: greedy agreement and perplexity.

For each mode (``--quantization`` and ``--kv-cache-dtype`` pairs) the script
- generates ``--max-tokens`` greedy tokens for each held-out prompt below and compares them with
  float32's: the share of prompts whose output is identical, and the mean number of leading tokens
  that agree (divergence compounds, so this is the stricter figure);
- computes the perplexity of the text below, one forward pass over the whole text;
- times single-stream greedy decode (tok/s, prefill excluded) and reports the bytes of the
  linear, head and embedding weights after quantization.

A quantization may carry mixed-precision overrides for the LM head and the embedding, e.g.
``w8a8_int8+head=int8wo:auto`` or ``int4wo-128+emb=int8:auto`` (see ``quantize_model``); the model
then loads in float32 (``--dtype float32``: the reference is the float32 dequantized GGUF) and the
script requantizes it with those overrides. ``gguf`` is the default for a GGUF file (its own
blocks, servelm/model/gguf/gguf_weights.py); ``gguf+route=R`` puts GGUF route R (block, rows, int8, dense:
servelm/model/gguf/gguf_routes.py) first at every row count instead of the table measured on this
machine (the quality rules still apply: generation rows never take int8, a float32 model's first rows
keep the block kernel), e.g. ``gguf+route=block`` to put the perplexity pass and prefill through the block
kernel too (the former ``kernel_rows=1000000``). ``gguf_a8`` rounds the
kernel's activations to int8 per 32 inputs as llama.cpp does. ``+residual=model`` keeps a bf16 model's
residual stream in bf16 (``--residual-dtype model``; default auto: float32 on CPU), e.g. ``auto+residual=model``.

    .venv/bin/python benchmarks/quant_quality.py [--model gemma3-270m] [--modes none:auto,int8wo:auto]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.forward_batch import BatchPlan, SequencePlan  # noqa: E402
from servelm.model.gguf.gguf_routes import Route  # noqa: E402
from servelm.model.layers.quantization import quantize_model  # noqa: E402
from servelm.model.routes import forced_route  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402

PROMPTS = [
    "The main difference between a process and a thread is",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "In 1969, the first humans to walk on the Moon were",
    "A good way to learn a new language is to",
    "SELECT name, COUNT(*) FROM orders",
    "The recipe calls for two cups of flour, one egg and",
    "Photosynthesis converts light energy into",
    "Dear hiring manager, I am writing to apply for",
]

MORE_PROMPTS = [
    "The three states of matter that most people learn about in school are",
    "import numpy as np\n\ndef normalize(v):\n",
    "The capital of Australia is not Sydney but",
    "To change a flat tyre, first loosen the",
    "#include <stdio.h>\n\nint main(void) {\n",
    "The French Revolution began in the year",
    "A binary search tree is a data structure in which",
    "My favourite season is autumn because",
    "The water cycle describes how water moves between",
    "git commit -m \"",
    "In economics, inflation means that",
    "Once upon a time, in a village at the edge of a forest,",
    "The speed of light in a vacuum is about",
    "for (let i = 0; i < items.length; i++) {\n",
    "The most important rule of kitchen safety is",
    "Mount Everest is located on the border between",
    "A healthy breakfast usually includes",
    "class Stack:\n    def __init__(self):\n",
    "The human heart has four chambers:",
    "When the meeting ended, everyone agreed that",
    "The chemical symbol for gold is",
    "To install the package, run",
    "Shakespeare wrote many plays, including",
    "The difference between weather and climate is",
]
"""Held out as well: ``--more-prompts`` adds them to PROMPTS (32 prompts, a finer gate than 8)."""

TOPICS = ("volcanoes", "the printing press", "honey bees", "compound interest", "the Roman Empire", "jazz",
          "sourdough bread", "black holes", "the immune system", "chess openings", "glaciers", "electric cars",
          "origami", "the Silk Road", "coral reefs", "public libraries", "the Internet", "wolves", "tea",
          "solar panels", "the Olympic Games", "earthquakes", "penguins", "the violin", "democracy",
          "recycling", "the Moon landing", "rainforests", "bicycles", "vaccines", "the Great Wall of China",
          "owls", "coffee", "the stock market", "submarines", "tornadoes", "the piano", "mushrooms",
          "the Renaissance", "lighthouses", "kangaroos", "video games", "the Nile", "bridges", "comets",
          "knitting", "the human brain", "deserts", "trains", "the alphabet", "octopuses", "marathons",
          "the telescope", "whales", "chocolate", "castles", "the weather", "robots", "gardening", "maps",
          "photography", "the ocean tides", "ants", "paper money")
TOPIC_PROMPTS = [f"Here is a short paragraph about {topic}:" for topic in TOPICS]
"""``--more-prompts 96``: 64 more held-out prompts of one shape, for a gate whose share moves ~1% per
flipped output (a greedy output flips on near-ties, so 8 or 32 prompts measure mostly luck)."""
TEMPLATE_PROMPTS = [template.format(topic) for template in (
    "Q: What is special about {}?\nA:", "The most surprising fact about {} is that",
    "Write two sentences for children about {}.\n") for topic in TOPICS]
"""``--more-prompts 288``: the topics in three more shapes. At 96 prompts the share's standard error is
still ~4 points (a 78% share: sqrt(0.78 * 0.22 / 96)); at 288 it is ~2.4."""

TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls. Its keeper climbed the spiral stairs twice a day, once at dusk to light the "
    "lamp and once at dawn to put it out, and in between he wrote letters that he rarely sent. When "
    "the supply boat came in spring it brought flour, oil, newspapers that were already weeks old and, "
    "sometimes, a reply. He read each one slowly, standing by the window, and then filed it in a "
    "wooden box under the bed. Over the years the box filled up, and the letters in it told a story "
    "of a town that changed while he did not: a bridge was built, a school was closed, a harbour was "
    "dredged so that larger ships could dock. The keeper followed all of it from a distance, and when "
    "the lamp was finally automated he found that he did not want to leave."
)


MODES = [("none", "auto"), ("gguf", "auto"), ("gguf+route=block", "auto"), ("gguf_a8", "auto"),
         ("gguf_a8+route=block", "auto"), ("w8a8_int8", "auto"), ("none", "fp8_e4m3"), ("none", "fp8_e5m2"),
         ("w8a8_int8", "fp8_e4m3"), ("int8wo", "auto"), ("int4wo-128", "auto"), ("int4wo-64", "auto"),
         ("w8a8_int8+head=int8wo", "auto"), ("w8a8_int8+emb=int8", "auto"), ("int4wo-128+head=int8wo", "auto")]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"q{index}", prompt, params)
    tokens: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"q{i}"] for i in range(len(prompts))]


def perplexity(engine: LLMEngine, token_ids: list[int]) -> float:
    runner = engine.runner
    blocks = list(range(math.ceil(len(token_ids) / runner.block_size)))
    plan = BatchPlan([SequencePlan(token_ids, 0, blocks, num_logits=len(token_ids))])
    logits = runner.execute(plan)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))


def decode_tok_s(engine: LLMEngine, prompt: list[int], max_tokens: int = 33, streams: int = 1) -> float:
    """Greedy decode rate of ``streams`` copies of ``prompt`` decoded together, prefill excluded:
    ``streams * (n - 1) / (t(n) - t(1))``."""
    def run(tokens: int) -> float:
        start = time.perf_counter()
        greedy(engine, [prompt] * streams, tokens)
        return time.perf_counter() - start
    run(4)   # warm up
    return streams * (max_tokens - 1) / (run(max_tokens) - run(1))


def build_engine(model: str, mode: str, kv_dtype: str, num_threads: int | None) -> tuple[LLMEngine, int]:
    """An engine for ``mode`` (``method[+head=X][+emb=Y]``) and its quantized weight bytes.

    The model loads in float32 and is requantized here by ``quantize_model`` -- the function the
    runner calls for ``--quantization`` -- so that every mode reports its stored bytes.
    """
    method, *overrides = mode.split("+")
    options = dict(override.split("=", 1) for override in overrides)
    if method in ("gguf", "gguf_a8", "auto"):   # the GGUF's own blocks, applied by the runner itself
        forced = Route(options["route"]) if "route" in options else None
        with forced_route(forced) if forced else contextlib.nullcontext():
            engine = LLMEngine(EngineConfig.from_flat({
                "model": model, "quantization": method, "kv_cache_dtype": kv_dtype,
                "residual_dtype": options.get("residual", "auto"), "max_total_tokens": 8192,
                "disable_radix_cache": True, "num_threads": num_threads}))
        weights = {id(w): w.nbytes for m in engine.runner.model.modules()
                   if (w := getattr(m, "gguf_weight", None)) is not None}
        floats = {id(p): p.nbytes for p in engine.runner.model.parameters() if p.dim() == 2}
        return engine, sum(weights.values()) + sum(floats.values())
    engine = LLMEngine(EngineConfig.from_flat({
        "model": model, "quantization": "none", "dtype": "float32", "kv_cache_dtype": kv_dtype,
        "max_total_tokens": 8192, "disable_radix_cache": True, "num_threads": num_threads}))
    network = engine.runner.model
    stored = quantize_model(network, method, head=options.get("head"), embedding=options.get("emb"))
    if not stored:   # float32: count each weight once (the tied head shares the embedding's)
        stored = sum({id(p): p.nbytes for p in network.parameters() if p.dim() == 2}.values())
    return engine, stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(f"{q}:{kv}" for q, kv in MODES),
                        help="quantization:kv-cache-dtype pairs; the first is the reference")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: the engine's); 1 avoids OpenMP stalls on a busy machine")
    parser.add_argument("--more-prompts", type=int, nargs="?", const=32, default=8, choices=(8, 32, 96, 288),
                        dest="prompt_count",
                        help="32, 96 or 288 held-out prompts instead of 8 (each output flip moves the share "
                             "3%%, 1%% or 0.35%%, not 12.5%%)")
    parser.add_argument("--copies", type=int, default=1,
                        help="run each prompt this many times in one batch (4: 32 decode rows, where the "
                             "kernels' routing differs from 8 rows); every copy is compared")
    parser.add_argument("--no-speed", dest="speed", action="store_false",
                        help="skip the decode timing (the machine is shared: compare within a run)")
    args = parser.parse_args()
    prompt_texts = (PROMPTS + MORE_PROMPTS + TOPIC_PROMPTS + TEMPLATE_PROMPTS)[:args.prompt_count]
    reference: list[list[int]] | None = None
    rows = []
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    for quantization, kv_dtype in (mode.split(":") for mode in args.modes.split(",")):
        engine, stored = build_engine(args.model, quantization, kv_dtype, args.num_threads)
        prompts = [engine.tokenizer.encode(p) for p in prompt_texts] * args.copies
        outputs = greedy(engine, prompts, args.max_tokens)
        text_ppl = perplexity(engine, engine.tokenizer.encode(TEXT))
        if reference is None:
            reference = outputs
        identical = sum(o == r for o, r in zip(outputs, reference)) / len(outputs)
        leading = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
                   for o, r in zip(outputs, reference)]
        speed = decode_tok_s(engine, prompts[0]) if args.speed else float("nan")
        rows.append((quantization, kv_dtype, identical, sum(leading) / len(leading), text_ppl, speed,
                     stored / 2 ** 20))
        print(rows[-1], file=sys.stderr, flush=True)
        del engine
    print(f"load average after: {os.getloadavg()}", file=sys.stderr, flush=True)
    print(f"| quantization | kv cache | identical greedy outputs ({len(prompt_texts)} prompts x {args.copies} x "
          f"{args.max_tokens} tokens) | mean agreeing prefix, tokens | perplexity ({args.model}) "
          "| 1-stream decode tok/s | weights MiB |")
    print("|---|---|---|---|---|---|---|")
    for quantization, kv_dtype, identical, leading, text_ppl, speed, mib in rows:
        print(f"| {quantization} | {kv_dtype} | {identical:.0%} | {leading:.1f} | {text_ppl:.2f} "
              f"| {speed:.1f} | {mib:.0f} |")


if __name__ == "__main__":
    main()
