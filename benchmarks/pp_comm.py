"""Pipeline-parallel cost on one host: the stage-to-stage hand-off and whole decode steps.

Part 1 times one hand-off of a step's hidden states (gloo point-to-point between two pinned rank
processes: a ping-pong, halved) for a decode step of 1 and of 32 streams. Part 2 times decode steps
of the engine at --pp-size 1 and 2 (greedy, ``--num-threads 1`` per rank), with the default
micro-batches (2 per step) and with one micro-batch per step (no overlap between the stages). The
rank launch, timing and step loop are ``comm_harness``'s (shared with tp_comm.py).

    python benchmarks/pp_comm.py                       # Qwen2.5-Coder-0.5B (hidden 896, 24 layers)
    python benchmarks/pp_comm.py --model smollm2-135m --hidden 576
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from comm_harness import add_common_arguments, bench_decode_steps, join_pair, launch_ranks, median_us  # noqa: E402


def p2p_rank(rank: int, port: int, hidden: int) -> None:
    group = join_pair(rank, port)
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

        elapsed = median_us(ping_pong, divide=2)
        if rank == 0:
            print(f"| hand-off [{rows}, {hidden}] float32 | gloo send/recv | {elapsed:.1f} us |", flush=True)


def variants(streams: int) -> list[tuple[str, dict]]:
    return [("--pp-size 1", dict(pipeline_parallel_size=1)),
            ("--pp-size 2, 1 micro-batch", dict(pipeline_parallel_size=2, pp_max_micro_batch_size=streams)),
            ("--pp-size 2, 2 micro-batches", dict(pipeline_parallel_size=2))]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    args = parser.parse_args()
    if args.rank is not None:
        p2p_rank(args.rank, args.port, args.hidden)
        return
    launch_ranks(__file__, ["--hidden", str(args.hidden)])
    for streams in args.streams:
        bench_decode_steps(args.model, streams, args.steps, variants(streams))


if __name__ == "__main__":
    main()
