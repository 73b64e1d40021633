"""Pipeline-parallel cost on one host: the stage-to-stage hand-off and whole decode steps.

Part 1 times one hand-off of a step's hidden states (gloo point-to-point between two pinned rank
processes: a ping-pong, halved) for a decode step of 1 and of 32 streams. Part 2 times decode steps
of the engine at --pp-size 1 and 2 (greedy, ``--num-threads 1`` per rank), with the default
micro-batches (2 per step) and with one micro-batch per step (no overlap between the stages).

    python benchmarks/pp_comm.py                       # Qwen2.5-Coder-0.5B (hidden 896, 24 layers)
    python benchmarks/pp_comm.py --model smollm2-135m --hidden 576
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def p2p_rank(rank: int, port: int, hidden: int) -> None:
    os.sched_setaffinity(0, [rank % os.cpu_count()])  # type: ignore[operator]
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)  # type: ignore[attr-defined]
    peer = 1 - rank
    for rows in (1, 32):
        tensor = torch.randn(rows, hidden)

        def ping_pong() -> None:
            if rank == 0:
                group.send([tensor], peer, 0).wait()
                group.recv([tensor], peer, 0).wait()
            else:
                group.recv([tensor], peer, 0).wait()
                group.send([tensor], peer, 0).wait()

        for _ in range(100):
            ping_pong()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                ping_pong()
            samples.append((time.perf_counter() - start) / 200 / 2 * 1e6)
        if rank == 0:
            print(f"| hand-off [{rows}, {hidden}] float32 | gloo send/recv | {statistics.median(samples):.1f} us |",
                  flush=True)


def bench_p2p(hidden: int) -> None:
    port = 29000 + os.getpid() % 1000
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(port),
                               "--hidden", str(hidden)]) for rank in (0, 1)]
    for process in ranks:
        process.wait()


def bench_steps(model: str, streams: int, steps: int) -> None:
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    variants = [("--pp-size 1", dict(pipeline_parallel_size=1)),
                ("--pp-size 2, 1 micro-batch", dict(pipeline_parallel_size=2, pp_max_micro_batch_size=streams)),
                ("--pp-size 2, 2 micro-batches", dict(pipeline_parallel_size=2))]
    for label, flags in variants:
        engine = LLMEngine(EngineConfig.from_flat(dict(model=model, dtype="float32", num_threads=1,
                                                       max_total_tokens=8192, **flags)))
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for index in range(streams):
            engine.add_request(str(index), [100 + index, 200, 300, 400], params)
        for _ in range(4):  # prefill and warm-up
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"| {model} decode, {streams} streams | {label} | {statistics.median(times):.1f} ms/step |",
              flush=True)
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    if args.rank is not None:
        p2p_rank(args.rank, args.port, args.hidden)
        return
    bench_p2p(args.hidden)
    for streams in args.streams:
        bench_steps(args.model, streams, args.steps)


if __name__ == "__main__":
    main()
