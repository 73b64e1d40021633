"""Tensor-parallel communication cost on one host: gloo vs the shared-memory all-reduce.

Part 1 times one all-reduce between two pinned rank processes for a decode step's hidden state
(``[1, hidden]``) and a 32-stream step's (``[32, hidden]``). Part 2 times whole decode steps of the
engine at --tp 1 and --tp 2 with each all-reduce (greedy, ``--num-threads 1`` per rank), so the
difference between the two TP rows is the per-step communication saved. The rank launch, timing
and step loop are ``comm_harness``'s (shared with pp_comm.py).

    python benchmarks/tp_comm.py                       # Qwen2.5-Coder-0.5B (hidden 896, 24 layers)
    python benchmarks/tp_comm.py --model smollm2-135m --hidden 576
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from comm_harness import add_common_arguments, bench_decode_steps, join_pair, launch_ranks, median_us  # noqa: E402


def allreduce_rank(rank: int, port: int, path: str, hidden: int) -> None:
    from servelm.distributed.shm_allreduce import ShmAllReduce

    group = join_pair(rank, port)
    shm = ShmAllReduce(path, rank, 2, 60)
    for rows in (1, 32):
        tensor = torch.randn(rows, hidden)
        for name, reduce in (("gloo", lambda t: group.allreduce([t]).wait()), ("shm", shm.all_reduce)):
            elapsed = median_us(lambda: reduce(tensor))
            if rank == 0:
                print(f"| all-reduce [{rows}, {hidden}] float32 | {name} | {elapsed:.1f} us |", flush=True)
            tensor = torch.randn(rows, hidden)  # keep values finite


def bench_allreduce(hidden: int) -> None:
    from servelm.distributed.shm_allreduce import create_segment, unlink_segment

    path = create_segment(2)
    try:
        launch_ranks(__file__, ["--segment", path, "--hidden", str(hidden)])
    finally:
        unlink_segment(path, 2)


VARIANTS = [("--tp 1", dict(tensor_parallel_size=1)),
            ("--tp 2, gloo", dict(tensor_parallel_size=2, disable_custom_all_reduce=True)),
            ("--tp 2, shared memory", dict(tensor_parallel_size=2))]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    parser.add_argument("--segment")
    args = parser.parse_args()
    if args.rank is not None:
        allreduce_rank(args.rank, args.port, args.segment, args.hidden)
        return
    bench_allreduce(args.hidden)
    for streams in args.streams:
        bench_decode_steps(args.model, streams, args.steps, VARIANTS)


if __name__ == "__main__":
    main()
