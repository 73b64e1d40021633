"""Prefill/decode disaggregation under a mixed workload: short chats decode continuously while
long prompts arrive periodically; co-located vs disaggregated on the same CPU budget.

Runs the same workload against two set-ups, one after the other:

- ``colocated``: one ``servelm serve`` with ``--num-threads 2``;
- ``pd``: a prefill server (1 thread) + a decode server (1 thread) + ``servelm router`` in PD mode
  (SGLang's bootstrap protocol, K/V over pyzmq TCP on loopback).

Workload: ``--chats`` streams each send one short completion after another (``--chat-prompt-tokens``
random tokens, ``--chat-tokens`` generated, ``ignore_eos``); after ``--warmup-s`` the first of
``--long-prompts`` long prompts (``--long-prompt-tokens`` random tokens, ``--long-tokens``
generated) arrives, the next every ``--long-interval-s``; the chats stop when the last long prompt
is answered. Reported per set-up: inter-token latency p50/p99 of the chats (time between streamed
text chunks), TTFT of the long prompts, output throughput (all requests), and for ``pd`` the K/V
bytes moved per request and the transfer time per 1k prompt tokens (prefill side's block read +
send plus decode side's read + write into its pool, from the servers' /get_server_info counters).

    .venv/bin/python benchmarks/pd_mixed.py                       # qwen2.5-coder-0.5b, defaults
    .venv/bin/python benchmarks/pd_mixed.py --model smollm2-135m --long-prompts 3 --chats 4

Prints a markdown table (and ``--json PATH`` writes the raw figures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from servelm.bench_common import (RequestTiming, one_request, percentile,  # noqa: E402
                                  random_prompts, server_facts, write_json)
from tests.e2e.router_process import RouterProcess  # noqa: E402
from tests.e2e.server_process import ServerProcess, free_port  # noqa: E402


@dataclass
class SetupResult:
    """One set-up's figures; latencies in milliseconds."""

    name: str
    chat_itl_p50_ms: float
    chat_itl_p99_ms: float
    chat_ttft_p50_ms: float
    long_ttft_p50_ms: float
    long_ttft_max_ms: float
    output_tokens_per_s: float
    num_requests: int
    num_errors: int
    duration_s: float
    bytes_per_request: float | None = None
    """Mean over every transfer (chats and long prompts)."""
    bytes_per_token: float | None = None
    transfer_ms_per_1k_tokens: float | None = None
    pull_ms_per_request: float | None = None
    """From the pull sent to the K/V written: includes waiting for the prefill server's compute."""


def server_args(args: argparse.Namespace, threads: int) -> list[str]:
    return [args.model, "--dtype", args.dtype, "--num-threads", str(threads),
            "--max-total-tokens", str(args.max_total_tokens),
            *(["--disable-adaptive-threads"] if args.fixed_threads else []), *args.server_arg]


async def chat_stream(client: httpx.AsyncClient, url: str, model: str, prompts: Iterator[list[int]],
                      tokens: int, stop: asyncio.Event, timings: list[RequestTiming]) -> None:
    while not stop.is_set():
        timings.append(await one_request(client, url, {
            "model": model, "prompt": next(prompts), "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))


async def long_arrivals(client: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]],
                        tokens: int, interval_s: float) -> list[RequestTiming]:
    tasks = []
    for index, prompt in enumerate(prompts):
        if index:
            await asyncio.sleep(interval_s)
        tasks.append(asyncio.create_task(one_request(client, url, {
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})))
    return list(await asyncio.gather(*tasks))


async def workload(base_url: str, args: argparse.Namespace) -> tuple[list[RequestTiming],
                                                                     list[RequestTiming], float]:
    """(chat timings, long-prompt timings, wall seconds of the run)."""
    async with httpx.AsyncClient(timeout=args.request_timeout_s) as client:
        model, vocab_size = await server_facts(client, base_url)
        vocab_size = min(vocab_size, 30000)
        url = f"{base_url}/v1/completions"
        # warm-up: one request of each kind (connections, first-call costs), not measured
        await one_request(client, url, {"model": model, "prompt": [1, 2, 3], "max_tokens": 2})
        chat_prompts = iter(random_prompts(100_000 // args.chat_prompt_tokens + 1000,
                                           args.chat_prompt_tokens, vocab_size, seed=1))
        long_prompts = random_prompts(args.long_prompts, args.long_prompt_tokens, vocab_size, seed=2)
        stop = asyncio.Event()
        chats: list[RequestTiming] = []
        start_s = time.perf_counter()
        streams = [asyncio.create_task(chat_stream(client, url, model, chat_prompts, args.chat_tokens,
                                                   stop, chats)) for _ in range(args.chats)]
        await asyncio.sleep(args.warmup_s)
        longs = await long_arrivals(client, url, model, long_prompts, args.long_tokens,
                                    args.long_interval_s)
        stop.set()
        await asyncio.gather(*streams)
        return chats, longs, time.perf_counter() - start_s


def summarize(name: str, chats: list[RequestTiming], longs: list[RequestTiming],
              duration_s: float) -> SetupResult:
    ok = [t for t in chats + longs if t.error is None]
    gaps = [gap for t in chats if t.error is None for gap in t.chunk_gaps_s]
    chat_ttfts = [t.ttft_s for t in chats if t.ttft_s is not None]
    long_ttfts = [t.ttft_s for t in longs if t.ttft_s is not None]
    for timing in chats + longs:
        if timing.error is not None:
            print(f"[{name}] request failed: {timing.error}", file=sys.stderr)
    return SetupResult(
        name=name, chat_itl_p50_ms=1000 * percentile(gaps, 50), chat_itl_p99_ms=1000 * percentile(gaps, 99),
        chat_ttft_p50_ms=1000 * percentile(chat_ttfts, 50),
        long_ttft_p50_ms=1000 * percentile(long_ttfts, 50),
        long_ttft_max_ms=1000 * max(long_ttfts, default=float("nan")),
        output_tokens_per_s=sum(t.num_output_tokens for t in ok) / duration_s,
        num_requests=len(chats) + len(longs), num_errors=len(chats) + len(longs) - len(ok),
        duration_s=duration_s)


def server_info(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/get_server_info", timeout=30).json()


def run_colocated(args: argparse.Namespace) -> SetupResult:
    with ServerProcess(server_args(args, 2)) as server:
        chats, longs, duration_s = asyncio.run(workload(server.base_url, args))
    return summarize("co-located (1 server, 2 threads)", chats, longs, duration_s)


def run_disaggregated(args: argparse.Namespace) -> SetupResult:
    with ExitStack() as stack:
        bootstrap_port = free_port()
        prefill = stack.enter_context(ServerProcess([
            *server_args(args, 1), "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--disaggregation-transfer-backend", args.transfer_backend]))
        decode = stack.enter_context(ServerProcess([
            *server_args(args, 1), "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", args.transfer_backend]))
        router = stack.enter_context(RouterProcess([
            "--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap_port),
            "--decode", decode.base_url]))
        sent_before, received_before = server_info(prefill.base_url), server_info(decode.base_url)
        chats, longs, duration_s = asyncio.run(workload(router.base_url, args))
        sent, received = server_info(prefill.base_url), server_info(decode.base_url)
    result = summarize(f"disaggregated (prefill 1 + decode 1 thread, {args.transfer_backend})",
                       chats, longs, duration_s)

    def delta(info: dict[str, Any], before: dict[str, Any], key: str) -> float:
        return float(info.get(key, 0)) - float(before.get(key, 0))

    transfers = delta(received, received_before, "disaggregation_num_transfers")
    tokens = delta(sent, sent_before, "disaggregation_tokens_sent")
    copy_s = (delta(sent, sent_before, "disaggregation_send_time_s")
              + delta(received, received_before, "disaggregation_receive_time_s"))
    if transfers:
        result.bytes_per_request = delta(received, received_before, "disaggregation_bytes_received") / transfers
        result.pull_ms_per_request = 1000 * delta(received, received_before,
                                                  "disaggregation_pull_time_s") / transfers
    if tokens:
        result.bytes_per_token = delta(received, received_before, "disaggregation_bytes_received") / tokens
        result.transfer_ms_per_1k_tokens = 1000 * copy_s / tokens * 1000
    return result


def markdown(results: list[SetupResult], args: argparse.Namespace) -> str:
    def number(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"model {args.model} ({args.dtype}), {args.chats} chat streams "
             f"({args.chat_prompt_tokens} prompt / {args.chat_tokens} output tokens), "
             f"{args.long_prompts} long prompts of {args.long_prompt_tokens} tokens "
             f"({args.long_tokens} output) every {args.long_interval_s:g} s; "
             f"load average {os.getloadavg()[0]:.1f}",
             "",
             "| set-up | chat ITL p50 ms | chat ITL p99 ms | chat TTFT p50 ms | long TTFT p50 ms | "
             "long TTFT max ms | output tok/s | requests (errors) | K/V MiB / request (mean) | "
             "K/V MiB / long prompt | transfer ms / 1k tokens | pull ms / request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.name} | {r.chat_itl_p50_ms:.1f} | {r.chat_itl_p99_ms:.1f} | {r.chat_ttft_p50_ms:.0f} | "
            f"{r.long_ttft_p50_ms:.0f} | {r.long_ttft_max_ms:.0f} | {r.output_tokens_per_s:.1f} | "
            f"{r.num_requests} ({r.num_errors}) | "
            f"{number(None if r.bytes_per_request is None else r.bytes_per_request / 2 ** 20)} | "
            f"{number(None if r.bytes_per_token is None else r.bytes_per_token * args.long_prompt_tokens / 2 ** 20)} | "
            f"{number(r.transfer_ms_per_1k_tokens)} | {number(r.pull_ms_per_request, 0)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU")
    parser.add_argument("--chats", type=int, default=6, help="concurrent short-chat streams")
    parser.add_argument("--chat-prompt-tokens", type=int, default=32)
    parser.add_argument("--chat-tokens", type=int, default=64, help="output tokens per chat")
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-prompt-tokens", type=int, default=1536)
    parser.add_argument("--long-tokens", type=int, default=16, help="output tokens per long prompt")
    parser.add_argument("--long-interval-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=5.0,
                        help="chats decode this long before the first long prompt")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--transfer-backend", default="zmq", choices=("zmq", "shm", "nixl", "mooncake"))
    parser.add_argument("--fixed-threads", action="store_true",
                        help="--disable-adaptive-threads on every server (a quiet machine only: "
                        "a fixed 2-thread server beside busy cores crawls)")
    parser.add_argument("--setups", default="colocated,pd", help="comma-separated: colocated, pd")
    parser.add_argument("--request-timeout-s", type=float, default=900.0)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra flag for every server (repeat), e.g. --server-arg=--chunked-prefill-size=512")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    runners = {"colocated": run_colocated, "pd": run_disaggregated}
    results = []
    for name in args.setups.split(","):
        results.append(runners[name](args))
        print(f"{name} done: {results[-1]}", file=sys.stderr, flush=True)
    table = markdown(results, args)
    print(table + "\n\n(noisy unless the machine is otherwise idle)")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": [vars(r) for r in results]})


if __name__ == "__main__":
    main()
