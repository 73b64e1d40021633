"""Typical acceptance on a live SmolLM2-135M server with n-gram drafts, through vLLM's spellings
(--speculative-model [ngram] --spec-decoding-acceptance-method typical_acceptance_sampler): greedy
text and tokens equal the plain server's; a seeded sampling request streams exactly the text it
returns in one piece; and the drafts are verified (acceptance figures in /get_server_info,
/metrics, the stats line and `servelm bench serve`)."""

from __future__ import annotations

import json

import httpx
import pytest

from servelm import cli

from .conftest import OPS_MODEL
from .server_process import ServerProcess
from .test_speculative_live import complete, stream_text


@pytest.fixture(scope="module")
def typical_server():
    args = [OPS_MODEL, "--speculative-model", "[ngram]", "--num-speculative-tokens", "4",
            "--spec-decoding-acceptance-method", "typical_acceptance_sampler",
            "--typical-acceptance-sampler-posterior-threshold", "0.09",
            "--typical-acceptance-sampler-posterior-alpha", "0.3",
            "--enable-metrics", "--log-stats-interval", "1",
            "--context-length", "128", "--max-total-tokens", "8192", "--dtype", "float32"]
    with ServerProcess(args) as running:
        yield running


def test_greedy_equals_the_plain_server_and_sampling_streams_as_it_returns(typical_server, ops_server):
    plain = complete(ops_server)["choices"][0]
    greedy = complete(typical_server)["choices"][0]
    assert greedy["text"] == plain["text"] and len(plain["text"]) > 20
    assert greedy["logprobs"]["tokens"] == plain["logprobs"]["tokens"]

    sampled = complete(typical_server, temperature=0.8, seed=11)
    assert sampled["usage"]["completion_tokens"] > 5
    assert stream_text(typical_server, temperature=0.8, seed=11) == sampled["choices"][0]["text"]
    assert complete(typical_server, temperature=0.8, seed=11)["choices"][0] == sampled["choices"][0]

    info = httpx.get(f"{typical_server.base_url}/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "NGRAM" and info["spec_num_draft_tokens"] > 0, info
    assert info["spec_decoding_acceptance_method"] == "typical_acceptance_sampler"


def test_figures_in_metrics_log_line_and_bench_serve(typical_server, tmp_path):
    complete(typical_server)
    metrics = httpx.get(f"{typical_server.base_url}/metrics", timeout=30).text
    line = next(m for m in metrics.splitlines() if m.startswith("servelm:spec_num_draft_tokens{"))
    assert float(line.split()[-1]) > 0
    assert "spec_acceptance_rate=" in typical_server.log(None)
    path = tmp_path / "serve.json"
    cli.main(["bench", "serve", "--base-url", typical_server.base_url, "--num-prompts", "2",
              "--concurrency", "1", "--input-len", "8", "--output-len", "8",
              "--output-json", str(path)])
    report = json.loads(path.read_text())
    assert report["speculative_algorithm"] == "NGRAM" and report["spec_num_verify_passes"] >= 0
