"""Typical acceptance on a live SmolLM2-135M server with n-gram drafts, through vLLM's spellings
(--speculative-model [ngram] --spec-decoding-acceptance-method typical_acceptance_sampler): greedy
text and tokens equal the plain server's; a seeded sampling request streams exactly the text it
returns in one piece; and the drafts are verified (acceptance figures in /get_server_info)."""

from __future__ import annotations

import httpx
import pytest

from .conftest import OPS_MODEL
from .server_process import ServerProcess
from .test_speculative_live import complete, stream_text


@pytest.fixture(scope="module")
def typical_server():
    args = [OPS_MODEL, "--speculative-model", "[ngram]", "--num-speculative-tokens", "4",
            "--spec-decoding-acceptance-method", "typical_acceptance_sampler",
            "--typical-acceptance-sampler-posterior-threshold", "0.09",
            "--typical-acceptance-sampler-posterior-alpha", "0.3",
            "--context-length", "128", "--max-total-tokens", "8192"]
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
