"""`servelm bench serving` (an online load test like sglang.bench_serving / vllm bench serve) and
`servelm bench one-batch` (static-batch latency like sglang.bench_one_batch).

serving: requests come from a dataset (``random`` token prompts, ``generated-shared-prefix``
groups, or a ShareGPT-format JSON file), arrive as a Poisson process at ``--request-rate`` (``inf``:
all at once), at most ``--max-concurrency`` in flight, and stream from any OpenAI-compatible
``/v1/completions``. Metrics follow those tools' definitions:

- TTFT: request sent -> first chunk with text; E2E: request sent -> stream end;
- ITL: gaps between successive text chunks; TPOT per request: ``(E2E - TTFT) / (output tokens - 1)``;
- throughput: completed requests and output tokens over the benchmark's wall time.

Invariants: prompts and arrival times come from seeded generators, so one command line always sends
the same requests at the same offsets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from servelm.bench_common import (RequestTiming, distribution_ms, format_serve, format_speculative,
                                  format_table, one_request, random_prompts, server_facts, server_info,
                                  speculative_summary, summarize)


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    """Token ids, or text (ShareGPT)."""
    output_len: int


def random_dataset(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                   range_ratio: float = 1.0) -> list[BenchRequest]:
    """Random-token prompts; lengths uniform in ``[len * range_ratio, len]`` as sglang's random set."""
    rng = random.Random(seed)
    requests = []
    for prompt in random_prompts(num, input_len, vocab_size, seed):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        requests.append(BenchRequest(prompt[:n_in], n_out))
    return requests


def shared_prefix_dataset(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                          output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Groups of prompts that share a ``system_len``-token prefix and differ in their question."""
    prefixes = random_prompts(num_groups, system_len, vocab_size, seed)
    questions = random_prompts(num_groups * prompts_per_group, question_len, vocab_size, seed + 1)
    requests = [BenchRequest(prefixes[g] + questions[g * prompts_per_group + i], output_len)
                for g in range(num_groups) for i in range(prompts_per_group)]
    random.Random(seed).shuffle(requests)
    return requests


def sharegpt_dataset(path: str, num: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn of each ShareGPT conversation; output length from the reply's words (x1.3
    for tokens) unless ``output_len`` fixes it."""
    with open(path) as file:
        data = json.load(file)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value"):
            reply_tokens = max(1, int(len(str(turns[1].get("value", "")).split()) * 1.3))
            pairs.append(BenchRequest(turns[0]["value"], output_len or min(reply_tokens, 1024)))
    random.Random(seed).shuffle(pairs)
    if not pairs:
        raise ValueError(f"{path} has no ShareGPT conversations with two turns")
    return pairs[:num]


def arrival_offsets_s(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times: a Poisson process at ``request_rate`` req/s; all zero for ``inf``."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def _run(args: argparse.Namespace) -> tuple[list[RequestTiming], float, str, dict[str, Any]]:
    import httpx

    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout_s,
                                 limits=httpx.Limits(max_connections=None)) as client:
        name, vocab_size = await server_facts(client, base_url)
        model = args.model or name
        before = await server_info(client, base_url)
        requests = build_dataset(args, vocab_size)
        offsets = arrival_offsets_s(len(requests), args.request_rate, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        done = [0]
        start_s = time.perf_counter()

        async def send(request: BenchRequest, offset_s: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, start_s + offset_s - time.perf_counter()))
            body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with limit:
                timing = await one_request(client, f"{base_url}/v1/completions", body)
            done[0] += 1
            if not args.disable_tqdm:
                bar = "#" * (30 * done[0] // len(requests))
                print(f"\r[{bar:<30}] {done[0]}/{len(requests)}", end="", file=sys.stderr, flush=True)
            return timing

        timings = await asyncio.gather(*(send(r, o) for r, o in zip(requests, offsets)))
        duration_s = time.perf_counter() - start_s
        if not args.disable_tqdm:
            print(file=sys.stderr)
        speculative = speculative_summary(before, await server_info(client, base_url))
        return list(timings), duration_s, model, speculative


def build_dataset(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              vocab_size, args.seed, args.random_range_ratio)
    if args.dataset_name == "generated-shared-prefix":
        return shared_prefix_dataset(args.gsp_num_groups, args.gsp_prompts_per_group,
                                     args.gsp_system_prompt_len, args.gsp_question_len,
                                     args.gsp_output_len, vocab_size, args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    return sharegpt_dataset(args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    timings, duration_s, model, speculative = asyncio.run(_run(args))
    summary = summarize(timings, duration_s)
    e2e = distribution_ms([t.latency_s for t in timings if t.error is None])
    print(f"model: {model}  dataset: {args.dataset_name}  request rate: {args.request_rate}  "
          f"max concurrency: {args.max_concurrency}")
    print(format_serve(summary))
    print(format_table(("ms", "mean", "median", "p99"), [("E2E", e2e["mean"], e2e["median"], e2e["p99"])]))
    if speculative:
        print(format_speculative(speculative))
    for error in sorted({t.error for t in timings if t.error is not None})[:5]:
        print(f"error: {error}", file=sys.stderr)
    return {"mode": "serving", "model": model, "dataset": args.dataset_name,
            "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
            **asdict(summary), "e2e_latency_ms": e2e, **speculative}


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:30000")
    add("--model", default=None, help="Model name; defaults to the server's first.")
    add("--dataset-name", choices=["random", "generated-shared-prefix", "sharegpt"], default="random")
    add("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt).")
    add("--num-prompts", type=int, default=100)
    add("--request-rate", type=float, default=float("inf"),
        help="Requests per second, Poisson arrivals; inf sends all at once (default).")
    add("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no cap).")
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=1.0,
        help="Lengths are uniform in [len * ratio, len] (default 1.0: fixed).")
    add("--gsp-num-groups", type=int, default=8)
    add("--gsp-prompts-per-group", type=int, default=8)
    add("--gsp-system-prompt-len", type=int, default=512)
    add("--gsp-question-len", type=int, default=64)
    add("--gsp-output-len", type=int, default=64)
    add("--sharegpt-output-len", type=int, default=None)
    add("--seed", type=int, default=1)
    add("--api-key", default=None)
    add("--timeout-s", type=float, default=600.0)
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    add("--output-file", "--output-json", dest="output_json", default=None, help="Write the results as JSON.")


# --- one-batch -----------------------------------------------------------------------------------

def run_one_batch(args: argparse.Namespace, engine_argv: list[str]) -> dict[str, Any]:
    """Prefill of a static batch, then per-step decode latency, in-process through LLMEngine."""
    from servelm import cli_args
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    config = cli_args.build_config(engine_argv, prog="servelm bench one-batch")
    engine = LLMEngine(config)
    vocab_size = engine.runner.vocab_size
    results = []
    before = engine.stats()
    for number, batch_size in enumerate(args.batch_sizes):
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for warm in (True, False):
            prompts = random_prompts(batch_size, args.input_len, vocab_size, args.prompt_seed + 2 * number + warm)
            for index, prompt in enumerate(prompts):
                engine.add_request(f"b{batch_size}-{warm}-{index}", prompt, params)
            started: set[str] = set()
            start_s = time.perf_counter()
            while len(started) < batch_size:   # prefill steps, until every request has a token
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
            prefill_s = time.perf_counter() - start_s
            steps_s = []
            while engine.has_unfinished():
                step_start_s = time.perf_counter()
                engine.step()
                steps_s.append(time.perf_counter() - step_start_s)
        median_s = sorted(steps_s)[len(steps_s) // 2] if steps_s else float("nan")
        results.append({"batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
                        "prefill_latency_s": prefill_s,
                        "prefill_tokens_per_s": batch_size * args.input_len / prefill_s,
                        "median_decode_step_s": median_s, "decode_tokens_per_s": batch_size / median_s})
    rows = [(r["batch_size"], r["input_len"], r["output_len"], r["prefill_latency_s"], r["prefill_tokens_per_s"],
             1000 * r["median_decode_step_s"], r["decode_tokens_per_s"]) for r in results]
    print(f"model: {config.model.model}  quantization: {config.model.quantization}")
    print(format_table(("batch", "input", "output", "prefill_s", "prefill_tok/s", "decode_step_ms",
                        "decode_tok/s"), rows))
    speculative = speculative_summary(before, engine.stats())
    if speculative:
        print(format_speculative(speculative))
    return {"mode": "one-batch", "model": config.model.model, "results": results, **speculative}
