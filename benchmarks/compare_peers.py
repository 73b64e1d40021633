"""servelm against llama.cpp's llama-server and vLLM's CPU build, in interleaved rounds, same client.

Every server is started on the same model (each on its own port; an idle server takes no CPU:
llama-server, vLLM's engine and servelm's all block while they have no request), then measured
with servelm's own streamed ``/v1/completions`` client (``servelm.bench_common.one_request``:
temperature 0, ``ignore_eos``, token-id prompts) in ``--rounds`` rounds (default 3): each round
measures every server in turn, the order rotated by one per round, on prompts of its own (no
server's prefix cache serves a later round from an earlier one). A column's figure is the median
of its rounds, printed with their range. On a shared VM the machine's speed drifts by 10-30% over
minutes (benchmarks/RESULTS.md, sessions 25-27): servers measured one after another for a few
minutes each met different machines, and the ratios moved with it; rounds spread every server over
the whole run. Before each measurement the run waits until the machine is quiet (``wait_quiet``):
a server may go on computing after its last answer. ``--rounds 1`` is the earlier single pass (the
same prompts as before). At the end every server is stopped (its whole process group). The columns
are issue 16's:

- 1 stream tok/s: one request, 16-token prompt, ``--output-len`` (128) tokens, output tokens / time;
- prefill tok/s: a 1,019-token prompt, 1 output token: prompt tokens / time to first token;
- 8 and 32 streams tok/s: that many concurrent 128-token prompts of 128 output tokens each, all
  output tokens / wall time;
- with ``--long-context N``, one more: "1 stream @N tok/s", one request of an N-token prompt and
  ``LONG_OUTPUT_TOKENS`` output tokens, its decode rate at that context (output tokens after the
  first / the time after the first: the prompt's own cost is the prefill column's). A long context
  is where decode attention reads the most K/V per token, which the short columns hardly show.

After the tables, the prefill column against its roofline (issue 30): the model's FLOPs per prompt
token of the 1,019-token prompt (``prefill_flops``: every layer's weights, the causal attention's
two products at each token's context, the LM head on the last token) and the bf16 GEMM peak of this
CPU at ``--threads`` (``bf16_gemm_peak``: torch.matmul, measured before and after the rounds, the
higher taken; float32 on a CPU without a native bf16 GEMM, ``peak_dtype``) give the prompt tokens a
second that bf16 arithmetic allows; each server's prefill is
printed as a share of it (above 100%: fewer bf16 FLOPs a token than the model has, e.g. servelm's
int8 prompt GEMMs).

Peers (absent ones are skipped with a message, nothing is built or installed here):
- llama.cpp: ``$LLAMA_BUILD/bin/llama-server`` (default ~/.cache/llama-cpp-b11434, built by
  ../shared/tools/build_llama_server.sh) on the GGUF as is, ``-cb -np 32`` (``--no-repack`` on an AMX CPU,
  where its AMX repack crashes);
- vLLM: ``$VLLM_VENV/bin/vllm`` (default ~/.cache/vllm-cpu-venv, ../shared/tools/install_vllm_cpu.sh)
  on a Hugging Face directory written by ../shared/tools/gguf_to_hf.py (``--hf-dir``), as shipped;
- servelm: ``python -m servelm serve MODEL`` with the default flags plus ``--servelm-args``.

    .venv/bin/python benchmarks/compare_peers.py [--model gemma3-270m] [--peers servelm,llama.cpp,vllm]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
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
ROUND_SEEDS = 100
"""Round r's prompts are drawn with the seeds of round 0 plus r times this (fresh prompts per round)."""
COLUMNS = ("1 stream tok/s", "prefill tok/s", "8 streams tok/s", "32 streams tok/s")
LONG_OUTPUT_TOKENS = 64
"""Output tokens of the ``--long-context`` column's request."""


def long_column(long_context: int) -> str:
    """The ``--long-context`` column's name."""
    return f"1 stream @{long_context} tok/s"


def columns(long_context: int = 0) -> tuple[str, ...]:
    """The columns of a run: COLUMNS, then the long-context one where asked for."""
    return COLUMNS + ((long_column(long_context),) if long_context else ())


def slot_tokens(output_len: int, long_context: int = 0) -> int:
    """Context a server needs per request: the longest prompt, the output, a margin."""
    return max(PREFILL_TOKENS, long_context) + max(output_len, LONG_OUTPUT_TOKENS) + 64


@dataclass
class Peer:
    name: str
    command: list[str]
    env: dict[str, str]
    startup_s: float
    port: int | None = None
    """The port its command serves on (None: ``--port``)."""


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    low, high = TOKEN_RANGE
    return [[low + t for t in prompt] for prompt in random_prompts(count, length, high - low, seed)]


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs (a multiply-add counted twice) per prompt token of one prompt (``prefill_flops``)."""

    linears: float
    attention: float
    head: float

    @property
    def total(self) -> float:
        return self.linears + self.attention + self.head


def mean_context(prompt_len: int, window: int | None) -> float:
    """The mean number of keys a causal prompt's tokens see (token t of 1..L sees min(t, window))."""
    if window is None or window >= prompt_len:
        return (prompt_len + 1) / 2
    return (window * (window + 1) / 2 + (prompt_len - window) * window) / prompt_len


def prefill_flops(gguf: Path, prompt_len: int) -> PrefillFlops:
    """FLOPs per prompt token of a ``prompt_len``-token prompt on the GGUF's dense model: each
    layer's 2-D weights once a token; per layer the scores and the weighted sum of values, heads x
    (key + value head size) multiply-adds per key seen (``mean_context``: a sliding layer's keys
    capped at its window); the LM head on the last token only (one output token), spread over the
    prompt. Norms, rope, softmax and activations are left out (a few per cent of a GEMM's FLOPs)."""
    from servelm.model.gguf.gguf_file import GGUFFile
    file = GGUFFile(gguf)
    config = file.hf_config()
    layers = [info for info in file.tensor_infos if info.name.startswith("blk.") and len(info.shape) == 2]
    linears = 2.0 * sum(info.shape[0] * info.shape[1] for info in layers)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    attention = sum(2.0 * heads * 2 * head_dim * mean_context(prompt_len, window if kind == "sliding_attention" else None)
                    for kind in kinds)
    head = 2.0 * config.vocab_size * config.hidden_size / prompt_len
    return PrefillFlops(linears, attention, head)


ROOFLINE_GEMM = 2048
"""The bf16 GEMM whose rate is the roofline's peak: two ROOFLINE_GEMM-square bf16 matrices."""


def peak_dtype() -> str:
    """The GEMM dtype of the roofline: bf16 where the CPU has a native bf16 GEMM (AVX512-BF16, AMX),
    else float32 (what servelm and the peers compute in there; torch's bf16 GEMM without it is a slow
    emulation that took minutes a measurement on an AVX2-only Zen 3)."""
    from servelm.model.loader import cpu_bf16_feature
    return "bf16" if cpu_bf16_feature() is not None else "float32"


def bf16_gemm_peak(threads: int, size: int = ROOFLINE_GEMM, repeats: int = 5) -> float:
    """GFLOP/s of torch.matmul on two ``size``-square matrices of ``peak_dtype`` at ``threads``
    threads (the library's GEMM, oneDNN on x86: AMX tiles where the CPU has them), the best of
    ``repeats``."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if peak_dtype() == "bf16" else torch.float32
    try:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2.0 * size ** 3 / best / 1e9


def roofline_lines(results: dict[str, list[dict[str, float]]], flops: PrefillFlops, peak: float,
                   peaks: tuple[float, ...], threads: int) -> list[str]:
    """The prefill column against the bf16 roofline, as printed lines (the module's docstring)."""
    ceiling = peak * 1e9 / flops.total
    lines = [f"prefill roofline: {flops.total / 1e9:.3f} GFLOP a prompt token at {PREFILL_TOKENS} tokens "
             f"(layers' weights {flops.linears / 1e9:.3f}, attention {flops.attention / 1e9:.3f}, LM head "
             f"{flops.head / 1e9:.4f}); {peak_dtype()} GEMM peak {peak:.0f} GFLOP/s (torch.matmul {ROOFLINE_GEMM}^3, "
             f"{threads} threads; {', '.join(f'{p:.0f}' for p in peaks)} before and after the rounds) "
             f"-> {ceiling:.0f} prompt tok/s",
             f"| server | prefill tok/s | share of the {peak_dtype()} roofline |", "|---|---|---|"]
    for name, rounds in results.items():
        values = [r["prefill tok/s"] for r in rounds if r.get("prefill tok/s") == r.get("prefill tok/s")]
        if values:
            median = statistics.median(values)
            lines.append(f"| {name} | {median:.1f} | {100 * median / ceiling:.0f}% |")
    return lines


def find_peers(args: argparse.Namespace, gguf: Path, port: int) -> tuple[list[Peer], list[str]]:
    """The peers to run, in order (each on its own port from ``port`` up), and a message for each one skipped."""
    threads = str(args.threads)
    peers, skipped = [], []
    wanted = args.peers.split(",")
    slot = slot_tokens(args.output_len, getattr(args, "long_context", 0))   # other scripts' args lack it
    if "llama.cpp" in wanted:
        server = Path(os.environ.get("LLAMA_BUILD", "~/.cache/llama-cpp-b11434")).expanduser() / "bin/llama-server"
        if server.exists():
            context = 32 * slot   # -np 32 splits -c between the slots
            # b11434's AMX repack crashes in ggml_backend_amx_mul_mat on AMX CPUs: run it without.
            repack = ["--no-repack"] if "amx_int8" in cpu_flags() else []
            peers.append(Peer(f"llama.cpp llama-server -cb -np 32{' --no-repack' if repack else ''}", [
                str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port + len(peers)), "-t", threads,
                "-cb", "-np", "32", "-c", str(context), "--alias", args.model, *repack], {}, 120,
                port + len(peers)))
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
            peers.append(vllm_peer(venv, hf_dir, args.model, port + len(peers), args.threads,
                                   max_model_len=max(4096, slot)))
    if "servelm" in wanted:
        peers.append(servelm_peer(args.model, port + len(peers), args.threads, args.servelm_args.split()))
    return peers, skipped


def servelm_peer(model: str, port: int, threads: int, extra: list[str]) -> Peer:
    """``servelm serve MODEL`` with the default flags plus ``extra``."""
    return Peer(f"servelm {' '.join(['serve', model, *extra])}", [
        sys.executable, "-m", "servelm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--num-threads", str(threads), *extra], {}, 600, port)


def vllm_peer(venv: Path, hf_dir: Path, model: str, port: int, threads: int, startup_s: float = 600,
              max_model_len: int = 4096) -> Peer:
    """vLLM's CPU build serving ``hf_dir`` as ``model``, as shipped (its own dtype and kernels)."""
    preload = ":".join(p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                   str(venv / "lib/libiomp5.so")) if Path(p).exists())
    return Peer("vLLM CPU (as shipped)", [
        str(venv / "bin/vllm"), "serve", str(hf_dir), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", model, "--max-model-len", str(max_model_len)],
        {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
         "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **({"LD_PRELOAD": preload} if preload else {})},
        startup_s, port)


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
                  counts: tuple[int, ...] | None = None, seed: int = 0, long_context: int = 0) -> dict[str, float]:
    """The four columns for the server at ``base_url`` (only ``stream_rates`` of ``counts`` where given),
    and the long-context one where ``long_context`` is set; ``seed`` is added to every prompt's seed
    (a round's own prompts)."""
    import httpx
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=None)) as client:
        await _stream(client, base_url, model, _prompts(1, 16, 9 + seed), 8)   # warm-up
        if counts:
            return await stream_rates(client, base_url, model, output_len, counts, seed)
        row = await stream_rates(client, base_url, model, output_len, (1,), seed)
        _, timings = await _stream(client, base_url, model, _prompts(1, PREFILL_TOKENS, 2 + seed), 1)
        row["prefill tok/s"] = PREFILL_TOKENS / timings[0].ttft_s if timings[0].ttft_s else float("nan")
        row |= await stream_rates(client, base_url, model, output_len, (8, 32), seed)
        if long_context:
            row[long_column(long_context)] = await long_decode_rate(client, base_url, model, long_context, seed)
        return row


async def long_decode_rate(client: object, base_url: str, model: str, long_context: int, seed: int = 0) -> float:
    """Decode tok/s of one request of a ``long_context``-token prompt: its output tokens after the first
    over the time after the first (``LONG_OUTPUT_TOKENS`` in all)."""
    _, timings = await _stream(client, base_url, model, _prompts(1, long_context, 4 + seed), LONG_OUTPUT_TOKENS)
    timing = timings[0]
    if timing.error:
        raise RuntimeError(f"the {long_context}-token request failed: {timing.error}")
    decode_s = timing.latency_s - (timing.ttft_s or 0.0)
    return (_tokens([timing], LONG_OUTPUT_TOKENS) - 1) / decode_s if decode_s > 0 else float("nan")


async def stream_rates(client: object, base_url: str, model: str, output_len: int,
                       counts: tuple[int, ...], seed: int = 0) -> dict[str, float]:
    """Output tok/s (all streams' tokens / wall time) of each stream count in ``counts``: one stream
    of a 16-token prompt, or that many concurrent 128-token prompts; ``output_len`` tokens each."""
    row: dict[str, float] = {}
    for streams in counts:
        prompts = _prompts(1, 16, 1 + seed) if streams == 1 else _prompts(streams, STREAM_PROMPT_TOKENS, 3 + seed)
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


def start_peer(peer: Peer, port: int, log_dir: Path, log_name: str = "") -> subprocess.Popen:
    """Start ``peer`` on ``port`` in its own session and wait until it answers (stopped again if it
    does not); its output goes to ``log_dir/<log_name or its first word>.log``."""
    log = (log_dir / f"{log_name or peer.name.split()[0]}.log").open("w")
    with log:   # the child holds its own copy of the file
        process = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **peer.env})
    try:
        wait_ready(f"http://127.0.0.1:{port}", process, peer.startup_s)
    except BaseException:
        stop_group(process, 30)
        raise
    return process


def run_peer(peer: Peer, port: int, args: argparse.Namespace, log_dir: Path,
             counts: tuple[int, ...] | None = None, log_name: str = "", seed: int = 0,
             long_context: int = 0) -> dict[str, float]:
    """Start ``peer``, measure it (``measure``'s columns, or its stream ``counts``), stop it."""
    process = start_peer(peer, port, log_dir, log_name)
    try:
        return asyncio.run(measure(f"http://127.0.0.1:{port}", args.model, args.output_len, counts, seed,
                                   long_context))
    finally:
        stop_group(process, 30)


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every column on every server, interleaved; medians reported")
    parser.add_argument("--long-context", type=int, default=0, metavar="N",
                        help="one more column: the decode rate of one request with an N-token prompt")
    parser.add_argument("--sequential", action="store_true",
                        help="start each server only for its own measurement (one server's memory at a time)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
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
    flops = prefill_flops(gguf, PREFILL_TOKENS)
    before = bf16_gemm_peak(args.threads)
    results = measure_peers(peers, args, log_dir)
    print_rounds(results, args.rounds, columns(args.long_context))
    peaks = (before, bf16_gemm_peak(args.threads))
    print("\n".join(roofline_lines(results, flops, max(peaks), peaks, args.threads)), flush=True)


def print_rounds(results: dict[str, list[dict[str, float]]], rounds: int,
                 names: tuple[str, ...] = COLUMNS) -> None:
    """``measure_peers``' results as tables (``names``: the columns): the medians, then (several
    rounds) the ranges."""
    medians, ranges = summarize(results, names)
    print(f"medians of {rounds} round{'s' if rounds > 1 else ''}:")
    print_table(medians, "compare within one run", names)
    if rounds > 1:
        print("ranges over the rounds (min-max):")
        print_table(ranges, "compare within one run", names)


def busy_cores(interval_s: float = 0.5) -> float:
    """Cores the whole machine keeps busy over the next ``interval_s`` (psutil: idle and iowait are
    not busy)."""
    import psutil
    return psutil.cpu_percent(interval_s) / 100 * (psutil.cpu_count() or 1)


def wait_quiet(limit_s: float = 60.0, below: float = 0.25) -> tuple[float, float]:
    """Wait until the machine keeps fewer than ``below`` cores busy, at most ``limit_s``: a server
    measured just before may go on computing after its last answer (vLLM's CPU build kept a core busy
    for about a second after 32 streams; the server measured next met a busy machine, and servelm's
    adaptive threads dropped to one for 2-3 s of its one-stream column). Returns (seconds waited, the
    last busy cores)."""
    start = time.monotonic()
    while True:
        busy = busy_cores()
        if busy < below or time.monotonic() - start >= limit_s:
            return time.monotonic() - start, busy


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated by one per round (no server always first)."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def summarize(results: dict[str, list[dict[str, float]]],
              names: tuple[str, ...] = COLUMNS) -> tuple[list[list[str]], list[list[str]]]:
    """Per server with at least one round: its row of medians of the columns ``names`` and its row of
    ranges (min-max)."""
    medians, ranges = [], []
    for name, rounds in results.items():
        if not rounds:
            continue
        values = [[r[c] for r in rounds if c in r] for c in names]
        medians.append([name, *(f"{statistics.median(v):.1f}" if v else "-" for v in values)])
        ranges.append([name, *(f"{min(v):.1f}-{max(v):.1f}" if v else "-" for v in values)])
    return medians, ranges


def measure_peers(peers: list[Peer], args: argparse.Namespace, log_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Every peer's columns in ``args.rounds`` rounds (``round_order``), round r on seeds + r x
    ROUND_SEEDS. All peers run at once, each on its own port (``Peer.port``); with ``args.sequential``
    (or peers that share a port) each is started and stopped around each of its measurements instead
    (no two servers' memory at once). A peer that fails to start or to answer is reported and left out
    of later rounds."""
    ports = {peer.name: peer.port or args.port for peer in peers}
    sequential = getattr(args, "sequential", False) or len(set(ports.values())) < len(peers)
    long_context = getattr(args, "long_context", 0)   # other scripts' args lack it
    by_name = {peer.name: peer for peer in peers}
    processes: dict[str, subprocess.Popen] = {}
    results: dict[str, list[dict[str, float]]] = {peer.name: [] for peer in peers}
    try:
        if not sequential:
            for peer in peers:
                print(f"starting {peer.name} on port {ports[peer.name]} ...", flush=True)
                try:
                    processes[peer.name] = start_peer(peer, ports[peer.name], log_dir)
                except Exception as error:
                    print(f"  {peer.name} failed to start: {error} (log in {log_dir})", flush=True)
        alive = [peer.name for peer in peers if sequential or peer.name in processes]
        for index in range(args.rounds):
            for name in round_order(list(alive), index):
                peer, seed = by_name[name], index * ROUND_SEEDS
                waited, busy = wait_quiet()
                print(f"round {index + 1}/{args.rounds}: {name} (machine quiet after {waited:.1f} s: "
                      f"{busy:.2f} cores busy; load average {os.getloadavg()[0]:.2f}) ...", flush=True)
                try:
                    if sequential:
                        result = run_peer(peer, ports[name], args, log_dir, seed=seed, long_context=long_context)
                    else:
                        result = asyncio.run(measure(f"http://127.0.0.1:{ports[name]}", args.model,
                                                     args.output_len, seed=seed, long_context=long_context))
                except Exception as error:   # one peer failing does not stop the others
                    print(f"  {name} failed: {error} (log in {log_dir}); left out of later rounds", flush=True)
                    alive.remove(name)
                    continue
                results[name].append(result)
                print(f"  {result}", flush=True)
    finally:
        for process in processes.values():
            stop_group(process, 30)
    return results


def print_table(rows: list[list[str]], note: str, names: tuple[str, ...] = COLUMNS) -> None:
    print("| server | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"load average after: {os.getloadavg()}  (shared machine: {note})")


if __name__ == "__main__":
    main()
