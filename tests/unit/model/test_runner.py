"""ModelRunner plumbing: loading from a saved dir, dummy weights, dtypes, KV pool sizing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors import safe_open

from servelm.config import CacheConfig, EngineConfig, ModelConfig
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.runner import MAX_CPU_KV_TOKENS, ModelRunner, kv_pool_blocks
from tests.tiny_models import make_tiny_config, make_tiny_hf_model, make_tiny_model_dir

from .conftest import make_runner, make_source


def dir_source(path: Path) -> SimpleNamespace:
    def weights():  # type: ignore[no-untyped-def]
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    return SimpleNamespace(hf_config=transformers.AutoConfig.from_pretrained(path), weights=weights,
                           tokenizer_path=None, eos_token_ids=[], context_length=512, description=str(path))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_model_dir_round_trip(tmp_path: Path, arch: str) -> None:
    path = make_tiny_model_dir(tmp_path, arch)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    runner = make_runner(dir_source(path))
    prompt = [1, 2, 3, 4, 5]
    logits = runner.execute(BatchPlan([SequencePlan(prompt, 0, [0, 1], num_logits=5)]))
    with torch.no_grad():
        expected = make_tiny_hf_model(arch)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_dummy_weights_are_deterministic_and_finite() -> None:
    source = SimpleNamespace(hf_config=make_tiny_config("qwen2"), weights=None)
    plan = BatchPlan([SequencePlan([1, 2, 3], 0, [3], num_logits=3)])
    first = make_runner(source).execute(plan)
    second = make_runner(source).execute(plan)
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


def test_bfloat16_runs_and_stays_close() -> None:
    hf_model = make_tiny_hf_model("qwen3")
    runner = make_runner(make_source(hf_model), dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    logits = runner.execute(BatchPlan([SequencePlan([4, 5, 6, 7], 0, [2], num_logits=1)]))
    assert logits.dtype == torch.float32
    with torch.no_grad():
        expected = hf_model(torch.tensor([[4, 5, 6, 7]])).logits[0, -1:]
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)


def test_pool_size_from_max_total_tokens_rounds_down() -> None:
    cache = CacheConfig(page_size=16, max_total_tokens=1000)
    assert kv_pool_blocks(cache, bytes_per_token=1024, device=torch.device("cpu")) == 62


def test_pool_size_from_free_memory_is_capped_on_cpu() -> None:
    cache = CacheConfig(page_size=16, mem_fraction_static=0.5)
    assert kv_pool_blocks(cache, bytes_per_token=1, device=torch.device("cpu")) * 16 <= MAX_CPU_KV_TOKENS
    with pytest.raises(RuntimeError, match="one KV block"):
        kv_pool_blocks(cache, bytes_per_token=2 ** 50, device=torch.device("cpu"))


def test_default_cpu_pool_leaves_room_for_other_servers() -> None:
    gib = 2 ** 30
    smollm2_bytes = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x float32
    default = CacheConfig(page_size=16)
    # The host: 24 GiB, 22 GiB free. 30% of free memory was 6.7 GiB; now 1/16 of RAM.
    blocks = kv_pool_blocks(default, smollm2_bytes, torch.device("cpu"), demand_tokens=64 * 8192,
                            memory_bytes=(22 * gib, 24 * gib))
    assert blocks * 16 * smollm2_bytes <= 1.5 * gib
    assert blocks * 16 >= 32 * 1024  # still 64 requests x 512 tokens
    # Bounded by what can be in use: max running requests x context length.
    assert kv_pool_blocks(default, smollm2_bytes, torch.device("cpu"), demand_tokens=4 * 512,
                          memory_bytes=(22 * gib, 24 * gib)) == 4 * 512 // 16
    # A fraction the user chose is honoured (up to the CPU cap), as is --max-total-tokens.
    chosen = CacheConfig(page_size=16, mem_fraction_static=0.5)
    assert kv_pool_blocks(chosen, 2 ** 16, torch.device("cpu"), memory_bytes=(8 * gib, 24 * gib)) \
        == 4 * gib // 2 ** 16 // 16


def test_runner_reports_pool_and_vocab() -> None:
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=8, max_total_tokens=256))
    runner = ModelRunner(config, SimpleNamespace(hf_config=make_tiny_config("llama"), weights=None))
    assert (runner.num_blocks, runner.block_size, runner.vocab_size) == (32, 8, 320)
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    # 2 layers * K and V * 256 slots * 2 KV heads * head_dim 16 * 4 bytes
    assert runner.kv_cache_bytes == 2 * 2 * 256 * 2 * 16 * 4
    assert runner.execute(BatchPlan()).shape == (0, 320)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_hf_in_float32() -> None:
    hf_model = make_tiny_hf_model("gemma3")
    config = EngineConfig(model=ModelConfig(device="cuda", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=256))
    runner = ModelRunner(config, make_source(hf_model))
    prompt = list(range(1, 21))
    logits = runner.execute(BatchPlan([SequencePlan(prompt, 0, list(range(5)), num_logits=20)]))
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits.cpu(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_float32_residual_stream_is_closer_to_the_float32_model(arch: str) -> None:
    """``--residual-dtype``: a bf16 model whose residual stream is float32 (the CPU default) carries
    float32 hidden states between layers and gives logits nearer the float32 model's than the same
    model with a bf16 stream; ``model`` keeps the stream in bf16."""
    hf_model = make_tiny_hf_model(arch)
    with torch.no_grad():   # the same weights in both dtypes: what differs is the activations' rounding
        for param in hf_model.parameters():
            param.copy_(param.to(torch.bfloat16))
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(12)] for i in range(6)]
    plan = BatchPlan([SequencePlan(prompt, 0, [3 * i, 3 * i + 1, 3 * i + 2], num_logits=len(prompt))
                      for i, prompt in enumerate(prompts)])
    reference = make_runner(make_source(hf_model)).execute(plan)
    errors = {}
    for residual_dtype in ("float32", "model"):
        runner = make_runner(make_source(hf_model), dtype="bfloat16", residual_dtype=residual_dtype)
        streams: list[torch.dtype] = []
        runner.model.model.layers[1].register_forward_pre_hook(lambda module, args: streams.append(args[0].dtype))
        errors[residual_dtype] = (runner.execute(plan) - reference).abs().mean().item()
        assert streams == [torch.float32 if residual_dtype == "float32" else torch.bfloat16]
    assert errors["float32"] < 0.9 * errors["model"], errors   # 0.79 (gemma3), 0.83 (llama) here
