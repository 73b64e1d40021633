"""K/V transfer cost of prefill/decode disaggregation: bytes moved per request and transfer time
per 1k prompt tokens, for the zmq (TCP loopback), shm, nixl (one-sided UCX writes into the
decode pool) and mooncake backends, float32 and float8 K/V; a backend whose package is absent
is skipped.

Two real engines in this process (a prefill and a decode LLMEngine, real pyzmq sockets; the
prefill engine steps on its own thread, as in its own process): the prefill engine computes each
prompt first (its K/V parked), then the decode engine pulls, so the measured time is the transfer
alone: from the pull sent to the K/V written into the decode pool (``disaggregation_pull_time_s``).

    python benchmarks/disagg_transfer.py --model smollm2-135m --prompt-tokens 1024 \
        --backends zmq,shm,nixl
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import threading
import time

from servelm.config import (CacheConfig, DisaggregationConfig, EngineConfig, ModelConfig,
                            RuntimeConfig)
from servelm.disagg.spec import KVTransfer
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def engine(model: str, mode: str, port: int, kv_dtype: str, backend: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(max_total_tokens=16384, kv_cache_dtype=kv_dtype, disable_radix_cache=True),
        runtime=RuntimeConfig(num_threads=1),
        disaggregation=DisaggregationConfig(disaggregation_mode=mode, disaggregation_bootstrap_port=port,
                                            disaggregation_transfer_backend=backend)))


def measure(model: str, prompt_tokens: int, kv_dtype: str, backend: str, repeats: int,
            port: int) -> dict[str, float]:
    prefill = engine(model, "prefill", port, kv_dtype, backend)
    decode = engine(model, "decode", port, kv_dtype, backend)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)
    times, sizes, sends, writes = [], [], [], []
    lock, stop = threading.Lock(), threading.Event()

    def serve_pulls() -> None:
        while not stop.is_set():
            with lock:
                prefill.step()
            time.sleep(0.0005)

    thread: threading.Thread | None = None
    try:
        for index in range(repeats + 1):  # the first connects the sockets: not counted
            prompt = [rng.randrange(100, 20000) for _ in range(prompt_tokens)]
            key = f"{index}/0"
            with lock:
                prefill.add_request(f"p{index}", prompt, params,
                                    kv_transfer=KVTransfer("prefill", key))
                while prefill.has_unfinished():
                    prefill.step()
            if thread is None:
                thread = threading.Thread(target=serve_pulls, daemon=True)
                thread.start()
            before, sent_before = decode.stats(), prefill.stats()["disaggregation_send_time_s"]
            decode.add_request(f"d{index}", prompt, params,
                               kv_transfer=KVTransfer("decode", key, "127.0.0.1", port))
            while decode.has_unfinished():
                decode.step()
            after = decode.stats()
            if index:
                times.append(after["disaggregation_pull_time_s"] - before["disaggregation_pull_time_s"])
                sizes.append(after["disaggregation_bytes_received"] - before["disaggregation_bytes_received"])
                sends.append(prefill.stats()["disaggregation_send_time_s"] - sent_before)
                writes.append(after["disaggregation_receive_time_s"] - before["disaggregation_receive_time_s"])
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        prefill.shutdown()
        decode.shutdown()
    times.sort()
    median_s = times[len(times) // 2]
    return {"bytes": sizes[0], "median_ms": median_s * 1000,
            "send_ms": sorted(sends)[len(sends) // 2] * 1000,
            "write_ms": sorted(writes)[len(writes) // 2] * 1000,
            "ms_per_1k_tokens": median_s * 1000 * 1000 / prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=47911)
    parser.add_argument("--backends", default="zmq,shm,nixl,mooncake")
    parser.add_argument("--kv-dtypes", default="auto,fp8_e4m3")
    args = parser.parse_args()
    modules = {"nixl": ("nixl", "nixl_cu12"), "mooncake": ("mooncake",)}
    backends = [b for b in args.backends.split(",") if b not in modules
                or any(importlib.util.find_spec(m) is not None for m in modules[b])]
    print("| model | K/V dtype | backend | bytes / request | transfer ms | ms / 1k tokens | "
          "prefill read+send ms | decode read+write ms |")
    print("|---|---|---|---|---|---|---|---|")
    for kv_dtype in args.kv_dtypes.split(","):
        for backend in backends:
            result = measure(args.model, args.prompt_tokens, kv_dtype, backend, args.repeats, args.port)
            print(f"| {args.model} | {'float32' if kv_dtype == 'auto' else kv_dtype} | {backend} | "
                  f"{result['bytes'] / 2 ** 20:.1f} MiB | {result['median_ms']:.1f} | "
                  f"{result['ms_per_1k_tokens']:.1f} | {result['send_ms']:.1f} | "
                  f"{result['write_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
