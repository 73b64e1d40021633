"""The encoder cache: an image's encoded rows by its digest, so a repeated image is not encoded again.

A small LRU bounded in bytes and in images (``--encoder-cache-capacity``, LightLLM's
``--cache_capacity``: a count of images; 0 turns the cache off). It lives beside the model on each rank
(``ModelRunner.encoder_cache``) and holds the projector's output, ``[tokens, hidden]`` in the model
dtype. An image bigger than the whole capacity is encoded every time it is needed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_ENCODER_CACHE_BYTES = 256 * 2 ** 20
"""256 MiB: ~500 Gemma 3 4B images (256 rows x 2560 x bf16 = 1.25 MiB each)."""


class EncoderCache:
    """digest -> encoded rows, least recently used evicted first; ``capacity_bytes`` or
    ``capacity_items`` 0 disables it."""

    def __init__(self, capacity_bytes: int = DEFAULT_ENCODER_CACHE_BYTES, capacity_items: int = 200) -> None:
        self.capacity_bytes = capacity_bytes
        self.capacity_items = capacity_items
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.num_encoded = 0
        """Images the tower encoded (every miss is encoded once per pass that needs it)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self._entries.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        size = rows.nbytes
        if size > self.capacity_bytes or self.capacity_items <= 0:
            return
        old = self._entries.pop(digest, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self._entries and (self.nbytes + size > self.capacity_bytes
                                 or len(self._entries) >= self.capacity_items):
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
        self._entries[digest] = rows
        self.nbytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.nbytes, "capacity_bytes": self.capacity_bytes,
                "hits": self.hits, "misses": self.misses, "encoded": self.num_encoded}
