"""What `servelm router` adds to a request: the same requests direct and through the router.

Starts one servelm server (1 thread) and a router in front of it (or uses --worker-url and
--router-url), then alternates direct and routed requests so a change in the machine's load hits
both: ``GET /v1/models`` (no engine work: pure proxy cost), non-streaming ``/v1/completions``
with ``max_tokens=1`` and ``=16``, and the time to first byte of a streaming one. Prints median
and p90 per kind, and the router's extra milliseconds (median routed - median direct).

    .venv/bin/python benchmarks/router_overhead.py --model smollm2-135m --repeats 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.router_process import RouterProcess  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402


def timed(client: httpx.Client, base_url: str, kind: str, model: str) -> float:
    started = time.perf_counter()
    if kind == "models":
        assert client.get(f"{base_url}/v1/models").status_code == 200
    elif kind.startswith("completion"):
        tokens = int(kind.split("-")[1])
        response = client.post(f"{base_url}/v1/completions", json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
    else:  # ttfb of a stream
        with client.stream("POST", f"{base_url}/v1/completions", json={
                "model": model, "prompt": "The quick brown fox", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            chunks = response.iter_raw()
            next(chunks)
            elapsed = time.perf_counter() - started
            for _ in chunks:
                pass
            return elapsed
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--worker-url")
    parser.add_argument("--router-url")
    parser.add_argument("--kinds", default="models,completion-1,completion-8,stream-ttfb",
                        help="comma-separated: models, completion-N (max_tokens N), stream-ttfb")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    with ExitStack() as stack:
        worker_url, router_url = args.worker_url, args.router_url
        if worker_url is None:
            worker_url = stack.enter_context(ServerProcess([
                args.model, "--dtype", "float32", "--num-threads", "1"])).base_url
        if router_url is None:
            router_url = stack.enter_context(RouterProcess(["--worker", worker_url])).base_url
        client = stack.enter_context(httpx.Client(timeout=300))
        for kind in kinds:  # warm-up: connections, caches
            for url in (worker_url, router_url):
                timed(client, url, kind, args.model)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for kind in kinds:
                for name, url in (("direct", worker_url), ("router", router_url)):
                    times.setdefault((kind, name), []).append(timed(client, url, kind, args.model))
        load = os.getloadavg()[0]
    print(f"{'request':<16}{'direct ms (p50/p90)':>22}{'router ms (p50/p90)':>22}{'added ms':>10}")
    for kind in kinds:
        direct, routed = times[(kind, "direct")], times[(kind, "router")]

        def p(values: list[float], q: float) -> float:
            return sorted(values)[int(q * (len(values) - 1))] * 1000

        print(f"{kind:<16}{p(direct, .5):>11.2f} / {p(direct, .9):<8.2f}{p(routed, .5):>11.2f} / "
              f"{p(routed, .9):<8.2f}{statistics.median(routed) * 1000 - statistics.median(direct) * 1000:>10.2f}")
    print(f"repeats {args.repeats}, load average {load:.1f} (noisy, shared machine)")


if __name__ == "__main__":
    main()
