"""Served time to first token of long prompts, one after another, from a fresh server: the first
long prompt after start-up (cold: what ``compare_peers.py``'s prefill column measures, after its
16-token warm-up) against the ones after it (each a new prompt, so nothing comes from the prefix
cache). Per prompt: TTFT, and the engine process's CPU seconds and minor page faults over it.

The server's own start-up warm-up (servelm.engine.warmup) is on unless ``--servelm-args
--skip-server-warmup`` is given; run both to see what it buys. One server at a time.

    .venv/bin/python benchmarks/served_ttft.py --num-threads 1
    .venv/bin/python benchmarks/served_ttft.py --num-threads 1 --servelm-args=--skip-server-warmup
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_peers as cp  # noqa: E402
from served_cpu import start_server  # noqa: E402

from servelm.bench_common import one_request  # noqa: E402


def engine_counters(server_pid: int) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of the server's children (the engine process), not the front end."""
    cpu_s, faults = 0.0, 0
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            times = child.cpu_times()
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
        cpu_s += times.user + times.system
        faults += int(fields[7])   # minflt: field 10 of /proc/PID/stat, 8th after the name
    return cpu_s, faults


async def run(base_url: str, model: str, server_pid: int, num_prompts: int, input_len: int) -> None:
    import httpx
    body = lambda prompt: {"model": model, "prompt": prompt, "max_tokens": 1,  # noqa: E731
                           "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, f"{base_url}/v1/completions", body(cp._prompts(1, 16, 9)[0]))
        rows = []
        for index, prompt in enumerate(cp._prompts(num_prompts, input_len, 2)):
            cpu_before, faults_before = engine_counters(server_pid)
            timing = await one_request(client, f"{base_url}/v1/completions", body(prompt))
            await asyncio.sleep(0.3)   # the engine goes idle (and trims its heap) as between users
            cpu_after, faults_after = engine_counters(server_pid)
            assert timing.ttft_s is not None, timing.error
            rows.append(timing.ttft_s)
            print(f"prompt {index}: TTFT {timing.ttft_s * 1e3:7.1f} ms, engine CPU "
                  f"{(cpu_after - cpu_before) * 1e3:7.1f} ms, minor faults {faults_after - faults_before}")
        later = statistics.median(rows[1:]) if len(rows) > 1 else float("nan")
        print(f"first {rows[0] * 1e3:.1f} ms, median of the rest {later * 1e3:.1f} ms, "
              f"ratio {rows[0] / later:.2f} (noisy, shared machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=cp.PREFILL_TOKENS)
    parser.add_argument("--port", type=int, default=18556)
    parser.add_argument("--log", type=Path, default=Path("/tmp/served_ttft.log"))
    parser.add_argument("--servelm-args", nargs="*", default=[], help="extra servelm flags")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    start_s = time.monotonic()
    server, base = start_server(args)
    try:
        cp.wait_ready(base, server, 600)
        print(f"ready after {time.monotonic() - start_s:.1f} s")
        asyncio.run(run(base, args.model, server.pid, args.prompts, args.input_len))
    finally:
        cp.stop_group(server, 30)


if __name__ == "__main__":
    main()
