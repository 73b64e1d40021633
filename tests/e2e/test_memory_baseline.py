"""Each server process's memory comes back to its warmed-up baseline after hostile traffic
(issue 19's "memory back to baseline").

A first round of normal users beside hostile clients (256-sequence fan-outs, hostile schemas,
request chat templates with loops and memory bombs, lone surrogates, oversized bodies, info
polling) warms the server up: the engine sees the batch sizes a mixed load makes and its bounded
per-shape caches fill (oneDNN's primitives and torch's ideep matmul cache, 64 each by default).
A worker sending fan-outs of random sizes makes a new batch size nearly every step. Two
more rounds of the same mix follow; after each, once the server is idle again, every
process's anonymous memory (RssAnon: heap and caches, not the weights' file pages) must be back
within ``TOLERANCE_MIB`` of its own baseline. Before the ideep cache was bounded, the engine grew
~1 MiB per new batch size and a round like these added tens of MiB that never came back.

About 3 minutes on 2 shared cores (the server's start is most of it); ``-m slow``.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import psutil
import pytest

from .server_process import ServerProcess
from .test_load_hostile import ARGS, EXPECTED, Tally, hostile, normal_user

ROUND_S = 25.0
IDLE_S = 10.0
"""Wait after a round: slow sockets time out (5 s), the engine goes idle and trims its heap."""
TOLERANCE_MIB = {"front end": 16, "engine": 12}
"""Most a process's RssAnon may sit above its warmed-up baseline after a round (measured: see
benchmarks/RESULTS.md, issue 19; a 256-sequence round's allocator noise is a few MiB)."""
WORKER_KINDS = (("fanout",), ("schema", "template", "bomb"),
                ("surrogate", "surrogate_chat", "oversized", "info", "slow_sockets"))
"""One hostile worker per group, so every round has fan-outs however slow the machine is."""


async def varied_batches(client: httpx.AsyncClient, deadline: float, tally: Tally) -> None:
    """Completions of 1-16 prompts of random length x n of 1-4: a new batch size nearly every
    step, which is what grew the per-shape caches."""
    rng = random.Random(7)
    while time.monotonic() < deadline:
        prompts = [" ".join(["word"] * rng.randint(1, 60)) for _ in range(rng.randint(1, 16))]
        response = await client.post("/v1/completions", json={
            "model": "smollm2-135m", "prompt": prompts, "n": rng.randint(1, 4),
            "max_tokens": rng.randint(2, 16), "temperature": 1.0, "ignore_eos": True})
        tally.add("varied", response.status_code)


def _anon_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) >> 10 for line in status if line.startswith("RssAnon:"))


def _processes(pid: int) -> dict[str, int]:
    """The server's long-lived processes: the front end and its engine (the first spawned child;
    the template worker, a later one, is restarted after every killed render)."""
    spawned = [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]
    engine = min(spawned, key=lambda c: c.create_time())
    return {"front end": pid, "engine": engine.pid}


def _round(server: ServerProcess) -> Tally:
    async def run() -> Tally:
        tally = Tally()
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
            deadline = time.monotonic() + ROUND_S
            await asyncio.gather(
                *(normal_user(client, u, deadline, tally, [], []) for u in range(2)),
                varied_batches(client, deadline, tally),
                *(hostile(client, server.base_url, server.port, deadline, tally, w, kinds)
                  for w, kinds in enumerate(WORKER_KINDS)))
        return tally

    tally = asyncio.run(run())
    time.sleep(IDLE_S)
    return tally


@pytest.mark.slow
def test_each_process_returns_to_its_warmed_up_memory():
    with ServerProcess(ARGS) as server:
        processes = _processes(server.process.pid)
        start = {name: _anon_mib(pid) for name, pid in processes.items()}
        tallies = [_round(server)]  # the warm-up
        baseline = {name: _anon_mib(pid) for name, pid in processes.items()}
        after = []
        for _ in range(2):
            tallies.append(_round(server))
            after.append({name: _anon_mib(pid) for name, pid in processes.items()})
        assert server.process.poll() is None, "the server exited"
        print(f"\nRssAnon MiB: start {start}, warmed up {baseline}, after rounds {after}")
        for tally in tallies:
            print("statuses:", {kind: dict(counts) for kind, counts in tally.statuses.items()})
            assert not tally.errors, tally.errors[:10]
            for kind, counts in tally.statuses.items():
                assert set(counts) <= EXPECTED.get(kind, {200}), (kind, counts)
            assert tally.statuses["fanout"], "no fan-out completed: the round tested nothing"
        for name, limit in TOLERANCE_MIB.items():
            for memory in after:
                assert memory[name] - baseline[name] <= limit, (name, baseline, after)
