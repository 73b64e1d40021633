"""The transport interface on the CPU, without sockets: descriptor runs, and the copying backends
(zmq frames, a /dev/shm file) moving blocks between two real KV pools byte for byte, float8
included."""

from __future__ import annotations

import os

import pytest
import torch

from servelm.disagg import transport
from servelm.model.kv_cache import KVCache


def test_block_runs_merge_only_blocks_consecutive_on_both_sides():
    assert transport.block_runs([4, 5, 6, 9], [0, 1, 3, 4]) == [(4, 0, 2), (6, 3, 1), (9, 4, 1)]
    assert transport.block_runs([], []) == []


def pools(dtype: torch.dtype) -> tuple[KVCache, KVCache]:
    source = KVCache(2, 8, 4, 2, 8, dtype, torch.device("cpu"))
    destination = KVCache(2, 8, 4, 2, 8, dtype, torch.device("cpu"))
    for tensor in transport.pool_regions(source):
        tensor.view(torch.uint8).copy_(torch.randint(0, 255, tensor.view(torch.uint8).shape,
                                                     dtype=torch.uint8))
    return source, destination


@pytest.mark.parametrize("backend", ["zmq", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_backends_move_blocks_byte_for_byte(backend, dtype):
    source, destination = pools(dtype)
    sender = transport.make_sender(backend, source, 5.0, "test")
    receiver = transport.make_receiver(backend, destination, "test")
    assert not receiver.is_one_sided and receiver.pull_fields("k", "127.0.0.1", [6, 2]) == {}
    outcome = sender.start("k", {}, [1, 3])
    assert outcome is not None and outcome.error is None
    assert outcome.num_bytes == 2 * 2 * 2 * 4 * 2 * 8 * dtype.itemsize  # K+V, layers, blocks, ...
    message = {"type": "kv", "key": "k", **outcome.fields}
    assert receiver.land(message, outcome.frames, [6, 2])
    for src, dst in zip(transport.pool_regions(source), transport.pool_regions(destination)):
        src_blocks, dst_blocks = src.view(torch.uint8).view(8, -1), dst.view(torch.uint8).view(8, -1)
        assert torch.equal(dst_blocks[6], src_blocks[1]) and torch.equal(dst_blocks[2], src_blocks[3])
        assert not dst_blocks[0].any()
    if backend == "shm":
        assert not os.path.exists(message["shm_path"])  # the reader deleted it
    sender.close()
    receiver.close()
