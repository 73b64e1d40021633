"""Tensor-parallel communication cost on one host: gloo vs the shared-memory all-reduce.

Part 1 times one all-reduce between two pinned rank processes for a decode step's hidden state
(``[1, hidden]``) and a 32-stream step's (``[32, hidden]``). Part 2 times whole decode steps of the
engine at --tp 1 and --tp 2 with each all-reduce (greedy, ``--num-threads 1`` per rank), so the
difference between the two TP rows is the per-step communication saved.

    python benchmarks/tp_comm.py                       # Qwen2.5-Coder-0.5B (hidden 896, 24 layers)
    python benchmarks/tp_comm.py --model smollm2-135m --hidden 576
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


def allreduce_rank(rank: int, port: int, path: str, hidden: int) -> None:
    from servelm.distributed.shm_allreduce import ShmAllReduce

    os.sched_setaffinity(0, [rank % os.cpu_count()])  # type: ignore[operator]
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)  # type: ignore[attr-defined]
    shm = ShmAllReduce(path, rank, 2, 60)
    for rows in (1, 32):
        tensor = torch.randn(rows, hidden)
        for name, reduce in (("gloo", lambda t: group.allreduce([t]).wait()), ("shm", shm.all_reduce)):
            for _ in range(100):
                reduce(tensor)
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(200):
                    reduce(tensor)
                samples.append((time.perf_counter() - start) / 200 * 1e6)
            if rank == 0:
                print(f"| all-reduce [{rows}, {hidden}] float32 | {name} | {statistics.median(samples):.1f} us |",
                      flush=True)
            tensor = torch.randn(rows, hidden)  # keep values finite


def bench_allreduce(hidden: int) -> None:
    from servelm.distributed.shm_allreduce import create_segment, unlink_segment

    path = create_segment(2)
    port = 29000 + os.getpid() % 1000
    try:
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(port),
                                   "--segment", path, "--hidden", str(hidden)]) for rank in (0, 1)]
        for process in ranks:
            process.wait()
    finally:
        unlink_segment(path, 2)


def bench_steps(model: str, streams: int, steps: int) -> None:
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    variants = [("--tp 1", dict(tensor_parallel_size=1)),
                ("--tp 2, gloo", dict(tensor_parallel_size=2, disable_custom_all_reduce=True)),
                ("--tp 2, shared memory", dict(tensor_parallel_size=2))]
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
    parser.add_argument("--segment")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    if args.rank is not None:
        allreduce_rank(args.rank, args.port, args.segment, args.hidden)
        return
    bench_allreduce(args.hidden)
    for streams in args.streams:
        bench_steps(args.model, streams, args.steps)


if __name__ == "__main__":
    main()
