"""How the K/V bytes of a transfer cross from the prefill pool to the decode pool: one small
interface, one class per ``--disaggregation-transfer-backend``.

The control messages (pull, cancel, waiting, kv, error, cancelled: ``transfer.py``) always travel
over the bootstrap zmq channel; a backend decides only how the bytes go:
- ``zmq``: two more frames of the ``kv`` reply (TCP, works across machines).
- ``shm``: a file under /dev/shm named in the reply (one host).
- ``nixl`` (``nixl_transport.py``) and ``mooncake`` (``mooncake_transport.py``): the decode side
  registers its pool with the library and names its destination blocks in the pull; the prefill
  side WRITEs its source blocks straight into them (one-sided), then sends the ``kv`` reply.

Invariants:
- ``Sender.start`` either finishes at once (returns the ``Outcome``) or leaves the write in
  flight, and then ``poll`` returns its ``Outcome`` exactly once, unless ``abandon`` took it.
  The prefill side frees the source blocks only after the outcome (or a successful abandon).
- ``Receiver.land`` puts a ``kv`` reply's K/V into the destination blocks (two-sided backends
  copy it there; one-sided ones check it has landed); False means "not yet, ask again".
- With a one-sided receiver (``is_one_sided``) the destination blocks may be written by the peer
  until the pull's final reply (kv, error or the cancel's ``cancelled``): the decode side keeps
  them allocated until then, even when the request ended first.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from servelm.disagg import transfer
from servelm.model.kv_cache import KVCache


ONE_SIDED = {"nixl", "mooncake"}
"""Backends whose prefill side writes into the decode pool itself (their pulls name the
destination); zmq and shm interoperate (the decode side reads either reply)."""


@dataclass(slots=True)
class Outcome:
    """A finished send: what the ``kv`` reply carries besides the header, or why it failed."""

    fields: dict[str, Any] = field(default_factory=dict)
    """Extra header fields (the shm path, the pull's id for a one-sided write)."""
    frames: list[bytes] = field(default_factory=list)
    """Payload frames after the header (zmq: K bytes, V bytes)."""
    num_bytes: int = 0
    error: str | None = None


class Sender(Protocol):
    """The prefill side of a backend: moves source blocks to the puller."""

    def start(self, key: str, pull: dict[str, Any], block_ids: list[int]) -> Outcome | None:
        """Begin moving ``block_ids`` (in order) to the destination the ``pull`` names. Returns the
        outcome now, or None while the write is in flight (``poll`` returns it)."""
        ...

    def poll(self, now: float) -> list[tuple[str, Outcome]]:
        """The writes that ended since the last call, by key; also expires leftovers."""
        ...

    def abandon(self, key: str) -> bool:
        """Give up the key's write in flight; False if it could not be stopped (its source
        blocks must then stay allocated)."""
        ...

    def close(self) -> None: ...


class Receiver(Protocol):
    """The decode side of a backend: where K/V lands in this pool."""

    is_one_sided: bool
    """The peer writes into this pool's memory itself (nixl, mooncake)."""

    def pull_fields(self, key: str, host: str, block_ids: list[int]) -> dict[str, Any]:
        """What the pull to the prefill server at ``host`` must tell it so it can send into
        ``block_ids``."""
        ...

    def land(self, message: dict[str, Any], frames: list[bytes], block_ids: list[int]) -> bool:
        """The ``kv`` reply's K/V into ``block_ids``: True when it is there, False when not yet
        (call again). ValueError (or OSError, RuntimeError) when it cannot be read."""
        ...

    def discard(self, message: dict[str, Any]) -> None:
        """A ``kv`` reply nobody waits for any more: drop what it left behind."""
        ...

    def progress(self) -> None:
        """Let the library move what is in flight (one-sided backends without a thread)."""
        ...

    def close(self) -> None: ...


def shape(cache: KVCache, num_blocks: int) -> tuple[int, int, int]:
    return (cache.num_layers, num_blocks, transfer.bytes_per_block(cache))


class _CopySender:
    """Copies the blocks out of the pool at once (zmq frames or a /dev/shm file)."""

    def __init__(self, cache: KVCache, timeout_s: float, use_shm: bool) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.shm_files: list[tuple[str, float]] = []
        """Files written and when they expire (a decode side that never read them)."""

    def start(self, key: str, pull: dict[str, Any], block_ids: list[int]) -> Outcome | None:
        k, v = transfer.read_blocks(self.cache, block_ids)
        num_bytes = k.numel() + v.numel()
        if self.use_shm:
            path = transfer.write_shm(k, v)
            self.shm_files.append((path, time.monotonic() + self.timeout_s))
            return Outcome({"shm_path": path}, num_bytes=num_bytes)
        return Outcome(frames=[k.numpy().tobytes(), v.numpy().tobytes()], num_bytes=num_bytes)

    def poll(self, now: float) -> list[tuple[str, Outcome]]:
        while self.shm_files and self.shm_files[0][1] < now:
            remove_file(self.shm_files.pop(0)[0])
        return []

    def abandon(self, key: str) -> bool:
        return True

    def close(self) -> None:
        for path, _ in self.shm_files:
            remove_file(path)


class _CopyReceiver:
    """Copies the bytes of the reply (frames or a /dev/shm file) into the destination blocks."""

    is_one_sided = False

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def pull_fields(self, key: str, host: str, block_ids: list[int]) -> dict[str, Any]:
        return {}

    def land(self, message: dict[str, Any], frames: list[bytes], block_ids: list[int]) -> bool:
        blocks_shape = shape(self.cache, len(block_ids))
        shm_path = message.get("shm_path")
        if isinstance(shm_path, str):
            k, v = transfer.read_shm(shm_path, blocks_shape)
        else:
            if len(frames) != 2:
                raise ValueError(f"expected the K and V frames, got {len(frames)} frames")
            k, v = transfer.frames_to_blocks(frames, blocks_shape)
        transfer.write_blocks(self.cache, block_ids, k, v)
        return True

    def discard(self, message: dict[str, Any]) -> None:
        shm_path = message.get("shm_path")
        if isinstance(shm_path, str) and shm_path.startswith(transfer.SHM_DIR + "/servelm-kv-"):
            remove_file(shm_path)

    def progress(self) -> None:
        pass

    def close(self) -> None:
        pass


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def make_sender(backend: str, cache: KVCache, timeout_s: float, engine_id: str,
                device: str | None = None) -> Sender:
    """The prefill side of ``backend`` for this pool (``device``: --disaggregation-ib-device)."""
    if backend == "nixl":
        from servelm.disagg.nixl_transport import NixlSender
        return NixlSender(cache, engine_id, device)
    if backend == "mooncake":
        from servelm.disagg.mooncake_transport import MooncakeSender
        return MooncakeSender(cache, device)
    return _CopySender(cache, timeout_s, use_shm=backend == "shm")


def make_receiver(backend: str, cache: KVCache, engine_id: str,
                  device: str | None = None) -> Receiver:
    """The decode side of ``backend`` for this pool (``device``: --disaggregation-ib-device)."""
    if backend == "nixl":
        from servelm.disagg.nixl_transport import NixlReceiver
        return NixlReceiver(cache, engine_id, device)
    if backend == "mooncake":
        from servelm.disagg.mooncake_transport import MooncakeReceiver
        return MooncakeReceiver(cache, device)
    return _CopyReceiver(cache)


def pool_regions(cache: KVCache) -> list[torch.Tensor]:
    """Every layer's K then every layer's V tensor: the regions a one-sided backend registers,
    in the order their base addresses travel in a pull."""
    return [*cache.k_caches, *cache.v_caches]


def block_runs(source: list[int], destination: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of the runs that are consecutive on
    both sides: one descriptor per run and region instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(source, destination):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            first_s, first_d, count = runs[-1]
            runs[-1] = (first_s, first_d, count + 1)
        else:
            runs.append((s, d, 1))
    return runs
