"""Heavy-but-legal requests beside normal users (issue 35, part 1).

Against a live server (started here, or ``--base-url``):

1. The prompt of n copies is computed once: one completion with a long prompt, ``echo`` and
   ``logprobs: 5``, timed with n=1 and n=8 on the idle server, and as 8 separate n=1 requests at
   once (what n=8 cost before), with the engine's prefill-token counter (``num_prefill_tokens`` of
   /get_server_info) over each.
2. Fairness: normal users (short streamed completions, one after another) run alone (half before,
   half after; the figures pooled, as a shared machine's load drifts), and beside heavy requests (a long prompt with echo logprobs and n=8, n=64 with a long output,
   a wide beam, a prompt at the context length); their p50/p99 time to first token and latency
   in both phases, the ratio, and every request's status (none may fail).

    .venv/bin/python benchmarks/heavy_fairness.py                       # starts smollm2-135m
    .venv/bin/python benchmarks/heavy_fairness.py --base-url http://127.0.0.1:30000

The slow test tests/e2e/test_fairness_live.py runs ``measure`` and holds it to its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench_common import one_request, percentile  # noqa: E402

MODEL = "smollm2-135m"
CONTEXT_LENGTH = 4096
SERVER_ARGS = [MODEL, "--context-length", str(CONTEXT_LENGTH)]
NORMAL_MAX_TOKENS = 16
NUM_NORMAL_USERS = 2
ECHO_PROMPT_TOKENS = 1500
TOKEN_RANGE = (1000, 40000)
"""Prompt token ids are drawn here (ordinary word pieces of SmolLM2's 49,152)."""


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def heavy_bodies(model: str, context_length: int, scale: int = 1) -> dict[str, dict[str, Any]]:
    """One of each heavy-but-legal kind (all within the server's default limits); ``scale`` 2
    halves the copies, the beam width and the outputs (a loaded machine)."""
    return {
        "echo_logprobs_n8": {"model": model, "prompt": token_prompt(ECHO_PROMPT_TOKENS, 1), "echo": True,
                             "logprobs": 5, "n": 8, "max_tokens": 8, "temperature": 1.0, "seed": 1},
        "large_n": {"model": model, "prompt": token_prompt(32, 2), "n": 64 // scale,
                    "max_tokens": 64 // scale, "temperature": 1.0, "seed": 2, "ignore_eos": True},
        "wide_beam": {"model": model, "prompt": token_prompt(32, 3), "use_beam_search": True,
                      "best_of": 16 // scale, "n": 4, "max_tokens": 32 // scale, "temperature": 0.0},
        "longest_context": {"model": model, "prompt": token_prompt(context_length - 17, 4),
                            "max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    slowest: list[tuple[float, float, float]] = field(default_factory=list)
    """(latency, time to first token, start offset in the phase) of each request: the worst are reported."""
    start_s: float = field(default_factory=time.perf_counter)

    def summary(self) -> dict[str, Any]:
        worst = sorted(self.slowest, reverse=True)[:3]
        return {"requests": len(self.latency_s), "errors": len(self.errors),
                "worst_latency_ttft_start_s": [[round(v, 2) for v in row] for row in worst],
                "ttft_p50_s": round(percentile(self.ttft_s, 50), 3),
                "ttft_p99_s": round(percentile(self.ttft_s, 99), 3),
                "latency_p50_s": round(percentile(self.latency_s, 50), 3),
                "latency_p99_s": round(percentile(self.latency_s, 99), 3)}


async def normal_user(client: httpx.AsyncClient, base_url: str, model: str, user: int,
                      stop: asyncio.Event, phase: Phase) -> None:
    rng = random.Random(user)
    while not stop.is_set():
        body = {"model": model, "prompt": f"Tell me a short story about the number {rng.randint(1, 999)}.",
                "max_tokens": NORMAL_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        started = time.perf_counter() - phase.start_s
        timing = await one_request(client, f"{base_url}/v1/completions", body)
        if timing.error is not None:
            phase.errors.append(timing.error)
            continue
        phase.latency_s.append(timing.latency_s)
        phase.ttft_s.append(timing.ttft_s if timing.ttft_s is not None else timing.latency_s)
        phase.slowest.append((timing.latency_s, phase.ttft_s[-1], started))


async def prefill_tokens(client: httpx.AsyncClient, base_url: str) -> int:
    info = (await client.get(f"{base_url}/get_server_info")).json()
    return int(info.get("num_prefill_tokens", -1))


async def timed_post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body)
        status, detail = response.status_code, ("" if response.status_code == 200 else response.text[:300])
    except Exception as error:  # counted, not fatal
        status, detail = -1, f"{type(error).__name__}: {error}"
    return {"status": status, "seconds": round(time.perf_counter() - start, 2), "detail": detail}


async def shared_prompt(client: httpx.AsyncClient, base_url: str, model: str,
                        with_separate: bool = True) -> dict[str, Any]:
    """The echo-logprobs request with n=1 and n=8 on the idle server (each its own prompt)."""
    result = {}
    for n, seed in ((1, 11), (8, 12)):
        body = {"model": model, "prompt": token_prompt(ECHO_PROMPT_TOKENS, seed), "echo": True,
                "logprobs": 5, "n": n, "max_tokens": 4, "temperature": 1.0, "seed": 5}
        before = await prefill_tokens(client, base_url)
        timed = await timed_post(client, f"{base_url}/v1/completions", body)
        timed["prefill_tokens"] = await prefill_tokens(client, base_url) - before
        result[f"n={n}"] = timed
    if not with_separate:
        return result
    # What n=8 cost before its copies shared the prompt: 8 requests of one copy each, at once.
    body = {"model": model, "prompt": token_prompt(ECHO_PROMPT_TOKENS, 13), "echo": True,
            "logprobs": 5, "n": 1, "max_tokens": 4, "temperature": 1.0}
    before = await prefill_tokens(client, base_url)
    start = time.perf_counter()
    separate = await asyncio.gather(*(timed_post(client, f"{base_url}/v1/completions", {**body, "seed": seed})
                                      for seed in range(8)))
    failed = [r["status"] for r in separate if r["status"] != 200]
    result["8 x n=1 at once"] = {"status": failed[0] if failed else 200,
                                 "seconds": round(time.perf_counter() - start, 2),
                                 "prefill_tokens": await prefill_tokens(client, base_url) - before}
    return result


async def measure(base_url: str, alone_s: float = 30.0, heavy_timeout_s: float = 400.0,
                  model: str = MODEL, context_length: int = CONTEXT_LENGTH,
                  with_shared_prompt: bool = True, with_separate: bool = True,
                  scale: int = 1) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(heavy_timeout_s + 60)) as client:
        report: dict[str, Any] = {}
        if with_shared_prompt:
            report["shared_prompt"] = await shared_prompt(client, base_url, model, with_separate)
            print(json.dumps(report["shared_prompt"]), file=sys.stderr, flush=True)
        alone = Phase()  # before and after the heavy phase: the shared machine's load drifts
        for phase_name in ("alone_before", "beside_heavy", "alone_after"):
            phase = alone if phase_name.startswith("alone") else Phase()
            stop = asyncio.Event()
            users = [asyncio.create_task(normal_user(client, base_url, model, user, stop, phase))
                     for user in range(NUM_NORMAL_USERS)]
            start = time.perf_counter()
            if phase_name.startswith("alone"):
                await asyncio.sleep(alone_s / 2)
            else:
                bodies = heavy_bodies(model, context_length, scale)
                await asyncio.sleep(0.5)
                tasks = [asyncio.create_task(timed_post(client, f"{base_url}/v1/completions", body))
                         for body in bodies.values()]
                await asyncio.wait(tasks, timeout=heavy_timeout_s)
                report["heavy"] = {}
                for name, task in zip(bodies, tasks):
                    if task.done():
                        report["heavy"][name] = task.result()
                    else:  # not failed: still running when the phase ended (a loaded machine)
                        task.cancel()
                        report["heavy"][name] = {"status": "unfinished", "seconds": heavy_timeout_s}
            stop.set()
            await asyncio.gather(*users)
            if phase_name != "alone_before":
                name = "alone" if phase is alone else phase_name
                report[name] = {**phase.summary(), "error_samples": phase.errors[:3]}
            report.setdefault("phase_seconds", {})[phase_name] = round(time.perf_counter() - start, 1)
            print(phase_name, json.dumps(report.get("heavy") if phase_name == "beside_heavy" else None),
                  json.dumps(phase.summary()), file=sys.stderr, flush=True)
        alone, beside = report["alone"], report["beside_heavy"]
        report["p99_latency_ratio"] = round(beside["latency_p99_s"] / alone["latency_p99_s"], 2)
        report["p99_ttft_ratio"] = round(beside["ttft_p99_s"] / alone["ttft_p99_s"], 2)
        report["p50_latency_ratio"] = round(beside["latency_p50_s"] / alone["latency_p50_s"], 2)
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start smollm2-135m)")
    parser.add_argument("--alone-s", type=float, default=30.0)
    parser.add_argument("--context-length", type=int, default=CONTEXT_LENGTH)
    parser.add_argument("--heavy-timeout-s", type=float, default=400.0,
                        help="end the heavy phase after this long (unfinished heavy requests are "
                             "reported as such and cancelled)")
    parser.add_argument("--no-shared-prompt", action="store_true", help="skip part 1 (n=1 vs n=8)")
    parser.add_argument("--quick", action="store_true",
                        help="a loaded machine: no 8 x n=1 comparison, half the copies, beam width and "
                             "outputs, no server warm-up")
    parser.add_argument("--servelm-args", default="", help="extra server arguments, space separated")
    args = parser.parse_args()
    options = dict(alone_s=args.alone_s, context_length=args.context_length,
                   heavy_timeout_s=args.heavy_timeout_s, with_shared_prompt=not args.no_shared_prompt,
                   with_separate=not args.quick, scale=2 if args.quick else 1)
    if args.base_url is not None:
        print(json.dumps(asyncio.run(measure(args.base_url, **options)), indent=2))
        return
    from tests.e2e.server_process import ServerProcess

    server_args = [MODEL, "--context-length", str(args.context_length), *args.servelm_args.split()]
    if args.quick:
        server_args.append("--skip-server-warmup")
    with ServerProcess(server_args) as server:
        print(json.dumps(asyncio.run(measure(server.base_url, **options)), indent=2))


if __name__ == "__main__":
    main()
