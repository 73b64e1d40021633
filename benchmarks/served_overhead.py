"""Where a served one-stream token's time goes beyond the engine step: the openai client streaming
one completion (greedy, ``--output-len`` tokens, compare_peers' 16-token one-stream prompt) against
the same engine's steps, served and in-process, for one or more source trees alternated.

Per round and tree it prints:
- ``client ms/tok``: (last text chunk - first) / (chunks - 1) as the openai client sees them;
- ``step ms``: the served engine's median ``LLMEngine.step`` (a hook of this script's ``--serve``), and
  ``gap ms``: its median time between two steps (sending the outputs, polling the socket);
- ``in-proc ms``: the median step of the same request through ``LLMEngine.step()`` in a process
  of its own with the same threads (no front end, no client);
- CPU ms per token of the front end, the engine and the client, and the engine's and front end's
  threads that ran during the stream (``--threads-detail``).

The difference ``client - in-proc`` is the served path's cost per token; ``step - in-proc`` is the
part of it paid inside the engine's step (a core taken from the forward by the front end and the
client: on 2 cores every thread competes with the model's two). Trees run with
``PYTHONPATH=<tree>`` (this script's hooks, that tree's servelm); alternate them on a shared
machine and compare medians. A tree may carry environment variables for its processes
(``TREE:NAME=VALUE,NAME=VALUE``, e.g. ``.:OMP_WAIT_POLICY=PASSIVE``). ``--py-spy DIR`` records both server processes over one stream
(native frames, idle included) into DIR.

    .venv/bin/python benchmarks/served_overhead.py --trees '/tmp/base;.' --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_peers as cp  # noqa: E402
from served_timeline import thread_cpu_s  # noqa: E402

IN_PROCESS = r"""
import json, statistics, sys, time
from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
model, threads, output_len, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
engine = LLMEngine(EngineConfig.from_flat({"model": model, "num_threads": threads}))
def run(tokens):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(str(time.monotonic_ns()), prompt, params)
    times, texts = [], []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        texts += [o.new_text for o in outputs]
    return times, "".join(texts)
run(8)
times, text = run(output_len)
print(json.dumps({"step_ms": 1e3 * statistics.median(times[1:]), "text": text}))
"""


TRACE_ENV = "SERVED_OVERHEAD_TRACE"
"""The file the served engine appends its steps to (``--serve`` mode)."""


def traced_engine_process(*args: object, **kwargs: object) -> None:
    """The engine process's entry point with each step's start and end appended to the trace."""
    from servelm.engine import engine_process
    from servelm.engine.engine import LLMEngine

    step = LLMEngine.step
    trace = open(os.environ[TRACE_ENV], "a", buffering=1)

    def traced_step(self: LLMEngine) -> object:
        start_s = time.perf_counter()
        outputs = step(self)
        if outputs:
            trace.write(f"{start_s} {time.perf_counter()}\n")
        return outputs

    LLMEngine.step = traced_step  # type: ignore[method-assign]
    engine_process.run_engine_process(*args, **kwargs)  # type: ignore[arg-type]


def serve(argv: list[str]) -> None:
    """``servelm serve ARGV`` with the engine's steps traced."""
    from servelm.cli import main
    from servelm.engine import launch

    launch.ENGINE_ENTRY = f"{traced_engine_process.__module__}:{traced_engine_process.__name__}"
    main(["serve", *argv])


def parse_tree(spec: str) -> tuple[str, Path, dict[str, str]]:
    """``TREE[:NAME=VALUE,...]`` -> (label, tree, environment)."""
    path, _, assignments = spec.partition(":")
    env = dict(item.split("=", 1) for item in assignments.split(",") if item)
    tree = Path(path).resolve()
    return tree.name + "".join(f" {k}={v}" for k, v in env.items()), tree, env


def in_process(tree: Path, env: dict[str, str], model: str, threads: int, output_len: int,
               prompt: list[int]) -> dict:
    result = subprocess.run([sys.executable, "-c", IN_PROCESS, model, str(threads), str(output_len),
                             json.dumps(prompt)], env={**os.environ, **env, "PYTHONPATH": str(tree)}, cwd=tree,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


class Server:
    """One ``servelm serve`` of ``tree`` with served_timeline's step trace."""

    def __init__(self, tree: Path, env: dict[str, str], model: str, threads: int, port: int, extra: list[str],
                 log: Path, trace: Path) -> None:
        self.base, self.trace = f"http://127.0.0.1:{port}", trace
        trace.write_text("")
        self.log = log.open("w")
        env = {**os.environ, **env, "PYTHONPATH": str(tree), TRACE_ENV: str(trace)}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", model, "--host",
             "127.0.0.1", "--port", str(port), "--num-threads", str(threads), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tree)
        cp.wait_ready(self.base, self.process, 900)
        import psutil
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.engine_pid = max(children, key=lambda child: child.memory_info().rss).pid  # the model's owner

    def close(self) -> None:
        cp.stop_group(self.process, 30)
        self.log.close()


def stream(server: Server, model: str, prompt: list[int], output_len: int, spy: Path | None) -> dict:
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)

    def one(tokens: int) -> tuple[list[float], str]:
        chunks, text = [], []
        response = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True})
        for chunk in response:
            if chunk.choices and chunk.choices[0].text:
                chunks.append(time.perf_counter())
                text.append(chunk.choices[0].text)
        return chunks, "".join(text)

    one(8)
    time.sleep(0.3)
    server.trace.write_text("")
    spies = []
    if spy is not None:
        spy.mkdir(parents=True, exist_ok=True)
        for name, pid in (("front_end", server.process.pid), ("engine", server.engine_pid)):
            spies.append(subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--idle", "-r", "200",
                 "-p", str(pid), "-o", str(spy / f"{name}.txt"), "--format", "raw", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
    pids = {"front end": server.process.pid, "engine": server.engine_pid}
    before = {name: thread_cpu_s(pid) for name, pid in pids.items()}
    client_s = time.process_time()
    chunks, text = one(output_len)
    client_s = time.process_time() - client_s
    after = {name: thread_cpu_s(pid) for name, pid in pids.items()}
    for process in spies:
        process.send_signal(2)
        process.wait(60)
    steps = [tuple(map(float, line.split())) for line in server.trace.read_text().splitlines() if line]
    steps = [(start, end) for start, end in steps if chunks[0] <= start <= chunks[-1]]
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    num_tokens = len(chunks)
    per_token = lambda seconds: 1e3 * seconds / num_tokens  # noqa: E731
    threads = {name: {thread: after[name][thread] - before[name].get(thread, 0.0) for thread in after[name]}
               for name in pids}
    return {"client_ms": 1e3 * (chunks[-1] - chunks[0]) / (num_tokens - 1),
            "step_ms": 1e3 * statistics.median(end - start for start, end in steps),
            "gap_ms": 1e3 * statistics.median(gaps), "num_chunks": num_tokens, "text": text,
            "front_cpu_ms": per_token(sum(threads["front end"].values())),
            "engine_cpu_ms": per_token(sum(threads["engine"].values())),
            "client_cpu_ms": per_token(client_s),
            "threads": {name: {t: round(s, 2) for t, s in values.items() if s > 0} for name, values in threads.items()},
            "num_threads": {name: len(after[name]) for name in pids}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=".", help="source trees (TREE[:NAME=VALUE,...]) separated by ';', "
                        "alternated")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams-per-round", type=int, default=2, help="streams per server start")
    parser.add_argument("--port", type=int, default=18571)
    parser.add_argument("--servelm-args", default="", help="extra servelm flags, one string (every tree)")
    parser.add_argument("--no-in-process", action="store_true")
    parser.add_argument("--threads-detail", action="store_true")
    parser.add_argument("--py-spy", type=Path, help="record both server processes over the first stream")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/served_overhead"))
    args = parser.parse_args()
    trees = [parse_tree(spec) for spec in args.trees.split(";")]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    prompt = cp._prompts(1, 16, 1)[0]
    print(f"# {args.model}, {args.num_threads} threads, {args.output_len} tokens, openai client; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| round | tree | client ms/tok | step ms | gap ms | in-proc ms | front CPU ms/tok | engine CPU ms/tok | "
          "client CPU ms/tok | threads (front, engine) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[dict]] = {label: [] for label, _, _ in trees}
    texts: set[str] = set()
    for round_index in range(args.rounds):
        for tree_index, (name, tree, env) in enumerate(trees):
            server = Server(tree, env, args.model, args.num_threads, args.port, args.servelm_args.split(),
                            args.log_dir / f"{tree_index}.log", args.log_dir / f"{tree_index}.trace")
            try:
                for stream_index in range(args.streams_per_round):
                    spy = args.py_spy / str(tree_index) if args.py_spy and round_index == 0 and stream_index == 0 else None
                    row = stream(server, args.model, prompt, args.output_len, spy)
                    results[name].append(row)
                    texts.add(row["text"])
                    print(f"| {round_index} | {name} | {row['client_ms']:.2f} | {row['step_ms']:.2f} | "
                          f"{row['gap_ms']:.2f} | | {row['front_cpu_ms']:.2f} | {row['engine_cpu_ms']:.2f} | "
                          f"{row['client_cpu_ms']:.2f} | {row['num_threads']['front end']}, "
                          f"{row['num_threads']['engine']} | {os.getloadavg()[0]:.1f} |", flush=True)
                    if args.threads_detail:
                        print(f"    threads with CPU s: {row['threads']}")
            finally:
                server.close()
            if not args.no_in_process:
                row = in_process(tree, env, args.model, args.num_threads, args.output_len, prompt)
                texts.add(row["text"])
                results[name].append({"in_proc_ms": row["step_ms"]})
                print(f"| {round_index} | {name} | | | | {row['step_ms']:.2f} | | | | | {os.getloadavg()[0]:.1f} |",
                      flush=True)
    print("medians:")
    for name, _, _ in trees:
        rows = results[name]
        line = []
        for key in ("client_ms", "step_ms", "gap_ms", "in_proc_ms", "front_cpu_ms", "engine_cpu_ms", "client_cpu_ms"):
            values = [row[key] for row in rows if key in row]
            if values:
                line.append(f"{key} {statistics.median(values):.2f}")
        print(f"  {name}: " + ", ".join(line))
    print(f"distinct completion texts over all runs: {len(texts)} (1 = outputs unchanged)")


if __name__ == "__main__":
    main()
