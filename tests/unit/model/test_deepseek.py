"""DeepSeek-V2/V3 over the paged cache vs transformers (CPU, float32): test_architectures' parity
tests and the MoE tests on the tiny MLA configs, plus what is DeepSeek's own: the pool holds the
latent (its bytes per token from the config), ``--disable-mla``'s expanded K/V give the same
logits and tokens, and the routers choose and weigh the experts as transformers' do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from servelm.config import ModelConfig
from servelm.model.architectures.deepseek import DISABLE_MLA, DeepseekRouter
from servelm.model.forward_batch import BatchPlan
from servelm.model.kv_cache import KVCache, LatentKVCache
from servelm.model.layers.moe import route_group_limited, route_noaux_tc
from servelm.model.source import ModelSourceError, resolve_model_source
from tests.tiny_models import TINY_MLA_ARCHS, make_tiny_config, make_tiny_model_dir

from .conftest import BlockAllocator, make_runner, make_source, prompts_for
from . import test_architectures, test_moe_architectures
from .test_architectures import (  # noqa: F401  (collected here with this module's ``arch``)
    ATOL, test_chunked_prefill_matches_full, test_prefill_logits_match)


@pytest.fixture(scope="module", params=TINY_MLA_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.slow
def test_greedy_generation_matches_hf(arch: str, hf_model: Any, runner_factory: Any,
                                      allocator: BlockAllocator) -> None:
    test_architectures.test_greedy_generation_matches_hf(arch, hf_model, runner_factory, allocator)


@pytest.mark.slow
def test_decode_batch_of_mixed_lengths(arch: str, hf_model: Any, runner_factory: Any,
                                       allocator: BlockAllocator) -> None:
    test_architectures.test_decode_batch_of_mixed_lengths(arch, hf_model, runner_factory, allocator)


@pytest.mark.slow
def test_every_expert_gets_tokens(arch: str, hf_model: Any, allocator: BlockAllocator) -> None:
    test_moe_architectures.test_every_expert_gets_tokens(arch, hf_model, allocator)


@pytest.mark.slow
def test_per_expert_checkpoint_loads_as_fused(arch: str, hf_model: Any, tmp_path: Any) -> None:
    test_moe_architectures.test_per_expert_checkpoint_loads_as_fused(arch, hf_model, tmp_path)


def expanded_runner(hf_model: Any) -> Any:
    """The runner ``--disable-mla`` gives (model/source.py sets the attribute on the config)."""
    source = make_source(hf_model)
    source.hf_config = type(hf_model.config).from_dict({**hf_model.config.to_dict(), DISABLE_MLA: True})
    return make_runner(source)


def test_pool_holds_the_latent(arch: str, runner_factory: Any, hf_model: Any) -> None:
    config = hf_model.config
    runner = runner_factory()
    latent_width = config.kv_lora_rank + config.qk_rope_head_dim
    assert isinstance(runner.kv_cache, LatentKVCache) and not runner.kv_cache.v_caches
    assert runner.kv_cache.k_caches[0].shape[1:] == (1, latent_width)
    assert runner.kv_bytes_per_token == config.num_hidden_layers * latent_width * 4
    expanded = expanded_runner(hf_model)
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    assert type(expanded.kv_cache) is KVCache
    assert expanded.kv_bytes_per_token == config.num_hidden_layers * config.num_attention_heads * per_head * 4
    layout = runner.kv_pool_layout()
    assert layout["kind"] == "latent" and layout["expanded_bytes_per_token"] == expanded.kv_bytes_per_token
    assert expanded.kv_pool_layout() == {"kind": "per_head", "bytes_per_token": expanded.kv_bytes_per_token}


def test_expanded_kv_matches_latent(arch: str, hf_model: Any) -> None:
    """--disable-mla: the same logits (a batched prefill, then greedy decode steps), so the same tokens."""
    prompts = prompts_for(arch, hf_model.config.vocab_size)
    results = []
    for runner in (make_runner(make_source(hf_model)), expanded_runner(hf_model)):
        allocator = BlockAllocator(runner.num_blocks)
        rows = [runner.execute(BatchPlan([allocator.plan(i, p, num_logits=1) for i, p in enumerate(prompts)]))]
        for _ in range(4):
            tokens = rows[-1].argmax(-1).tolist()
            rows.append(runner.execute(BatchPlan([allocator.plan(i, [t], num_logits=1) for i, t in enumerate(tokens)])))
        results.append(torch.cat(rows))
    torch.testing.assert_close(results[0], results[1], atol=ATOL, rtol=1e-4)


def test_router_matches_transformers(arch: str) -> None:
    """The router alone on many tokens: the same experts, the same weights (V2's group limit, V3's
    bias-corrected groups), so a routing bug shows here and not only as a changed token."""
    config = make_tiny_config(arch)
    module = transformers.models.deepseek_v2.modeling_deepseek_v2 if arch == "deepseek_v2" \
        else transformers.models.deepseek_v3.modeling_deepseek_v3
    reference = (module.DeepseekV2TopkRouter if arch == "deepseek_v2" else module.DeepseekV3TopkRouter)(config)
    torch.manual_seed(3)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
        ours = DeepseekRouter(config, has_correction_bias=arch == "deepseek_v3")
        ours.weight.copy_(reference.weight)
        if ours.e_score_correction_bias is not None:
            reference.e_score_correction_bias.normal_(0.0, 0.2)
            ours.e_score_correction_bias.copy_(reference.e_score_correction_bias)
        x = torch.randn(256, config.hidden_size)
        _, weights, ids = reference(x)
        routing = ours(x)
    order, our_order = ids.argsort(-1), routing.expert_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), routing.expert_ids.gather(1, our_order))
    torch.testing.assert_close(weights.gather(1, order), routing.weights.gather(1, our_order))
    # the groups matter on these tokens: without them some tokens would take other experts
    logits, top_k = F.linear(x, ours.weight), config.num_experts_per_tok
    ungrouped = (route_group_limited(logits, top_k, 1, 1, 1.0) if ours.e_score_correction_bias is None
                 else route_noaux_tc(logits, ours.e_score_correction_bias, top_k, 1, 1, True, 1.0))
    assert not torch.equal(ungrouped.expert_ids.sort(-1).values, routing.expert_ids.sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_latent_pool_rows_blocks_and_copies(dtype: torch.dtype) -> None:
    """V is a view of the stored row (nothing stored twice); whole blocks move between pools as
    bytes (prefill/decode transfer), and block copies move the latent (copy-on-write)."""
    pool = LatentKVCache(2, 4, 2, 1, 6, dtype, torch.device("cpu"), first_layer=3, v_head_dim=4)
    assert pool.nbytes == 2 * 4 * 2 * 6 * dtype.itemsize and not pool.v_caches
    rows = torch.randn(8, 1, 6)
    for layer in (3, 4):
        pool.write(layer, torch.arange(8), rows * layer, rows[..., :4])
    k, v = pool.layer(4)
    assert torch.equal(k.float(), (rows * 4).to(dtype).float()) and v.data_ptr() == k.data_ptr()
    assert v.shape == (8, 1, 4)
    other = LatentKVCache(2, 4, 2, 1, 6, dtype, torch.device("cpu"), first_layer=3, v_head_dim=4)
    other.write_blocks([2, 0], *pool.read_blocks([1, 3]))
    assert torch.equal(other.layer(3)[0][4:6].view(torch.uint8), pool.layer(3)[0][2:4].view(torch.uint8))
    pool.copy_blocks([(0, 2)])
    assert torch.equal(pool.layer(4)[0][4:6].view(torch.uint8), pool.layer(4)[0][0:2].view(torch.uint8))


def test_disable_mla_on_a_model_without_it_is_refused(tmp_path: Any) -> None:
    path = make_tiny_model_dir(tmp_path, "llama")
    with pytest.raises(ModelSourceError, match="--disable-mla: LlamaForCausalLM has no multi-head latent"):
        resolve_model_source(ModelConfig(model=str(path), disable_mla=True))
    assert getattr(resolve_model_source(ModelConfig(model=str(path))).hf_config, DISABLE_MLA, False) is False
