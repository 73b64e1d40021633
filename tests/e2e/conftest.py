"""Shared live servers: one for the operations tests (metrics, logging, CORS, limits, bad input),
one behind an API key for the openai-client and playground tests, one for the client-compatibility
and structured-output tests."""

from __future__ import annotations

import pytest

from .server_process import ServerProcess

OPS_MODEL = "smollm2-135m"
OPS_ORIGIN = "http://allowed.example"


@pytest.fixture(scope="session")
def ops_server():
    """SmolLM2-135M with metrics, request logs at level 2 and CORS on. The context is short (128
    tokens), so any request the fuzzer makes finishes in seconds. float32: the speculative tests
    compare their servers' greedy tokens with this one's, and bf16 (the default on a CPU with bf16
    GEMMs) rounds a multi-token verify pass differently from one-token decoding."""
    args = [OPS_MODEL, "--enable-metrics", "--log-requests", "--log-requests-level", "2",
            "--max-log-len", "20", "--log-stats-interval", "1", "--allowed-origins", OPS_ORIGIN,
            "--context-length", "128", "--max-total-tokens", "8192", "--dtype", "float32"]
    with ServerProcess(args) as running:
        yield running


KEYED_MODEL = "smollm2-135m"
KEYED_API_KEY = "test-key"


@pytest.fixture(scope="session")
def keyed_server():
    """SmolLM2-135M behind --api-key with a 2048-token context, in the default dtype: the openai
    client tests (test_server_live) and the playground browser test share it."""
    args = [KEYED_MODEL, "--api-key", KEYED_API_KEY, "--num-threads", "1", "--max-total-tokens", "8192",
            "--context-length", "2048"]
    with ServerProcess(args) as running:
        yield running


CLIENTS_MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def clients_server():
    """SmolLM2-135M in float32 with one thread, a 2048-token context, the TGI routes and the
    qwen25 tool-call parser: the client-compatibility tests (test_clients_live) and the
    structured-output and tool-call tests (test_structured_live) share it (one start instead of
    two). float32: test_clients_live compares two requests token for token, and on a CPU with bf16
    GEMMs the default (GGUF blocks with a bf16 rest) may round a prefix-cache hit differently."""
    args = [CLIENTS_MODEL, "--num-threads", "1", "--use_tgi_api", "--context-length", "2048",
            "--max-total-tokens", "8192", "--dtype", "float32", "--tool-call-parser", "qwen25"]
    with ServerProcess(args) as running:
        yield running


@pytest.fixture(autouse=True)
def waiting_ranks_ended():
    """Kill the rank processes a test started ahead (``engine_drive.start_ranks_ahead``) that no
    engine took, e.g. when the test failed before its parallel engine started."""
    yield
    from servelm.workers.processes import end_waiting_workers

    end_waiting_workers()
