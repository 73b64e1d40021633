"""Block keys: a chained hash of the token prefix a block completes (and the LoRA adapter).

Invariant: the key of block ``i`` of a sequence depends on every token of blocks ``0..i`` and on
the adapter id, so two sequences share a key only when they share the whole prefix (the same
rule as the radix tree's paths and per-adapter roots). Keys are stable across processes and
restarts (sha256, no Python ``hash``), which is what lets the storage tier serve a new server.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_VERSION = b"servelm-kv-key-1"


def block_hashes(token_ids: Sequence[int], block_size: int, adapter_id: str | None,
                 num_blocks: int | None = None) -> list[str]:
    """Hex keys of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks by
    default); key ``i`` covers tokens ``0 .. (i + 1) * block_size``."""
    total = len(token_ids) // block_size
    if num_blocks is not None:
        total = min(total, num_blocks)
    digest = hashlib.sha256(KEY_VERSION + b"\0" + (adapter_id or "").encode()).digest()
    keys: list[str] = []
    for index in range(total):
        block = array("q", token_ids[index * block_size:(index + 1) * block_size])
        digest = hashlib.sha256(digest + block.tobytes()).digest()
        keys.append(digest.hex()[:40])
    return keys
