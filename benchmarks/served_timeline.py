"""A timeline of one served N-stream leg (compare_peers' 32-stream column by default): when each
request is sent, reaches the front end and the engine, every engine step (its prefill and decode
rows, its time, the gap before the next one), each request's first token, and the CPU seconds of
the front end (per thread), the engine and the client.

The server is started by this script in ``--serve`` mode: ``servelm serve`` with two recording
hooks (the front end's sends, the engine process's steps and messages) that append JSON lines to
``--trace``; nothing in servelm changes. Timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC,
shared by the processes of one machine). One server at a time; it is stopped at the end.

    .venv/bin/python benchmarks/served_timeline.py --num-threads 2 --streams 32
    .venv/bin/python benchmarks/served_timeline.py --num-threads 2 --lone 10 --input-len 1019
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROFILE_ENV = "SERVED_TIMELINE_CPROFILE"
"""When set: cProfile the front end into this file (``--cprofile-front-end``)."""
TRACE_ENV = "SERVED_TIMELINE_TRACE"
"""The trace file the hooks append to (set by this script for the server it starts only)."""


def _record(**fields: Any) -> None:
    with open(os.environ[TRACE_ENV], "a") as trace:
        trace.write(json.dumps(fields) + "\n")


def traced_engine_process(*args: Any, **kwargs: Any) -> None:
    """The engine process's entry point with its steps and messages recorded."""
    from servelm.engine import engine_process
    from servelm.engine.engine import LLMEngine
    from servelm.engine.frontdoor import SubmitRequest
    from servelm.engine.scheduler import Scheduler

    import zmq

    schedule, step, handle = Scheduler.schedule, LLMEngine.step, engine_process._handle
    send_pyobj = zmq.Socket.send_pyobj
    last: dict[str, Any] = {"send_s": 0.0, "pickle_s": 0.0}

    def traced_send_pyobj(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        import pickle
        start_s = time.perf_counter()
        pickle.dumps(obj, -1)
        last["pickle_s"] += time.perf_counter() - start_s
        start_s = time.perf_counter()
        result = send_pyobj(self, obj, *args, **kwargs)
        last["send_s"] += time.perf_counter() - start_s
        return result

    def traced_schedule(self: Scheduler) -> Any:
        output = schedule(self)
        last["rows"] = [(s.request.request_id, s.num_tokens, s.is_sampling) for s in output.scheduled]
        last["num_waiting"] = len(self.waiting)
        return output

    def traced_step(self: LLMEngine) -> Any:
        start_s = time.perf_counter()
        last["rows"], send_s, last["send_s"] = [], last["send_s"], 0.0
        pickle_s, last["pickle_s"] = last["pickle_s"], 0.0
        outputs = step(self)
        rows = last["rows"]
        if rows:
            _record(kind="step", start_s=start_s, end_s=time.perf_counter(),
                    prefill_tokens=sum(n for _, n, _ in rows if n > 1),
                    num_prefill=sum(1 for _, n, _ in rows if n > 1),
                    num_decode=sum(1 for _, n, _ in rows if n == 1), num_outputs=len(outputs),
                    num_waiting=last["num_waiting"], send_before_ms=send_s * 1e3, pickle_before_ms=pickle_s * 1e3,
                    first_tokens=[rid for rid, n, sampling in rows if n > 1 and sampling])
        return outputs

    def traced_handle(engine: Any, message: Any, outputs: Any) -> None:
        is_add = isinstance(message, SubmitRequest)
        _record(kind="engine_add" if is_add else "engine_" + type(message).__name__, at_s=time.perf_counter(),
                request_id=message.request_id if is_add else None)
        handle(engine, message, outputs)

    Scheduler.schedule, LLMEngine.step, engine_process._handle = traced_schedule, traced_step, traced_handle
    zmq.Socket.send_pyobj = traced_send_pyobj  # type: ignore[method-assign]
    engine_process.run_engine_process(*args, **kwargs)


def serve(argv: list[str]) -> None:
    """``servelm serve ARGV`` with the front end's adds recorded and the engine process traced."""
    from servelm.cli import main
    from servelm.engine import async_engine, launch
    from servelm.engine.frontdoor import SubmitRequest

    send = async_engine.AsyncEngine._send

    def traced_send(self: Any, replica: Any, message: Any) -> None:
        start_s = time.perf_counter()
        send(self, replica, message)
        if isinstance(message, SubmitRequest):
            _record(kind="front_add", at_s=start_s, send_ms=(time.perf_counter() - start_s) * 1e3,
                    request_id=message.request_id)

    async_engine.AsyncEngine._send = traced_send  # type: ignore[method-assign]
    launch.ENGINE_ENTRY = f"{traced_engine_process.__module__}:{traced_engine_process.__name__}"
    profile = os.environ.get(PROFILE_ENV)
    if not profile:
        main(["serve", *argv])
        return
    import cProfile   # the front end's CPU by function (deterministic, unlike sampling at 2 ms steps)
    import signal
    profiler = cProfile.Profile()
    # uvicorn re-raises the SIGTERM it handled once it has shut down: exit through ``finally``
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        profiler.runcall(main, ["serve", *argv])
    finally:
        profiler.dump_stats(profile)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, by ``name/tid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def leg(base: str, model: str, streams: int, input_len: int, output_len: int,
              server_pid: int, trace: Path, profile: Path | None = None) -> None:
    import httpx
    import psutil

    import compare_peers as cp
    from served_cpu import process_cpu_s
    from servelm.bench_common import one_request

    body = lambda prompt: {"model": model, "prompt": prompt, "max_tokens": output_len,  # noqa: E731
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=None)) as client:
        await cp._stream(client, base, model, cp._prompts(streams, 16, 9), 8)   # warm-up
        await asyncio.sleep(0.5)
        trace.write_text("")
        sent: list[float] = []

        async def timed(prompt: list[int]) -> Any:
            sent.append(time.perf_counter())
            return await one_request(client, f"{base}/v1/completions", body(prompt))

        prompts = cp._prompts(streams, input_len, 3 if input_len == cp.STREAM_PROMPT_TOKENS else 2)
        spy = None
        if profile is not None:   # py-spy of the front end over the leg (folded stacks)
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server_pid),
                                    "-o", str(profile), "--format", "raw", "-r", "500", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.sleep(1.0)
        before, threads_before = process_cpu_s(server_pid), thread_cpu_s(server_pid)
        client_s, start_s = time.process_time(), time.perf_counter()
        timings = await asyncio.gather(*(timed(p) for p in prompts))
        wall_s = time.perf_counter() - start_s
        client_s = time.process_time() - client_s
        after, threads_after = process_cpu_s(server_pid), thread_cpu_s(server_pid)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
    report(trace, start_s, wall_s, sent, timings, output_len, streams)
    print(f"client CPU {client_s:.2f} s (this process: httpx + SSE parsing, shared with the server's cores)")
    names = {p.pid: p.name() for p in [psutil.Process(server_pid), *psutil.Process(server_pid).children(True)]}
    for name, seconds in after.items():
        print(f"  {name}: {seconds - before.get(name, 0.0):.2f} CPU s")
    print(f"front end ({names[server_pid]}) threads with CPU over the leg:")
    for name, seconds in sorted(threads_after.items(), key=lambda kv: -kv[1] + threads_before.get(kv[0], 0.0)):
        delta = seconds - threads_before.get(name, 0.0)
        if delta >= 0.01:
            print(f"    {name}: {delta:.2f} s")


async def lone_requests(base: str, model: str, count: int, input_len: int, trace: Path) -> None:
    """``count`` lone requests one after another (``input_len`` prompt tokens, 1 output token), each a
    new prompt: where a request's TTFT goes between the client, the front end and the engine."""
    import httpx

    import compare_peers as cp
    from servelm.bench_common import one_request

    body = lambda prompt: {"model": model, "prompt": prompt, "max_tokens": 1,  # noqa: E731
                           "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, f"{base}/v1/completions", body(cp._prompts(1, 16, 9)[0]))
        await asyncio.sleep(0.3)
        trace.write_text("")
        sent, ttfts = [], []
        for prompt in cp._prompts(count, input_len, 5):
            sent.append(time.perf_counter())
            timing = await one_request(client, f"{base}/v1/completions", body(prompt))
            assert timing.error is None, timing.error
            ttfts.append(timing.ttft_s or timing.latency_s)   # a token with no text yet: its final chunk
            await asyncio.sleep(0.05)
    events = [json.loads(line) for line in trace.read_text().splitlines() if line]
    front = [e for e in events if e["kind"] == "front_add"]
    engine = [e["at_s"] for e in events if e["kind"] == "engine_add"]
    steps = [e for e in events if e["kind"] == "step"]
    assert len(front) == len(engine) == count, (len(front), len(engine))
    # a request's steps: from the first after its add to the one before the next add (a prompt longer
    # than --chunked-prefill-size takes several)
    bounds = [*engine[1:], float("inf")]
    spans = []
    for added, until in zip(engine, bounds):
        own = [step for step in steps if added <= step["start_s"] < until]
        spans.append((own[0]["start_s"], own[-1]["end_s"], len(own)))
    median = lambda values: statistics.median(values) * 1e3  # noqa: E731
    print(f"{count} lone requests of {input_len} prompt tokens, 1 output token; medians in ms:")
    print(f"  client send -> front end sends the add   {median([f['at_s'] - s for f, s in zip(front, sent)]):7.2f}")
    print(f"  front end send -> engine receives        {median([e - f['at_s'] for f, e in zip(front, engine)]):7.2f}")
    print(f"  engine receives -> first step starts      {median([span[0] - e for e, span in zip(engine, spans)]):7.2f}")
    print(f"  the steps ({spans[0][2]}: prefill + first token)     {median([end - start for start, end, _ in spans]):7.2f}")
    print(f"  last step ends -> client has the token    "
          f"{median([s0 + t - span[1] for s0, t, span in zip(sent, ttfts, spans)]):7.2f}")
    print(f"  TTFT                                      {median(ttfts):7.2f}")


def report(trace: Path, start_s: float, wall_s: float, sent: list[float], timings: list[Any],
           output_len: int, streams: int) -> None:
    events = [json.loads(line) for line in trace.read_text().splitlines() if line]
    steps = [e for e in events if e["kind"] == "step" and e["start_s"] >= start_s - 0.01]
    adds_front = sorted(e["at_s"] for e in events if e["kind"] == "front_add")
    adds_engine = sorted(e["at_s"] for e in events if e["kind"] == "engine_add")
    rel = lambda t: (t - start_s) * 1e3  # noqa: E731
    tokens = sum(t.num_output_tokens or 0 for t in timings)
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    print(f"{streams} streams: {tokens / wall_s:.1f} tok/s, wall {wall_s * 1e3:.0f} ms, {len(steps)} steps")
    print(f"client sends: {rel(min(sent)):.1f}..{rel(max(sent)):.1f} ms; front end adds "
          f"{rel(adds_front[0]):.1f}..{rel(adds_front[-1]):.1f} ms; engine receives "
          f"{rel(adds_engine[0]):.1f}..{rel(adds_engine[-1]):.1f} ms")
    print(f"TTFT min {min(ttfts) * 1e3:.0f} ms, median {statistics.median(ttfts) * 1e3:.0f} ms, "
          f"max {max(ttfts) * 1e3:.0f} ms")
    print("step  start_ms  ms     prefill(reqs/tokens)  decode  waiting  gap_before_ms")
    previous_end = None
    prefill_steps, decode_ms = [], []
    for index, step in enumerate(steps):
        ms = (step["end_s"] - step["start_s"]) * 1e3
        gap = (step["start_s"] - previous_end) * 1e3 if previous_end is not None else 0.0
        previous_end = step["end_s"]
        if step["num_prefill"]:
            prefill_steps.append(step)
        elif step["num_decode"] == streams:
            decode_ms.append(ms)
        if step["num_prefill"] or index < 3 or index >= len(steps) - 2:
            print(f"{index:4d}  {rel(step['start_s']):8.1f}  {ms:6.1f}  {step['num_prefill']:4d}/{step['prefill_tokens']:5d}"
                  f"          {step['num_decode']:4d}    {step['num_waiting']:4d}    {gap:6.2f}")
    last_first = max((s["end_s"] for s in prefill_steps), default=start_s)
    gaps = [(b["start_s"] - a["end_s"]) * 1e3 for a, b in zip(steps, steps[1:])]
    print(f"{len(prefill_steps)} steps with prefill ({sum(s['prefill_tokens'] for s in prefill_steps)} tokens, "
          f"{sum((s['end_s'] - s['start_s']) for s in prefill_steps) * 1e3:.0f} ms); last prefill ends at "
          f"{rel(last_first):.0f} ms")
    if decode_ms:
        print(f"full decode steps ({streams} rows): {len(decode_ms)}, median {statistics.median(decode_ms):.1f} ms, "
              f"sum {sum(decode_ms):.0f} ms")
    if gaps:
        sends = [s.get("send_before_ms", 0.0) for s in steps[1:]]
        pickles = [s.get("pickle_before_ms", 0.0) for s in steps[1:]]
        print(f"  (a separate pickle.dumps of the same outputs: median {statistics.median(pickles):.3f} ms)")
        print(f"between steps: median {statistics.median(gaps):.2f} ms, sum {sum(gaps):.0f} ms, of which "
              f"sending outputs (pickle + zmq) median {statistics.median(sends):.2f} ms, sum {sum(sends):.0f} ms")
    in_steps = sum((s["end_s"] - s["start_s"]) for s in steps) * 1e3
    print(f"wall {wall_s * 1e3:.0f} ms = steps {in_steps:.0f} + gaps {sum(gaps):.0f} + before the first step "
          f"{rel(steps[0]['start_s']) if steps else 0:.0f} + after the last {wall_s * 1e3 - rel(steps[-1]['end_s']) if steps else 0:.0f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18557)
    parser.add_argument("--trace", type=Path, default=Path("/tmp/served_timeline.jsonl"))
    parser.add_argument("--log", type=Path, default=Path("/tmp/served_timeline.log"))
    parser.add_argument("--lone", type=int, default=0,
                        help="instead of the N-stream leg: this many lone requests (--input-len, 1 token) in a row")
    parser.add_argument("--cprofile-front-end", type=Path, help="cProfile the whole front end into this file")
    parser.add_argument("--profile-front-end", type=Path, help="py-spy the front end into this file (raw)")
    parser.add_argument("--servelm-args", default="", help="extra servelm flags, one string")
    args = parser.parse_args()
    import compare_peers as cp
    print(f"load average {os.getloadavg()[0]:.1f} (noisy, shared machine)")
    args.trace.write_text("")
    with args.log.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", args.model, "--host", "127.0.0.1", "--port", str(args.port),
             "--num-threads", str(args.num_threads), *args.servelm_args.split()],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, TRACE_ENV: str(args.trace),
                 **({PROFILE_ENV: str(args.cprofile_front_end)} if args.cprofile_front_end else {})}, cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{args.port}"
    try:
        cp.wait_ready(base, server, 600)
        if args.lone:
            asyncio.run(lone_requests(base, args.model, args.lone, args.input_len, args.trace))
            return
        asyncio.run(leg(base, args.model, args.streams, args.input_len, args.output_len, server.pid, args.trace,
                        args.profile_front_end))
    finally:
        cp.stop_group(server, 30)


if __name__ == "__main__":
    main()
