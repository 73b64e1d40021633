"""The hierarchical cache in the engine, on a tiny random-weight model (float32): exact greedy
outputs with the tiers on and off (bit-identical logprobs with the default host tier), a working
set 4x the pool keeping its hit rate, restart reuse from disk, corrupt files skipped, another
model's files never read, the int8 host tier's error (only when asked for)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, HiCacheConfig, ModelConfig, RuntimeConfig
from servelm.engine.engine import LLMEngine
from servelm.model.kv_cache import KVCache, LatentKVCache
from servelm.model.kv_tiers import HostKVTier
from servelm.sampling.params import SamplingParams
from tests.engine_drive import greedy
from tests.tiny_models import make_tiny_model_dir

BLOCK = 8
POOL_TOKENS = 64  # 8 blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("hicache"), "llama")


def make(model: Path, pool_tokens: int = POOL_TOKENS, store: Path | None = None,
         model_options: dict[str, object] | None = None, **hicache: object) -> LLMEngine:
    tiers = HiCacheConfig()
    if hicache or store is not None:
        options: dict[str, object] = {"enable_hierarchical_cache": True, **hicache}
        if store is not None:
            options.update(hicache_storage_backend="file",
                           hicache_storage_backend_extra_config=json.dumps({"file_path": str(store)}),
                           hicache_storage_prefetch_policy=options.get(
                               "hicache_storage_prefetch_policy", "wait_complete"))
        tiers = HiCacheConfig(**options)  # type: ignore[arg-type]
    config = EngineConfig(model=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32",
                                            **(model_options or {})),  # type: ignore[arg-type]
                          cache=CacheConfig(max_total_tokens=pool_tokens, page_size=BLOCK), hicache=tiers,
                          runtime=RuntimeConfig(num_threads=1))  # fixed threads: bit-exact logprobs
    return LLMEngine(config)


def working_set(num_prefixes: int = 8, rounds: int = 2, seed: int = 0) -> list[list[int]]:
    """Prompts over ``num_prefixes`` shared 32-token prefixes (4 blocks each: 8 of them are 4x a
    pool of 8 blocks), asked in turn so the pool alone keeps none of them until it comes back."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 300) for _ in range(4 * BLOCK)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(1, 300) for _ in range(3)]
            for i in range(num_prefixes * rounds)]


def run_one_by_one(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [greedy(engine, [prompt], PARAMS)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """The working set's greedy tokens with a pool that holds all of it (no tiers)."""
    return run_one_by_one(make(model_dir, pool_tokens=4096), working_set())


def test_tiers_off_lose_a_working_set_4x_the_pool(model_dir: Path, reference: list[list[int]]) -> None:
    plain = make(model_dir)
    assert run_one_by_one(plain, working_set()) == reference
    assert plain.stats()["cache_hit_rate"] == 0  # LRU over a cyclic working set 4x the pool


@pytest.mark.parametrize("policy", [pytest.param("write_through", marks=pytest.mark.slow),
                                    pytest.param("write_through_selective", marks=pytest.mark.slow),
                                    "write_back"])
def test_tiers_keep_the_hit_rate_of_a_working_set_4x_the_pool(
        model_dir: Path, reference: list[list[int]], policy: str) -> None:
    tiered = make(model_dir, hicache_ratio=8.0, hicache_write_policy=policy)
    assert run_one_by_one(tiered, working_set()) == reference  # exact host tier: identical tokens
    stats = tiered.stats()
    # The second round is served from the host tier: 4 of each prompt's 4 cached blocks.
    assert stats["hicache_host_hit_tokens"] == 8 * 4 * BLOCK
    assert stats["cache_hit_rate"] == round(8 * 32 / (16 * 35), 4)
    assert stats["hicache_demoted_blocks"] > 0 and stats["hicache_host_read_bytes"] > 0
    assert tiered.hicache is not None
    assert tiered.hicache.locate(working_set()[0]) == ["host"] * 4  # evicted from the pool: demoted
    assert stats["num_used_blocks"] == 0
    tiered.shutdown()


def run_with_logprobs(engine: LLMEngine, prompts: list[list[int]]
                      ) -> list[list[tuple[int, float, list[tuple[int, float]]]]]:
    """Each prompt alone, greedy with 5 top logprobs: (token, logprob, top) per output token."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    results = []
    for index, prompt in enumerate(prompts):
        assert engine.add_request(str(index), prompt, params) is None
        rows: list[tuple[int, float, list[tuple[int, float]]]] = []
        while engine.has_unfinished():
            for output in engine.step():
                assert output.logprobs is not None and len(output.logprobs) == len(output.new_token_ids)
                rows.extend((entry.token_id, entry.logprob, entry.top) for entry in output.logprobs)
        results.append(rows)
    return results


def test_default_host_tier_is_lossless(model_dir: Path) -> None:
    """--enable-hierarchical-cache alone (no --hicache-host-dtype): the second round comes back
    from the host tier and every token and logprob equals a pool that never evicted (bit for bit:
    the default stores the pool's own dtype; the int8 tier's rounding moves the logprobs)."""
    assert HiCacheConfig().hicache_host_dtype == "auto"
    prompts = working_set()
    reference = run_with_logprobs(make(model_dir, pool_tokens=4096), prompts)
    tiered = make(model_dir, hicache_ratio=8.0)
    assert run_with_logprobs(tiered, prompts) == reference
    assert tiered.stats()["hicache_host_hit_tokens"] == 8 * 4 * BLOCK
    tiered.shutdown()
    lossy = make(model_dir, hicache_ratio=8.0, hicache_host_dtype="int8")
    tokens = run_with_logprobs(lossy, prompts)
    assert lossy.stats()["hicache_host_hit_tokens"] == 8 * 4 * BLOCK
    assert tokens[:8] == reference[:8]  # the first round never reads the host tier
    assert tokens[8:] != reference[8:]  # what the default avoids (the tokens may still agree)
    lossy.shutdown()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_latent_block_round_trips_through_the_host_tier(layout: str) -> None:
    """A latent pool (one row per token and layer, V a view of it): the host tier holds its rows
    alone, comes back bit for bit, and sizes itself by them (half a K/V pool's bytes per block)."""
    kv = LatentKVCache(2, 4, BLOCK, 1, 40, torch.float32, torch.device("cpu"), v_head_dim=32)
    for latent in kv.k_caches:
        latent.copy_(torch.randn(latent.shape, generator=torch.Generator().manual_seed(latent.numel())))
    host = HostKVTier(kv, 2, "auto", layout)
    assert host.planes == 1 and host.exact_nbytes == 2 * BLOCK * 40 * 4
    assert HostKVTier.bytes_per_block(kv, "auto") * 2 == HostKVTier.bytes_per_block(
        KVCache(2, 4, BLOCK, 1, 40, torch.float32, torch.device("cpu")), "auto")
    original = [latent[BLOCK:2 * BLOCK].clone() for latent in kv.k_caches]
    host.to_host(1, 1)
    for latent in kv.k_caches:
        latent.zero_()
    host.from_host(1, 1)
    assert all(torch.equal(latent[BLOCK:2 * BLOCK], rows) for latent, rows in zip(kv.k_caches, original))
    assert all(torch.equal(kv.layer(layer)[1], kv.layer(layer)[0][..., :32]) for layer in range(2))


@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_block_whose_v_is_narrower_than_k_round_trips(layout: str, host_dtype: str) -> None:
    """DeepSeek's expanded pool (--disable-mla): K wider than V per head. The host keeps V
    zero-padded to K's width; the default tier brings both back bit for bit, the int8 tier within
    half a step, and neither touches the neighbouring blocks."""
    kv = KVCache(2, 4, BLOCK, 2, 24, torch.float32, torch.device("cpu"), v_head_dim=16)
    generator = torch.Generator().manual_seed(1)
    for k, v in zip(kv.k_caches, kv.v_caches, strict=True):
        k.copy_(torch.randn(k.shape, generator=generator) * 3)
        v.copy_(torch.randn(v.shape, generator=generator))
    host = HostKVTier(kv, 2, host_dtype, layout)
    assert host.widths == (24, 16) and host.exact_nbytes == 2 * 2 * BLOCK * 2 * 24 * 4
    assert host.nbytes == 2 * host.host_nbytes  # two slots, K and V each at K's width
    before = [t.clone() for t in (*kv.k_caches, *kv.v_caches)]
    host.to_host(1, 1)
    for t in (*kv.k_caches, *kv.v_caches):
        t[BLOCK:2 * BLOCK] = 0
    host.from_host(1, 1)
    for original, restored in zip(before, (*kv.k_caches, *kv.v_caches), strict=True):
        assert torch.equal(restored[:BLOCK], original[:BLOCK])
        assert torch.equal(restored[2 * BLOCK:], original[2 * BLOCK:])
        if host_dtype == "auto":
            assert torch.equal(restored[BLOCK:2 * BLOCK], original[BLOCK:2 * BLOCK])
        else:
            step = original[BLOCK:2 * BLOCK].abs().amax(dim=(0, 2), keepdim=True) / 127
            assert torch.all((restored[BLOCK:2 * BLOCK] - original[BLOCK:2 * BLOCK]).abs() <= step / 2 + 1e-6)
    payload = host.read_exact(1)
    for t in (*kv.k_caches, *kv.v_caches):
        t[BLOCK:2 * BLOCK] = 0
    host.write_exact(1, payload)
    assert host.read_exact(1) == payload


@pytest.mark.slow
def test_expanded_deepseek_pool_host_tier_is_lossless(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSeek-V3 under --disable-mla (per-head K 24 wide, V 16 at the tiny shape): the second
    round comes back from the host tier and every token and logprob equals a pool that never
    evicted."""
    mla_dir = make_tiny_model_dir(tmp_path_factory.mktemp("hicache-expanded"), "deepseek_v3")

    expanded = {"disable_mla": True}
    prompts = working_set(num_prefixes=3)
    reference = run_with_logprobs(make(mla_dir, pool_tokens=4096, model_options=expanded), prompts)
    tiered = make(mla_dir, model_options=expanded, hicache_ratio=8.0)
    host = tiered.hicache.mover  # type: ignore[union-attr]
    assert isinstance(host, HostKVTier) and host.planes == 2 and host.widths[0] > host.widths[1]
    assert run_with_logprobs(tiered, prompts) == reference
    assert tiered.stats()["hicache_host_hit_tokens"] == 3 * 4 * BLOCK
    tiered.shutdown()


@pytest.mark.slow
def test_latent_pool_host_tier_is_lossless(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSeek's latent pool (MLA): the host tier stores exactly the latent rows (one plane of
    kv_lora_rank + rope values per token and layer, no V), and the second round, served from it,
    gives every token and logprob of a pool that never evicted."""
    mla_dir = make_tiny_model_dir(tmp_path_factory.mktemp("hicache-mla"), "deepseek_v3")
    prompts = working_set(num_prefixes=3)   # 12 blocks over a pool of 8: each comes back from the host
    reference = run_with_logprobs(make(mla_dir, pool_tokens=4096), prompts)
    tiered = make(mla_dir, hicache_ratio=8.0)
    assert isinstance(tiered.hicache.mover, HostKVTier)  # type: ignore[union-attr]
    host, kv = tiered.hicache.mover, tiered.hicache.mover.kv  # type: ignore[union-attr]
    assert isinstance(kv, LatentKVCache) and not kv.v_caches
    assert host.planes == 1 and host.data.shape[-3:] == (BLOCK, 1, 32 + 8)  # kv_lora_rank + rope
    assert run_with_logprobs(tiered, prompts) == reference
    assert tiered.stats()["hicache_host_hit_tokens"] == 3 * 4 * BLOCK
    tiered.shutdown()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_int8_host_tier_error_is_half_a_step(model_dir: Path, layout: str) -> None:
    kv = KVCache(2, 4, BLOCK, 2, 16, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for k, v in zip(kv.k_caches, kv.v_caches, strict=True):
        k.copy_(torch.randn(k.shape, generator=generator) * 3)
        v.copy_(torch.randn(v.shape, generator=generator))
    host = HostKVTier(kv, 2, "int8", layout)
    original = host._gather(1).clone()
    host.to_host(1, 0)
    kv.k_caches[0].zero_()
    kv.v_caches[1].zero_()
    host.from_host(0, 1)
    restored = host._gather(1)
    scale = original.abs().amax(dim=(2, 4), keepdim=True) / 127
    assert torch.all((restored - original).abs() <= scale / 2 + 1e-6)
    assert host.host_nbytes * 3 < host.exact_nbytes  # float32 -> int8 (+ scales)


@pytest.mark.slow
def test_int8_host_tier_in_the_engine(model_dir: Path, reference: list[list[int]]) -> None:
    """Measured, not assumed: the int8 tier serves hits; its tokens are compared with exact ones
    (the share that agree is printed for RESULTS.md)."""
    prompts = working_set()
    engine = make(model_dir, hicache_ratio=8.0, hicache_host_dtype="int8")
    tokens = run_one_by_one(engine, prompts)
    assert engine.stats()["hicache_host_hit_tokens"] > 0
    same = sum(a == b for x, y in zip(tokens, reference, strict=True) for a, b in zip(x, y, strict=True))
    print(f"int8 host tier: {same}/{4 * len(prompts)} greedy tokens equal to float32")
    assert tokens[:8] == reference[:8]  # the first round never reads the host tier
    engine.shutdown()


def test_restart_serves_the_first_request_from_disk(model_dir: Path, tmp_path: Path) -> None:
    prompt = working_set(1, 1)[0]
    reference = greedy(make(model_dir, pool_tokens=4096), [prompt], PARAMS)
    first = make(model_dir, store=tmp_path)
    assert greedy(first, [prompt], PARAMS) == reference
    first.shutdown()  # finishes the queued writes
    again = make(model_dir, store=tmp_path)
    assert again.hicache is not None
    assert again.hicache.locate(prompt) == ["disk"] * 4
    assert greedy(again, [prompt], PARAMS) == reference
    assert again.hicache.locate(prompt) == ["device"] * 4
    stats = again.stats()
    assert stats["hicache_storage_hit_tokens"] == 4 * BLOCK and stats["hicache_prefetch_waits"] == 1
    assert stats["num_cached_prompt_tokens"] == 4 * BLOCK
    again.shutdown()


def test_corrupt_files_are_skipped_after_a_crash(model_dir: Path, tmp_path: Path) -> None:
    prompt = working_set(1, 1)[0]
    reference = greedy(make(model_dir, pool_tokens=4096), [prompt], PARAMS)
    first = make(model_dir, store=tmp_path)
    greedy(first, [prompt], PARAMS)
    first.shutdown()
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) == 4
    for path in files[:2]:  # as if the machine died before these pages reached the disk
        path.write_bytes(path.read_bytes()[:-100])
    again = make(model_dir, store=tmp_path)
    assert greedy(again, [prompt], PARAMS) == reference
    stats = again.stats()
    assert stats["hicache_storage_invalid_files"] >= 1
    # The chain stops at the first bad block: what precedes it comes from disk, the rest is computed.
    assert stats["hicache_storage_hit_tokens"] < 4 * BLOCK
    again.shutdown()


def test_another_model_never_reads_the_directory(model_dir: Path, tmp_path: Path) -> None:
    prompt = working_set(1, 1)[0]
    first = make(model_dir, store=tmp_path)
    greedy(first, [prompt], PARAMS)
    first.shutdown()
    other_dir = make_tiny_model_dir(tmp_path / "other", "llama", seed=1)  # same shapes, other weights
    reference = greedy(make(other_dir, pool_tokens=4096), [prompt], PARAMS)
    other = make(other_dir, store=tmp_path)
    assert greedy(other, [prompt], PARAMS) == reference
    stats = other.stats()
    assert stats["hicache_storage_hit_tokens"] == 0 and stats["hicache_storage_invalid_files"] == 0
    other.shutdown()
    assert len(list(tmp_path.glob("*/*.kv"))) == 8  # two fingerprints, four blocks each


def test_flush_cache_drops_the_host_tier(model_dir: Path) -> None:
    engine = make(model_dir, hicache_ratio=8.0)
    run_one_by_one(engine, working_set(2, 1))
    assert engine.stats()["hicache_host_blocks"] > 0
    assert engine.flush_cache()["success"]
    assert engine.stats()["hicache_host_blocks"] == 0


def test_best_effort_never_holds_a_request(model_dir: Path, tmp_path: Path) -> None:
    prompt = working_set(1, 1)[0]
    reference = greedy(make(model_dir, pool_tokens=4096), [prompt], PARAMS)
    first = make(model_dir, store=tmp_path)
    greedy(first, [prompt], PARAMS)
    first.shutdown()
    again = make(model_dir, store=tmp_path, hicache_storage_prefetch_policy="best_effort")
    assert greedy(again, [prompt], PARAMS) == reference
    assert again.stats()["hicache_prefetch_waits"] == 0
    again.shutdown()


def test_refusals_and_storage_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from servelm.engine.hicache import STORAGE_DIR_ENV, storage_directory

    def config(**flat: object) -> EngineConfig:
        return EngineConfig.from_flat({"enable_hierarchical_cache": True, **flat})

    for flat, words in (({"hicache_storage_backend": "mooncake"}, "external service"),
                        ({"hicache_mem_layout": "page_first_direct"}, "page_first_direct"),
                        ({"tensor_parallel_size": 2}, "in-process runner"),
                        ({"disable_radix_cache": True}, "--disable-radix-cache"),
                        ({"hicache_storage_backend": "file",
                          "hicache_storage_backend_extra_config": '{"path": "x"}'}, "'path'")):
        with pytest.raises(ValueError, match=words):
            config(**flat)
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        EngineConfig.from_flat({"hicache_storage_backend": "file"})
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path / "from-env"))
    assert storage_directory(config(hicache_storage_backend="file")) == tmp_path / "from-env"
    extra = '{"file_path": "%s"}' % (tmp_path / "flag")
    assert storage_directory(config(hicache_storage_backend="file",
                                    hicache_storage_backend_extra_config=extra)) == tmp_path / "flag"
    monkeypatch.delenv(STORAGE_DIR_ENV)
    assert storage_directory(config(hicache_storage_backend="file")) == \
        Path("~/.cache/servelm/hicache").expanduser()


@pytest.mark.slow
def test_smollm2_tiers_on_and_off_give_the_same_tokens() -> None:
    """The real SmolLM2-135M (float32) with a pool of 12 blocks and 4 system prompts of 6 blocks:
    the default (exact) host tier serves the second round and changes no token."""
    def engine(tiers: bool) -> LLMEngine:
        hicache = (HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0)
                   if tiers else HiCacheConfig())
        return LLMEngine(EngineConfig(model=ModelConfig(model="smollm2-135m", dtype="float32"),
                                      cache=CacheConfig(max_total_tokens=192), hicache=hicache))
    rng = random.Random(3)
    systems = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(100, 40000) for _ in range(5)] for i in range(8)]
    plain, tiered = engine(False), engine(True)
    assert run_one_by_one(tiered, prompts) == run_one_by_one(plain, prompts)
    assert tiered.stats()["hicache_host_hit_tokens"] == 4 * 96
    assert plain.stats()["cache_hit_rate"] == 0


def test_a_host_tier_larger_than_the_ram_is_refused_at_start(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="host tier would take .*--hicache-size"):
        make(model_dir, hicache_size=10 ** 6)
