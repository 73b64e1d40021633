"""What tp_comm.py and pp_comm.py share: two pinned rank processes on a gloo group, a
microsecond timer for one collective, and whole decode steps of engine variants.

A benchmark script runs itself twice more as ranks (``launch_ranks``: ``--rank 0|1 --port P``
plus its own arguments); each rank calls ``join_pair`` and times its collective with
``median_us``; rank 0 prints the row. ``bench_decode_steps`` builds one engine per variant
(float32, one thread per rank), prefills ``streams`` short prompts and prints the median step time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both scripts take (the model, its hidden size, steps, streams, a rank's own)."""
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])


def launch_ranks(script: str, args: Sequence[str]) -> None:
    """Run ``script --rank R --port P *args`` for ranks 0 and 1 and wait for both."""
    port = 29000 + os.getpid() % 1000
    ranks = [subprocess.Popen([sys.executable, script, "--rank", str(rank), "--port", str(port), *args])
             for rank in (0, 1)]
    for process in ranks:
        process.wait()


def join_pair(rank: int, port: int) -> Any:
    """Pin this rank to its own core with one torch thread and join the two-rank gloo group."""
    os.sched_setaffinity(0, [rank % os.cpu_count()])  # type: ignore[operator]
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, 2, timeout)  # type: ignore[attr-defined]


def median_us(call: Callable[[], None], calls_per_sample: int = 200, divide: int = 1) -> float:
    """Median over 5 samples of one ``call``'s time in microseconds (after 100 warm-up calls),
    divided by ``divide`` (a ping-pong is two hand-offs)."""
    for _ in range(100):
        call()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            call()
        samples.append((time.perf_counter() - start) / calls_per_sample / divide * 1e6)
    return statistics.median(samples)


def bench_decode_steps(model: str, streams: int, steps: int,
                       variants: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Per variant (label, engine flags): the median decode step time of ``streams`` greedy streams."""
    from servelm.config import EngineConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

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
