"""The hierarchical cache controller over a real radix tree and block pool, with a byte-level
block mover (each device block holds bytes naming the tokens it was computed for), so a block
loaded into the wrong place, or from the wrong key, is caught by content."""

from __future__ import annotations

from pathlib import Path

from servelm.cache.block_pool import BlockPool
from servelm.cache.hicache import FileStorage, HiCacheController, HiCacheSettings, StorageFingerprint
from servelm.cache.radix_tree import RadixTree

SIZE = 4


class BytesMover:
    """Device blocks and host slots as byte strings."""

    exact_nbytes = 16
    host_nbytes = 16

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.device = [bytes(16)] * num_blocks
        self.host = [bytes(16)] * num_slots

    def to_host(self, block_id: int, slot: int) -> None:
        self.host[slot] = self.device[block_id]

    def from_host(self, slot: int, block_id: int) -> None:
        self.device[block_id] = self.host[slot]

    def read_exact(self, block_id: int) -> bytes:
        return self.device[block_id]

    def write_exact(self, block_id: int, payload: bytes) -> None:
        self.device[block_id] = payload


def content(tokens: list[int], index: int) -> bytes:
    """What the "model" writes for block ``index`` of ``tokens`` (depends on the whole prefix)."""
    return (hash(tuple(tokens[:(index + 1) * SIZE])) & (2 ** 127 - 1)).to_bytes(16, "little")


def compute(tree: RadixTree, pool: BlockPool, mover: BytesMover, tokens: list[int]) -> list[int]:
    """A request computing ``tokens`` from scratch: allocate (evicting), write, cache, release."""
    num_blocks = len(tokens) // SIZE
    if pool.num_free_blocks < num_blocks:
        tree.evict(num_blocks - pool.num_free_blocks)
    blocks = pool.allocate(num_blocks)
    assert blocks is not None
    for index, block_id in enumerate(blocks):
        mover.device[block_id] = content(tokens, index)
    tree.insert(tokens, blocks)
    pool.release(blocks)
    return blocks


def setup(num_blocks: int = 4, num_slots: int = 8, policy: str = "write_back",
          storage: FileStorage | None = None) -> tuple[RadixTree, BlockPool, BytesMover, HiCacheController]:
    pool = BlockPool(num_blocks)
    tree = RadixTree(pool, SIZE)
    mover = BytesMover(num_blocks, num_slots)
    controller = HiCacheController(tree, pool, mover, num_slots, HiCacheSettings(write_policy=policy),
                                   storage)
    return tree, pool, mover, controller


A = list(range(100, 112))  # 3 blocks
B = list(range(200, 212))


def test_eviction_demotes_and_a_match_pulls_back_the_exact_blocks() -> None:
    tree, pool, mover, controller = setup()
    compute(tree, pool, mover, A)
    compute(tree, pool, mover, B)  # needs 3 of 4 blocks: A's tail blocks are demoted
    assert controller.locate(A) == ["device", "host", "host"]
    assert controller.num_demoted_blocks == 2
    assert controller.pull_up(A, None) == 2
    assert controller.locate(A) == ["device"] * 3
    match = tree.match_prefix(A)
    assert [mover.device[b] for b in match.block_ids] == [content(A, i) for i in range(3)]
    assert controller.locate(B)[2] == "host"  # room for A's blocks came from B's tail
    assert pool.num_used_blocks == tree.num_blocks  # only the tree holds blocks


def test_pull_up_never_evicts_the_prefix_it_extends() -> None:
    tree, pool, mover, controller = setup(num_blocks=3)
    compute(tree, pool, mover, A)
    compute(tree, pool, mover, B[:8])  # A keeps its first block only
    assert controller.locate(A) == ["device", "host", "host"]
    # 3 blocks: A's first (a leaf now) must stay while room is made for its two others.
    assert controller.pull_up(A, None) == 2
    match = tree.match_prefix(A)
    assert len(match.block_ids) == 3
    assert [mover.device[b] for b in match.block_ids] == [content(A, i) for i in range(3)]


def test_write_through_copies_down_at_once_and_selective_on_the_second_match(tmp_path: Path) -> None:
    fingerprint = StorageFingerprint("m", "c", "float32", 1, 1, 4, SIZE)
    storage = FileStorage(tmp_path, fingerprint, 16, 1 << 20)
    tree, pool, mover, controller = setup(num_blocks=8, policy="write_through", storage=storage)
    compute(tree, pool, mover, A)
    assert len(controller.host) == 3
    storage.wait_idle()
    assert storage.num_files == 3
    storage.close()
    tree, pool, mover, controller = setup(num_blocks=8, policy="write_through_selective")
    compute(tree, pool, mover, A)
    assert len(controller.host) == 0
    controller.pull_up(A, None)  # first match
    assert len(controller.host) == 0
    controller.pull_up(A, None)  # second: the prefix is hot
    assert len(controller.host) == 3
