"""Tiers below the device KV pool (issue 18): block keys, the host-tier index, the file storage
tier and the controller that moves blocks between them. No torch here: the controller moves
bytes through a ``BlockMover`` (servelm.model.kv_tiers implements it over the KV tensors)."""

from servelm.cache.hicache.controller import BlockMover, HiCacheController, HiCacheSettings
from servelm.cache.hicache.keys import block_hashes
from servelm.cache.hicache.storage import FileStorage, StorageFingerprint

__all__ = ["BlockMover", "FileStorage", "HiCacheController", "HiCacheSettings",
           "StorageFingerprint", "block_hashes"]
