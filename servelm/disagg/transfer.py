"""The wire format of a K/V transfer and the page-wise copy out of and into a KV pool.

Messages are multipart pyzmq messages whose first frame is a JSON header (never pickle: the
bootstrap port faces the network). Decode -> prefill (DEALER -> ROUTER):
- ``pull``: key, the prompt's length and sha256, ``prefix_tokens`` (what the decode side already
  holds in its prefix cache: a multiple of the block size, never the whole prompt), ``layout``,
  ``backend``, and what a one-sided backend needs to write (``transport.py``: destination
  ``block_ids``, the pool's region addresses, the NIXL agent metadata or Mooncake session).
- ``cancel``: key (the decode request ended: the prefill side frees what it parked).
Prefill -> decode:
- ``kv``: key, ``first_token`` (+ ``logprob``), ``num_blocks`` and the K and V bytes as two more
  frames (zmq), in one file under /dev/shm named by ``shm_path`` (shm backend), or already
  written into the decode pool (nixl: with the ``nixl_pull`` id; mooncake).
- ``error``: key, ``message``.
- ``cancelled``: key (the answer to a cancel, once no write for the key is in flight).
- ``waiting``: key (a keep-alive: the request is still queued or running on the prefill server).

Block layout: every layer's K (and V) pool viewed as bytes ``[num_blocks, bytes_per_block]``; a
transfer of blocks b_0..b_n-1 is ``[num_layers, n, bytes_per_block]`` uint8, K then V. Bytes are
copied as stored, so float8 K/V (``--kv-cache-dtype fp8_*``) crosses as one byte per element.
Both sides must have the same ``layout`` (model, page size, KV dtype), checked on every pull.
A tensor-parallel server's pool (``workers/kv_shards.ShardedKV``) reads and writes every KV head
in this same layout, gathering its ranks' heads or splitting them over its ranks, so the layout
does not depend on either side's --tp-size; the pull names the decode side's tp, which the
prefill side checks against its --disaggregation-decode-tp (SGLang's meaning).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import torch

from servelm.model.kv_cache import KVCache
from servelm.sampling.logprobs import TokenLogprob

SHM_DIR = "/dev/shm"


def layout(cache: KVCache) -> dict[str, Any]:
    """What must agree between the two pools for their blocks to be interchangeable."""
    return {"num_layers": cache.num_layers, "block_size": cache.block_size,
            "num_kv_heads": cache.num_kv_heads, "head_dim": cache.head_dim,
            "dtype": str(cache.dtype).removeprefix("torch.")}


def tp_size(cache: KVCache) -> int:
    """Ranks the pool is split over (a tensor-parallel server's ``ShardedKV``; 1 for a KVCache).
    Only checked against --disaggregation-decode-tp: the wire always carries every KV head."""
    return int(getattr(cache, "tp_size", 1))


def bytes_per_block(cache: KVCache) -> int:
    """Bytes one block of one layer's K (or V) takes."""
    return cache.block_size * cache.num_kv_heads * cache.head_dim * cache.dtype.itemsize


def prompt_digest(token_ids: list[int]) -> str:
    """sha256 of the prompt's token ids: both sides must have tokenized the same prompt."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


def read_blocks(cache: KVCache, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block_ids``, ``[num_layers, len(block_ids), bytes_per_block]`` uint8 each
    (every KV head of the model: a tensor-parallel server's ``ShardedKV`` gathers its ranks')."""
    return cache.read_blocks(block_ids)


def write_blocks(cache: KVCache, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``read_blocks``' output at ``block_ids`` of this pool (split over the ranks of a
    tensor-parallel server)."""
    cache.write_blocks(block_ids, k, v)


def encode_logprob(entry: TokenLogprob | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"token_id": entry.token_id, "logprob": entry.logprob, "top": [list(t) for t in entry.top]}


def decode_logprob(entry: dict[str, Any] | None) -> TokenLogprob | None:
    if entry is None:
        return None
    return TokenLogprob(int(entry["token_id"]), float(entry["logprob"]),
                        [(int(t), float(p)) for t, p in entry["top"]])


def header(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def parse_header(frame: bytes) -> dict[str, Any]:
    message = json.loads(frame)
    if not isinstance(message, dict) or not isinstance(message.get("key"), str):
        raise ValueError("malformed transfer message")
    return message


def write_shm(k: torch.Tensor, v: torch.Tensor) -> str:
    """The shm backend: K then V bytes in a new file under /dev/shm (memory, not disk); the reader
    deletes it, the writer deletes leftovers after the transfer timeout."""
    path = os.path.join(SHM_DIR, f"servelm-kv-{uuid.uuid4().hex}")
    with open(path, "wb") as file:
        file.write(k.numpy().tobytes())
        file.write(v.numpy().tobytes())
    return path


def read_shm(path: str, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if not os.path.basename(path).startswith("servelm-kv-") or os.path.dirname(path) != SHM_DIR:
        raise ValueError(f"unexpected shared-memory path {path!r}")
    with open(path, "rb") as file:
        data = file.read()
    os.remove(path)
    k_bytes = shape[0] * shape[1] * shape[2]
    return frames_to_blocks([data[:k_bytes], data[k_bytes:]], shape)


def frames_to_blocks(frames: list[bytes], shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V blocks ``shape`` (uint8 bytes) from their two frames; an empty V frame is a latent
    pool's (multi-head latent attention keeps V inside K's rows: ``LatentKVCache``)."""
    k = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).view(shape)
    if not frames[1]:
        return k, k.new_empty(shape[0], shape[1], 0)
    v = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8).view(shape)
    return k, v
