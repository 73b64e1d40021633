"""The whole engine on the tiny DeepSeek checkpoints as saved on disk: greedy tokens equal
transformers' generate with the prefix cache on, chunked prefill and concurrent requests sharing a
prefix, over the latent pool; ``--disable-mla`` (expanded per-head K/V) gives the same tokens, and
/get_server_info's model info says what a token costs in each pool."""

from __future__ import annotations

import pytest
from tests.e2e.test_engine_moe import check_cached_and_chunked, make_engine, run
from tests.tiny_models import TINY_MLA_ARCHS, make_tiny_model_dir


@pytest.fixture(scope="module", params=[pytest.param(arch, marks=[pytest.mark.slow] if arch == "deepseek_v3" else [])
                                        for arch in TINY_MLA_ARCHS])   # V3 adds routing, covered by the unit tests
def tiny_model(request, tmp_path_factory):
    return request.param, make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_matches_transformers_over_the_latent_pool_and_expanded(tiny_model):
    arch, path = tiny_model
    engine = make_engine(path, cache=True)
    pool = engine.stats()["kv_pool"]   # /get_server_info's
    assert pool["kind"] == "latent" and pool["expanded_bytes_per_token"] > pool["bytes_per_token"], pool
    token_lists, reference = check_cached_and_chunked(arch, path, engine)
    expanded = make_engine(path, cache=True, disable_mla=True)
    assert expanded.stats()["kv_pool"] == {"kind": "per_head",
                                              "bytes_per_token": pool["expanded_bytes_per_token"]}
    outputs, cached = run(expanded, token_lists)
    assert cached > 0 and outputs == reference, arch

