"""`servelm bench`: offline engine throughput, and a load generator for a running server.

- ``servelm bench offline [MODEL] [engine flags]``: starts servelm.Engine (the same flags as
  ``servelm serve``) and times batches of random-token prompts, greedy with ``ignore_eos``.
- ``servelm bench serve --base-url URL``: streams /v1/completions requests at a fixed concurrency
  and reports time to first token and inter-token latency.
- ``servelm bench serving`` and ``servelm bench one-batch``: see servelm/bench_serving.py.

Invariants:
- Prompts are random token ids from a seeded generator: the same flags give the same prompts, so
  two runs (or two engines) see identical work.
- Offline decode speed is derived from two runs of the same batch shape: one with max_tokens=1
  (prefill plus one sampled token) and one with the full output length; the difference is the
  time of the remaining ``output_len - 1`` decode steps. Each run uses fresh prompts, so a prefix
  cache can never turn the second run's prefill into a cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from servelm import cli_args
from servelm.bench_common import (FALLBACK_VOCAB_SIZE, OfflineResult, RequestTiming, format_offline,
                                  format_serve, format_speculative, one_request, random_prompts,
                                  server_facts, server_info, speculative_summary, summarize,
                                  write_json)

BENCH_PROG = "servelm bench"


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``; every size must be a positive integer."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# --- argument parsing ----------------------------------------------------------------------------

class BenchError(ValueError):
    """A bad bench command line; the message names the flag."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    """The `servelm bench` parser. Offline mode leaves unknown flags to the engine parser."""
    parser = _Parser(prog=BENCH_PROG, description="Benchmark the engine offline or a running server.",
                     allow_abbrev=False)
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True, parser_class=_Parser)

    offline = modes.add_parser(
        "offline", allow_abbrev=False, usage=f"{BENCH_PROG} offline [MODEL] [engine flags] [options]",
        help="Time batches through servelm.Engine.",
        description="Time batches of random prompts through servelm.Engine. Every other flag "
        "(and MODEL) is an engine flag, as for `servelm serve`.")
    offline.add_argument("--batch-sizes", type=parse_batch_sizes, default=[1, 8],
                         help="Comma-separated batch sizes (default: 1,8).")
    offline.add_argument("--num-warmup", type=int, default=1,
                         help="Short warm-up batches before timing (default: 1).")

    serve = modes.add_parser("serve", allow_abbrev=False, help="Load-test a running server.",
                             description="Stream /v1/completions requests at a fixed concurrency.")
    serve.add_argument("--base-url", default="http://127.0.0.1:30000",
                       help="Server address (default: http://127.0.0.1:30000).")
    serve.add_argument("--model", default=None, help="Model name; defaults to the server's first.")
    serve.add_argument("--num-prompts", type=_positive_int, default=32, help="Requests (default: 32).")
    serve.add_argument("--concurrency", type=_positive_int, default=8,
                       help="Requests in flight at once (default: 8).")
    serve.add_argument("--api-key", default=None, help="Bearer token, if the server needs one.")
    serve.add_argument("--timeout-s", type=float, default=600.0,
                       help="Per-request timeout in seconds (default: 600).")

    from servelm.bench_serving import add_serving_arguments

    serving = modes.add_parser(
        "serving", allow_abbrev=False, help="Online load test of any OpenAI-compatible server.",
        description="Datasets random / generated-shared-prefix / ShareGPT, Poisson arrivals, "
        "TTFT, TPOT, ITL and E2E latency (like sglang.bench_serving and vllm bench serve).")
    add_serving_arguments(serving)
    one_batch = modes.add_parser(
        "one-batch", allow_abbrev=False, usage=f"{BENCH_PROG} one-batch [MODEL] [engine flags] [options]",
        help="Prefill and per-step decode latency of a static batch (in-process).",
        description="Like sglang.bench_one_batch. Every other flag is an engine flag.")
    one_batch.add_argument("--batch-sizes", type=parse_batch_sizes, default=[1, 8])

    for sub in (offline, serve, one_batch):
        sub.add_argument("--input-len", type=_positive_int, default=128,
                         help="Prompt tokens per request (default: 128).")
        sub.add_argument("--output-len", type=_positive_int, default=64,
                         help="Generated tokens per request (default: 64).")
        sub.add_argument("--prompt-seed", type=int, default=0,
                         help="Seed of the random prompts (default: 0).")
        sub.add_argument("--output-json", metavar="PATH", default=None,
                         help="Also write the results as JSON.")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(bench options, engine arguments); engine arguments are only allowed in offline mode."""
    namespace, rest = build_parser().parse_known_args(list(argv))
    if namespace.mode in ("serve", "serving") and rest:
        raise BenchError(f"unrecognized arguments: {' '.join(rest)}")
    if namespace.mode == "offline" and namespace.num_warmup < 0:
        raise BenchError(f"--num-warmup must be non-negative, got {namespace.num_warmup}")
    return namespace, rest


def flat_engine_args(config: Any) -> dict[str, Any]:
    """An EngineConfig as the flat keyword arguments servelm.Engine takes."""
    return {f.name: getattr(getattr(config, section.name), f.name)
            for section in dataclasses.fields(config)
            for f in dataclasses.fields(getattr(config, section.name))}


# --- offline -------------------------------------------------------------------------------------

def _timed_generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from servelm.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start_s = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed_s = time.perf_counter() - start_s
    for result in results:
        if result.error is not None:
            raise RuntimeError(f"request failed: {result.error}")
        if len(result.token_ids) != max_tokens:
            raise RuntimeError(f"expected {max_tokens} tokens, got {len(result.token_ids)}")
    return elapsed_s


def run_offline(args: argparse.Namespace, engine_argv: list[str]) -> dict[str, Any]:
    from servelm.engine.offline import Engine

    config = cli_args.build_config(engine_argv, prog=f"{BENCH_PROG} offline")
    start_s = time.perf_counter()
    engine = Engine(**flat_engine_args(config))
    startup_s = time.perf_counter() - start_s
    results: list[OfflineResult] = []
    try:
        vocab_size = int(engine.model_info.get("vocab_size") or FALLBACK_VOCAB_SIZE)
        largest = max(args.batch_sizes)
        for index in range(args.num_warmup):
            seed = args.prompt_seed - 1 - index  # warm-up prompts are never timed prompts
            prompts = random_prompts(largest, args.input_len, vocab_size, seed)
            _timed_generate(engine, prompts, min(4, args.output_len))
        warm_info = engine.get_server_info()  # figures of the timed runs only
        for number, batch_size in enumerate(args.batch_sizes):
            seed = args.prompt_seed + 2 * number  # fresh prompts per run: no prefix-cache hits
            prefill_s = _timed_generate(
                engine, random_prompts(batch_size, args.input_len, vocab_size, seed), 1)
            total_s = _timed_generate(
                engine, random_prompts(batch_size, args.input_len, vocab_size, seed + 1),
                args.output_len)
            result = OfflineResult(batch_size, args.input_len, args.output_len, prefill_s, total_s)
            results.append(result)
            print(f"batch {batch_size}: prefill {prefill_s:.2f} s, total {total_s:.2f} s",
                  file=sys.stderr, flush=True)
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    print(f"model: {config.model.model}")
    print(format_offline(results, startup_s))
    speculative = speculative_summary(warm_info, info)
    if speculative:
        print(format_speculative(speculative))
    return {"mode": "offline", "model": config.model.model, "startup_s": startup_s,
            "results": [r.to_dict() for r in results], **speculative}


# --- serve ---------------------------------------------------------------------------------------

async def _run_serve(args: argparse.Namespace
                     ) -> tuple[list[RequestTiming], float, str, dict[str, Any]]:
    import httpx

    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout_s, limits=limits) as client:
        name, vocab_size = await server_facts(client, base_url)
        model = args.model or name
        before = await server_info(client, base_url)
        prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.prompt_seed)
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: list[int]) -> RequestTiming:
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with semaphore:
                return await one_request(client, f"{base_url}/v1/completions", body)

        start_s = time.perf_counter()
        timings = await asyncio.gather(*(limited(p) for p in prompts))
        duration_s = time.perf_counter() - start_s
        speculative = speculative_summary(before, await server_info(client, base_url))
        return list(timings), duration_s, model, speculative


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    timings, duration_s, model, speculative = asyncio.run(_run_serve(args))
    summary = summarize(timings, duration_s)
    print(f"model: {model}  concurrency: {args.concurrency}  input: {args.input_len}  "
          f"output: {args.output_len}")
    print(format_serve(summary))
    if speculative:
        print(format_speculative(speculative))
    errors = sorted({t.error for t in timings if t.error is not None})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    return {"mode": "serve", "model": model, "base_url": args.base_url,
            "concurrency": args.concurrency, "input_len": args.input_len,
            "output_len": args.output_len, **dataclasses.asdict(summary), **speculative}


def main(argv: Sequence[str]) -> None:
    """Entry point of `servelm bench`."""
    try:
        args, engine_argv = parse_args(argv)
        if args.mode == "offline":
            payload = run_offline(args, engine_argv)
        elif args.mode == "serve":
            payload = run_serve(args)
        else:
            from servelm.bench_serving import run_one_batch, run_serving
            payload = run_serving(args) if args.mode == "serving" else run_one_batch(args, engine_argv)
    except (BenchError, cli_args.CliError, ValueError) as error:
        print(f"servelm: {error}\n(see `{BENCH_PROG} --help`)", file=sys.stderr)
        raise SystemExit(2) from None
    if args.output_json:
        write_json(args.output_json, payload)
