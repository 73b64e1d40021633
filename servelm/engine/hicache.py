"""Builds the hierarchical cache (servelm.cache.hicache) for an engine: sizes the host tier,
resolves the storage directory and fingerprints the model so a directory is only ever read by
the model and settings that wrote it."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import psutil

from servelm.cache.block_pool import BlockPool
from servelm.cache.hicache import FileStorage, HiCacheController, HiCacheSettings, StorageFingerprint
from servelm.cache.radix_tree import RadixTree
from servelm.config import HICACHE_DEFAULT_DIR, EngineConfig
from servelm.engine.stage import Stage
from servelm.model.kv_cache import KVCache
from servelm.model.kv_tiers import HostKVTier

logger = logging.getLogger(__name__)

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
"""SGLang's variable for the file backend's directory, read when extra-config has no file_path."""
DEFAULT_STORAGE_GB = 16.0
HOST_MEMORY_SHARE = 0.8
"""Most of the available RAM the host tier may take (its pages fill as blocks are demoted, so
an oversized tier would fail later, mid-run, instead of at start)."""


def storage_directory(config: EngineConfig) -> Path:
    """--hicache-storage-backend-extra-config file_path, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR,
    else ~/.cache/servelm/hicache (logged, so the user sees which one won)."""
    path = config.hicache.storage_extra_config.get("file_path")
    if path:
        logger.info("hicache storage: directory %s (from --hicache-storage-backend-extra-config)", path)
    elif os.environ.get(STORAGE_DIR_ENV):
        path = os.environ[STORAGE_DIR_ENV]
        logger.info("hicache storage: directory %s (from $%s)", path, STORAGE_DIR_ENV)
    else:
        path = HICACHE_DEFAULT_DIR
        logger.info("hicache storage: directory %s (default)", path)
    return Path(path).expanduser()


def fingerprint(config: EngineConfig, runner: Any, kv: KVCache) -> StorageFingerprint:
    hf_config = getattr(runner, "hf_config", None)
    text = hf_config.to_json_string(use_diff=False) if hf_config is not None else ""
    model = config.model
    return StorageFingerprint(
        model=f"{Path(model.model).expanduser().resolve() if Path(model.model).expanduser().exists() else model.model}"
              f"@{model.revision or ''}#{model.quantization}",
        config_digest=hashlib.sha256(text.encode()).hexdigest(),
        kv_dtype=str(kv.dtype).removeprefix("torch."), num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, block_size=kv.block_size)


def build_hicache(config: EngineConfig, runner: Any, tree: RadixTree | None,
                  pool: BlockPool) -> HiCacheController | None:
    """The controller for --enable-hierarchical-cache (None when off)."""
    hicache = config.hicache
    if not hicache.enable_hierarchical_cache:
        return None
    kv = getattr(runner, "kv_cache", None)
    if not isinstance(kv, KVCache) or tree is None:
        raise ValueError("--enable-hierarchical-cache needs the in-process model runner and the "
                         "prefix cache")
    per_block = HostKVTier.bytes_per_block(kv, hicache.hicache_host_dtype)
    if hicache.hicache_size > 0:
        num_slots = int(hicache.hicache_size * 1e9) // per_block
    else:
        num_slots = int(hicache.hicache_ratio * kv.num_blocks)
    if num_slots < 1:
        raise ValueError(f"--hicache-size {hicache.hicache_size} GB holds no block of {per_block} bytes")
    available = psutil.virtual_memory().available
    if num_slots * per_block > HOST_MEMORY_SHARE * available:
        raise ValueError(
            f"the host tier would take {num_slots * per_block / 2 ** 30:.1f} GiB "
            f"({'--hicache-size' if hicache.hicache_size > 0 else '--hicache-ratio'}), more than "
            f"{HOST_MEMORY_SHARE:.0%} of the {available / 2 ** 30:.1f} GiB of RAM available after "
            "the model and KV pool; lower it (or the pool: --mem-fraction-static / --max-total-tokens)")
    host = HostKVTier(kv, num_slots, hicache.hicache_host_dtype, hicache.hicache_mem_layout)
    how = ("int8 with per-block, per-head scales (dequantized on load: 1/%d of the pool's bytes "
           "per block; on a CPU build the pool already is host memory, so the host tier pays by "
           "holding more blocks per byte)" % (kv.dtype.itemsize) if host.is_quantized
           else f"{str(kv.dtype).removeprefix('torch.')}, exact")
    logger.info("hicache host tier: %d blocks (%d tokens, %.1f MiB, %s layout), stored as %s",
                num_slots, num_slots * kv.block_size, host.nbytes / 2 ** 20,
                hicache.hicache_mem_layout, how)
    storage = None
    if hicache.hicache_storage_backend == "file":
        extra = hicache.storage_extra_config
        max_bytes = int(float(extra.get("max_size_gb", DEFAULT_STORAGE_GB)) * 1e9)
        storage = FileStorage(storage_directory(config), fingerprint(config, runner, kv),
                              host.exact_nbytes, max_bytes)
        logger.info("hicache storage tier: %s, %d blocks on disk (%.1f MiB of %.1f GB), exact "
                    "%s payloads, prefetch %s", storage.directory, storage.num_files,
                    storage.total_bytes / 2 ** 20, max_bytes / 1e9,
                    str(kv.dtype).removeprefix("torch."), hicache.hicache_storage_prefetch_policy)
    settings = HiCacheSettings(
        write_policy=hicache.hicache_write_policy,
        prefetch_policy=hicache.hicache_storage_prefetch_policy,
        prefetch_timeout_s=float(hicache.storage_extra_config.get("prefetch_timeout_s", 2.0)))
    return HiCacheController(tree, pool, host, num_slots, settings, storage)


IDLE_READ_WAIT_S = 0.01
"""How long an engine with nothing to run but requests waiting on disk reads sleeps per step."""


class HiCacheStage(Stage):
    """The hierarchical cache in the step: an idle step waits on disk reads; figures; close."""

    def __init__(self, controller: HiCacheController) -> None:
        self.controller = controller

    def wait_idle(self) -> bool:
        if not self.controller.is_holding_requests:
            return False
        self.controller.wait_for_reads(IDLE_READ_WAIT_S)
        return True

    def stats(self) -> dict[str, Any]:
        return self.controller.stats()

    def close(self) -> None:
        self.controller.close()
