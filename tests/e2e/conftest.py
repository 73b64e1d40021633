"""Shared live server for the operations tests (metrics, logging, CORS, limits, bad input)."""

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
