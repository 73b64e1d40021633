"""All-reduce between the tensor-parallel ranks of one host through shared memory.

gloo over loopback costs a few hundred microseconds per call even for one token's hidden state
(two all-reduces per layer per step add up to milliseconds); copying into a shared segment and
summing there costs tens of microseconds. This is servelm's "custom all-reduce"
(``--disable-custom-all-reduce`` turns it off); tensors bigger than a slot, and every other
collective, still go through the process group.

Segment layout (one file in /dev/shm, mapped by every rank; rank 0 creates it and unlinks it once
every rank has mapped it, so no crash can leak it)::

    [flags: world_size x 64 bytes, one int64 generation counter per rank, one cache line each]
    [buffer 0: world_size slots of slot_bytes] [buffer 1: world_size slots of slot_bytes]

plus one FIFO per rank (``<segment>.wake<rank>``): after publishing, a rank writes a byte to each
peer's FIFO, so a waiter that stopped spinning sleeps in the kernel until a peer arrives.

Invariants:
- Call g (1, 2, ...) uses buffer g % 2. A rank copies its tensor into its slot, then publishes
  g in its flag, waits until every flag is >= g, then sums all slots in rank order into its tensor.
  Every rank sums the same values in the same order, so all ranks get bitwise-equal results.
- A slot is rewritten only two calls later; by then its readers have published a later generation,
  which they do only after summing, so a slot is never overwritten while it is read.
- Publication relies on x86-64's store order (data stores are visible before the flag store); other
  architectures use the process group instead (``is_supported``).
- A rank that does not arrive within ``timeout_s`` raises RuntimeError instead of spinning forever;
  a dead peer raises sooner, through ``check_peers``.
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import time
import uuid
from collections.abc import Callable

import torch

_FLAG_STRIDE = 8
"""int64 entries between two ranks' flags (64 bytes: one cache line each)."""
_SPIN_S = 30e-6
"""How long a waiter busy-polls before it blocks on its wake-up FIFO. Ranks arriving together meet
within the spin; past it the peer is still computing, and a spinning waiter would burn CPU time the
scheduler then takes back from its own compute (measured: spinning for milliseconds made decode
steps slower than gloo on a loaded host)."""
_BLOCK_S = 0.5
"""Longest block on the FIFO before re-checking the peers and the timeout."""

DEFAULT_SLOT_BYTES = 4 << 20
"""Per-rank slot: 4 MiB holds a decode or mixed step's hidden states ([1,024 tokens, 1,024] float32);
larger prefills take the process group, where their compute dwarfs the transfer."""


def is_supported(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def create_segment(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> str:
    """Create the zero-filled segment file; returns its path (rank 0, before starting the others)."""
    path = f"/dev/shm/servelm-allreduce-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as segment:
        segment.truncate(segment_bytes(world_size, slot_bytes))
    for rank in range(world_size):
        os.mkfifo(wake_path(path, rank))
    return path


def wake_path(path: str, rank: int) -> str:
    return f"{path}.wake{rank}"


def unlink_segment(path: str, world_size: int) -> None:
    """Remove the segment and its FIFOs (mapped and opened ones stay usable)."""
    for name in [path] + [wake_path(path, rank) for rank in range(world_size)]:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * _FLAG_STRIDE * 8 + 2 * world_size * slot_bytes


class ShmAllReduce:
    """Sum a CPU tensor over the ranks of one host through the shared segment at ``path``."""

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, check_peers: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.check_peers = check_peers
        """Raises when a peer process is gone; called while waiting (rank 0 watches its workers,
        the workers die with rank 0's process)."""
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        with open(path, "r+b") as segment:
            self._map = mmap.mmap(segment.fileno(), segment_bytes(world_size, slot_bytes))
        memory = torch.frombuffer(self._map, dtype=torch.uint8)
        flag_bytes = world_size * _FLAG_STRIDE * 8
        self._flags = memory[:flag_bytes].view(torch.int64)[::_FLAG_STRIDE]  # [world_size]
        self._slots = memory[flag_bytes:].view(2, world_size, slot_bytes)
        self._generation = 0
        # O_RDWR: opening a FIFO never blocks then, whether or not its peer has opened it yet.
        self._wake_fds = [os.open(wake_path(path, r), os.O_RDWR | os.O_NONBLOCK) for r in range(world_size)]

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (every rank calls it with the same shape/dtype)."""
        assert self.fits(tensor), "tensor larger than a shared-memory slot"
        self._generation += 1
        generation = self._generation
        slots = self._slots[generation % 2]
        num_bytes = tensor.numel() * tensor.element_size()
        views = [slots[r, :num_bytes].view(tensor.dtype).view(tensor.shape) for r in range(self.world_size)]
        views[self.rank].copy_(tensor)
        self._flags[self.rank] = generation
        for rank, fd in enumerate(self._wake_fds):
            if rank != self.rank:
                try:
                    os.write(fd, b"w")
                except BlockingIOError:  # the FIFO is full of unread wake-ups: the peer wakes anyway
                    pass
        self._wait_for(generation)
        torch.add(views[0], views[1], out=tensor)
        for view in views[2:]:
            tensor.add_(view)
        return tensor

    def _wait_for(self, generation: int) -> None:
        flags = self._flags
        started_s = time.perf_counter()
        while int(flags.min()) < generation:
            waited_s = time.perf_counter() - started_s
            if waited_s < _SPIN_S:
                continue
            own = self._wake_fds[self.rank]
            if select.select([own], [], [], _BLOCK_S)[0]:
                try:
                    os.read(own, 4096)  # drain; stale wake-ups only cost a re-check
                except BlockingIOError:
                    pass
                continue
            if self.check_peers is not None:
                self.check_peers()
            if waited_s > self.timeout_s:
                late = [r for r in range(self.world_size) if int(flags[r]) < generation]
                raise RuntimeError(f"shared-memory all-reduce: ranks {late} did not arrive "
                                   f"within {self.timeout_s:g} s")

    def close(self) -> None:
        del self._flags, self._slots
        self._map.close()
        for fd in self._wake_fds:
            os.close(fd)
