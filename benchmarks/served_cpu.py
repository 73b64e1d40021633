"""Where a served N-stream leg's CPU goes: compare_peers' N-stream leg (128-token prompts, 128
tokens out, streamed) against one servelm server, with the CPU seconds of each of its processes
(HTTP front end, engine), the client's, and the engine's step count; ``--in-process`` runs the same
prompts through ``LLMEngine.step()`` instead, for the same figures without the serving path.

CPU seconds hardly move with other processes' load (wall time does): with ``--num-threads 1`` the
engine's CPU seconds served vs in-process is the serving path's cost. One server at a time.

    .venv/bin/python benchmarks/served_cpu.py --num-threads 1 --streams 32
    .venv/bin/python benchmarks/served_cpu.py --num-threads 1 --streams 32 --in-process
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_peers as cp  # noqa: E402

OUTPUT_LEN = 128


def process_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process and its children, by ``pid:name``."""
    root = psutil.Process(pid)
    out = {}
    for process in [root, *root.children(recursive=True)]:
        times = process.cpu_times()
        out[f"{process.pid}:{process.name()}"] = times.user + times.system
    return out


async def served_leg(base: str, model: str, streams: int, pid: int) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=None)) as client:
        await cp._stream(client, base, model, cp._prompts(streams, 16, 9), 8)   # warm-up
        steps = (await client.get(base + "/get_server_info")).json().get("num_steps", 0)
        before, client_s = process_cpu_s(pid), time.process_time()
        wall, timings = await cp._stream(client, base, model, cp._prompts(streams, 128, 3), OUTPUT_LEN)
        after, client_s = process_cpu_s(pid), time.process_time() - client_s
        steps = (await client.get(base + "/get_server_info")).json().get("num_steps", 0) - steps
    tokens = cp._tokens(timings, OUTPUT_LEN)
    print(f"served {streams} streams: {tokens / wall:.1f} tok/s, wall {wall:.2f} s, {steps} engine steps, "
          f"TTFT max {max(t.ttft_s for t in timings):.2f} s, client CPU {client_s:.2f} s")
    for name, seconds in after.items():
        print(f"  {name}: {seconds - before.get(name, 0.0):.2f} CPU s")


def in_process_leg(model: str, streams: int, num_threads: int | None) -> None:
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams
    flat: dict[str, object] = {"model": model}
    if num_threads is not None:
        flat["num_threads"] = num_threads
    engine = LLMEngine(EngineConfig.from_flat(flat))

    def leg(prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[int, float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            assert engine.add_request(f"{tag}{index}", prompt, params) is None
        steps, wall, cpu = 0, time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return steps, time.perf_counter() - wall, time.process_time() - cpu

    leg(cp._prompts(streams, 16, 9), 8, "warm")
    steps, wall, cpu = leg(cp._prompts(streams, 128, 3), OUTPUT_LEN, "leg")
    print(f"in-process {streams} streams: {streams * OUTPUT_LEN / wall:.1f} tok/s, wall {wall:.2f} s, "
          f"{steps} engine steps, engine CPU {cpu:.2f} s")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    """``servelm serve`` of ``args.model`` on 127.0.0.1:``args.port`` (``--num-threads``, extra
    ``--servelm-args``), its output in ``args.log``, in its own process group; (process, base URL)."""
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads is not None else []
    with args.log.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "servelm", "serve", args.model, "--host", "127.0.0.1",
             "--port", str(args.port), *threads, *args.servelm_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parents[1])
    return server, f"http://127.0.0.1:{args.port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--port", type=int, default=18555)
    parser.add_argument("--log", type=Path, default=Path("/tmp/served_cpu.log"))
    parser.add_argument("--servelm-args", nargs="*", default=[], help="extra servelm flags")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} (shared machine: compare CPU seconds)")
    if args.in_process:
        in_process_leg(args.model, args.streams, args.num_threads)
        return
    server, base = start_server(args)
    try:
        cp.wait_ready(base, server, 600)
        asyncio.run(served_leg(base, args.model, args.streams, server.pid))
    finally:
        cp.stop_group(server, 30)


if __name__ == "__main__":
    main()
