"""servelm against llama.cpp's llama-server and vLLM's CPU build, one after another, same client.

Each server is started in turn on the same model, measured with servelm's own streamed
``/v1/completions`` client (``servelm.bench_common.one_request``: temperature 0, ``ignore_eos``,
token-id prompts), then stopped (its whole process group). The columns are issue 16's:

- 1 stream tok/s: one request, 16-token prompt, ``--output-len`` (128) tokens, output tokens / time;
- prefill tok/s: a 1,019-token prompt, 1 output token: prompt tokens / time to first token;
- 8 and 32 streams tok/s: that many concurrent 128-token prompts of 128 output tokens each, all
  output tokens / wall time.

Peers (absent ones are skipped with a message, nothing is built or installed here):
- llama.cpp: ``$LLAMA_BUILD/bin/llama-server`` (default ~/.cache/llama-cpp-b11434, built by
  ../shared/tools/build_llama_server.sh) on the GGUF as is, ``-cb -np 32``;
- vLLM: ``$VLLM_VENV/bin/vllm`` (default ~/.cache/vllm-cpu-venv, ../shared/tools/install_vllm_cpu.sh)
  on a Hugging Face directory written by ../shared/tools/gguf_to_hf.py (``--hf-dir``), as shipped;
- servelm: ``python -m servelm serve MODEL`` with the default flags plus ``--servelm-args``.

    .venv/bin/python benchmarks/compare_peers.py [--model gemma3-270m] [--peers servelm,llama.cpp,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.bench_common import one_request, random_prompts  # noqa: E402
from servelm.model.loader import cpu_flags  # noqa: E402

PREFILL_TOKENS = 1019
STREAM_PROMPT_TOKENS = 128
TOKEN_RANGE = (1000, 20000)
"""Prompt token ids are drawn here: ordinary vocabulary in every packaged model, no special tokens."""


@dataclass
class Peer:
    name: str
    command: list[str]
    env: dict[str, str]
    startup_s: float


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    low, high = TOKEN_RANGE
    return [[low + t for t in prompt] for prompt in random_prompts(count, length, high - low, seed)]


def find_peers(args: argparse.Namespace, gguf: Path, port: int) -> tuple[list[Peer], list[str]]:
    """The peers to run, in order, and a message for each one skipped."""
    threads = str(args.threads)
    peers, skipped = [], []
    wanted = args.peers.split(",")
    if "llama.cpp" in wanted:
        server = Path(os.environ.get("LLAMA_BUILD", "~/.cache/llama-cpp-b11434")).expanduser() / "bin/llama-server"
        if server.exists():
            context = 32 * (PREFILL_TOKENS + args.output_len + 64)   # -np 32 splits -c between the slots
            peers.append(Peer("llama.cpp llama-server -cb -np 32", [
                str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
                "-cb", "-np", "32", "-c", str(context), "--alias", args.model], {}, 120))
        else:
            skipped.append(f"llama.cpp: no {server} (build it with ../shared/tools/build_llama_server.sh)")
    if "vllm" in wanted:
        venv = Path(os.environ.get("VLLM_VENV", "~/.cache/vllm-cpu-venv")).expanduser()
        hf_dir = Path(args.hf_dir).expanduser() if args.hf_dir else None
        if not (venv / "bin/vllm").exists():
            skipped.append(f"vLLM: no {venv}/bin/vllm (install with ../shared/tools/install_vllm_cpu.sh)")
        elif hf_dir is None or not (hf_dir / "config.json").exists():
            skipped.append(f"vLLM: --hf-dir {hf_dir} is not a Hugging Face directory (write it with "
                           f"../shared/tools/gguf_to_hf.py {gguf} DIR)")
        else:
            peers.append(vllm_peer(venv, hf_dir, args.model, port, args.threads))
    if "servelm" in wanted:
        peers.append(servelm_peer(args.model, port, args.threads, args.servelm_args.split()))
    return peers, skipped


def servelm_peer(model: str, port: int, threads: int, extra: list[str]) -> Peer:
    """``servelm serve MODEL`` with the default flags plus ``extra``."""
    return Peer(f"servelm {' '.join(['serve', model, *extra])}", [
        sys.executable, "-m", "servelm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--num-threads", str(threads), *extra], {}, 600)


def vllm_peer(venv: Path, hf_dir: Path, model: str, port: int, threads: int, startup_s: float = 600) -> Peer:
    """vLLM's CPU build serving ``hf_dir`` as ``model``, as shipped (its own dtype and kernels)."""
    preload = ":".join(p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                   str(venv / "lib/libiomp5.so")) if Path(p).exists())
    return Peer("vLLM CPU (as shipped)", [
        str(venv / "bin/vllm"), "serve", str(hf_dir), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", model, "--max-model-len", "4096"],
        {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
         "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **({"LD_PRELOAD": preload} if preload else {})},
        startup_s)


async def _stream(client: object, base_url: str, model: str, prompts: list[list[int]],
                  max_tokens: int) -> tuple[float, list]:
    body = lambda prompt: {"model": model, "prompt": prompt, "max_tokens": max_tokens,  # noqa: E731
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    timings = await asyncio.gather(*(one_request(client, f"{base_url}/v1/completions", body(p))
                                     for p in prompts))
    return time.perf_counter() - start, list(timings)


async def measure(base_url: str, model: str, output_len: int,
                  counts: tuple[int, ...] | None = None) -> dict[str, float]:
    """The four columns for the server at ``base_url`` (only ``stream_rates`` of ``counts`` where given)."""
    import httpx
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=None)) as client:
        await _stream(client, base_url, model, _prompts(1, 16, 9), 8)   # warm-up
        if counts:
            return await stream_rates(client, base_url, model, output_len, counts)
        row = await stream_rates(client, base_url, model, output_len, (1,))
        _, timings = await _stream(client, base_url, model, _prompts(1, PREFILL_TOKENS, 2), 1)
        row["prefill tok/s"] = PREFILL_TOKENS / timings[0].ttft_s if timings[0].ttft_s else float("nan")
        return row | await stream_rates(client, base_url, model, output_len, (8, 32))


async def stream_rates(client: object, base_url: str, model: str, output_len: int,
                       counts: tuple[int, ...]) -> dict[str, float]:
    """Output tok/s (all streams' tokens / wall time) of each stream count in ``counts``: one stream
    of a 16-token prompt, or that many concurrent 128-token prompts; ``output_len`` tokens each."""
    row: dict[str, float] = {}
    for streams in counts:
        prompts = _prompts(1, 16, 1) if streams == 1 else _prompts(streams, STREAM_PROMPT_TOKENS, 3)
        wall, timings = await _stream(client, base_url, model, prompts, output_len)
        errors = [t.error for t in timings if t.error]
        if errors:
            raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
        row[f"{streams} stream{'s' if streams > 1 else ''} tok/s"] = _tokens(timings, output_len) / wall
    return row


def _tokens(timings: list, output_len: int) -> int:
    return sum(t.num_output_tokens or (len(t.chunk_gaps_s) + 1 if t.ttft_s else 0) for t in timings
               if not t.error)


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def stop_group(process: subprocess.Popen, timeout_s: float) -> None:
    """Stop a server started with ``start_new_session``: SIGTERM to its process group, SIGKILL
    after ``timeout_s``."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_peer(peer: Peer, port: int, args: argparse.Namespace, log_dir: Path,
             counts: tuple[int, ...] | None = None, log_name: str = "") -> dict[str, float]:
    """Start ``peer``, measure it (``measure``'s columns, or its stream ``counts``), stop it; its
    output goes to ``log_dir/<log_name or its first word>.log``."""
    base_url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{log_name or peer.name.split()[0]}.log").open("w")
    process = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **peer.env})
    try:
        wait_ready(base_url, process, peer.startup_s)
        return asyncio.run(measure(base_url, args.model, args.output_len, counts))
    finally:
        stop_group(process, 30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="a packaged model name")
    parser.add_argument("--peers", default="servelm,llama.cpp,vllm")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--hf-dir", help="the model as a Hugging Face directory, for vLLM")
    parser.add_argument("--servelm-args", default="", help="extra servelm flags (default: none)")
    parser.add_argument("--log-dir", default="/tmp/compare_peers")
    args = parser.parse_args()
    from servelm.model.packaged import packaged_model_path
    gguf = Path(packaged_model_path(args.model))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    peers, skipped = find_peers(args, gguf, args.port)
    for message in skipped:
        print(f"skipped {message}", flush=True)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2", "fma", "f16c")))
    print(f"{args.model} ({gguf.name}), {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, flags: {' '.join(flags)}; load average {os.getloadavg()}", flush=True)
    print_table(measure_peers(peers, args, log_dir), "compare within one run")


def measure_peers(peers: list[Peer], args: argparse.Namespace, log_dir: Path, label: str = "") -> list[list[str]]:
    """One table row per peer that ran (its name, ``label`` appended, then its columns), one after another."""
    rows = []
    for peer in peers:
        print(f"running {peer.name}{label} (load average {os.getloadavg()[0]:.2f}) ...", flush=True)
        try:
            result = run_peer(peer, args.port, args, log_dir)
        except Exception as error:   # one peer failing does not stop the others
            print(f"  {peer.name} failed: {error} (log in {log_dir})", flush=True)
            continue
        rows.append([peer.name + label, *(f"{value:.1f}" for value in result.values())])
        print(f"  {result}", flush=True)
    return rows


def print_table(rows: list[list[str]], note: str) -> None:
    print("| server | 1 stream tok/s | prefill tok/s | 8 streams tok/s | 32 streams tok/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"load average after: {os.getloadavg()}  (shared machine: {note})")


if __name__ == "__main__":
    main()
