"""What memory left untouched for a while costs on its next read, on this machine.

Some virtual machines (a Firecracker guest here, sessions 46+: benchmarks/RESULTS.md) make a page that
was not touched for a fraction of a second slow to touch again: the host tracks or reclaims guest
memory behind the guest's back, and the next read waits on the host, page by page. A server meets
it whenever a phase reads weights the previous phase did not (a prompt's GEMMs on a copy the decode
steps never read, a batch size whose route reads another copy), so an engine's served figures can
fall well below its in-process ones. This measures the effect: a buffer read hot, then read again
after each idle time, its first read's extra time per 4 KiB page. On a machine without the effect
every read is as fast as the hot one.

    .venv/bin/python benchmarks/cold_memory.py [--mib 64] [--idle 0.1 0.5 1 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

PAGE = 4096


def read_ms(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="buffer size")
    parser.add_argument("--idle", type=float, nargs="+", default=[0.1, 0.5, 1.0, 3.0], help="idle seconds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--busy", action="store_true", help="spin (no memory reads) instead of sleeping")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    buffer = torch.ones((args.mib << 20) // 4)   # float32, written: every page mapped
    hot = min(read_ms(buffer) for _ in range(5))
    pages = (args.mib << 20) // PAGE
    print(f"{platform.processor() or platform.machine()}, {args.threads} thread(s), {args.mib} MiB "
          f"({pages} pages): hot read {hot:.2f} ms ({args.mib / 1024 / hot * 1000:.1f} GiB/s)")
    print("| idle s | first read ms | second read ms | extra us per page |")
    print("|---|---|---|---|")
    for idle in args.idle:
        start = time.perf_counter()
        while args.busy and time.perf_counter() - start < idle:
            pass
        if not args.busy:
            time.sleep(idle)
        first, second = read_ms(buffer), read_ms(buffer)
        print(f"| {idle:g} | {first:.2f} | {second:.2f} | {(first - hot) * 1000 / pages:.2f} |")


if __name__ == "__main__":
    main()
