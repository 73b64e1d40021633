"""The file storage tier and the host index (no model, no torch): round trips across a
"restart", files cut short or corrupted mid-write, another model's files, the size limit."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from servelm.cache.hicache import FileStorage, StorageFingerprint, block_hashes
from servelm.cache.hicache.host_index import HostIndex

FINGERPRINT = StorageFingerprint(model="tiny@#none", config_digest="c0ffee", kv_dtype="float32",
                                 num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
PAYLOAD = 64


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 256 for i in range(PAYLOAD))


def open_storage(root: Path, fingerprint: StorageFingerprint = FINGERPRINT,
                 max_bytes: int = 1 << 30) -> FileStorage:
    return FileStorage(root, fingerprint, PAYLOAD, max_bytes)


def read_through(storage: FileStorage, key: str) -> bytes | None:
    storage.prefetch([key])
    while storage.is_pending(key):
        storage.wait_for_read(1.0)
    return storage.ready(key)


def test_keys_chain_the_whole_prefix_and_the_adapter() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None)
    assert len(a) == 2
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4, None)[0] == a[0]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4, None)[1] != a[1]
    assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, None)[1] != a[1]  # same block, other prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "sql")[0] != a[0]


def test_blocks_survive_a_restart(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    assert storage.put("k1", payload(1)) and storage.put("k2", payload(2))
    storage.close()
    again = open_storage(tmp_path)
    assert again.num_files == 2 and again.contains("k1")
    assert read_through(again, "k1") == payload(1)
    assert read_through(again, "missing") is None
    again.close()


def test_truncated_and_corrupt_files_are_skipped_and_deleted(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    for index in range(3):
        storage.put(f"k{index}", payload(index))
    storage.close()
    directory = storage.directory
    whole = (directory / "k0.kv").read_bytes()
    (directory / "k0.kv").write_bytes(whole[:len(whole) - 10])  # cut short mid-payload
    corrupt = bytearray((directory / "k1.kv").read_bytes())
    corrupt[-1] ^= 0xFF
    (directory / "k1.kv").write_bytes(bytes(corrupt))
    (directory / "k9.123.456.tmp").write_bytes(whole[:20])  # a write killed before its rename
    again = open_storage(tmp_path)
    assert not (directory / "k9.123.456.tmp").exists()
    assert read_through(again, "k0") is None and read_through(again, "k1") is None
    assert read_through(again, "k2") == payload(2)
    assert again.num_invalid_files == 2 and again.num_files == 1
    assert not (directory / "k0.kv").exists() and not (directory / "k1.kv").exists()
    again.close()


def test_another_models_files_are_never_read(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    storage.put("k1", payload(1))
    storage.close()
    other_fingerprint = dataclasses.replace(FINGERPRINT, config_digest="beef")
    other = open_storage(tmp_path, other_fingerprint)
    assert other.directory != storage.directory and not other.contains("k1")
    # Even a file copied into its directory by hand fails the header check.
    os.link(storage.directory / "k1.kv", other.directory / "k1.kv")
    other.close()
    other = open_storage(tmp_path, other_fingerprint)
    assert read_through(other, "k1") is None and other.num_invalid_files == 1
    other.close()
    assert (storage.directory / "k1.kv").exists()


def test_size_limit_deletes_least_recently_used(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    storage.put("k0", payload(0))
    storage.close()
    file_bytes = (storage.directory / "k0.kv").stat().st_size
    limited = open_storage(tmp_path, max_bytes=3 * file_bytes)
    for index in (1, 2):
        limited.put(f"k{index}", payload(index))
        limited.wait_idle()
    assert read_through(limited, "k0") == payload(0)  # k0 is now the most recently used
    limited.put("k3", payload(3))
    limited.wait_idle()
    assert limited.num_files == 3 and not limited.contains("k1") and limited.contains("k0")
    assert limited.total_bytes <= 3 * file_bytes and limited.num_evicted_files == 1
    limited.close()


def test_host_index_evicts_lru_but_never_a_pinned_key() -> None:
    index = HostIndex(2)
    assert index.assign("a") is not None and index.assign("b") is not None
    index.get("a")
    index.pinned.add("a")
    slot_c = index.assign("c")  # b is the least recently used
    assert slot_c is not None and "b" not in index and "a" in index
    index.pinned.add("c")
    assert index.assign("d") is None


WRITER = """
import sys
from pathlib import Path
from servelm.cache.hicache import FileStorage, StorageFingerprint
fingerprint = StorageFingerprint(model="tiny@#none", config_digest="c0ffee", kv_dtype="float32",
                                 num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
storage = FileStorage(Path(sys.argv[1]), fingerprint, int(sys.argv[2]), 1 << 40)
index = 0
while True:
    storage.put(f"k{index}", bytes([index % 256]) * int(sys.argv[2]))
    index += 1
    if index % 8 == 0:
        storage.wait_idle()
        print(index, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_a_cache_that_loads(tmp_path: Path) -> None:
    """SIGKILL a process that is writing 4 MiB blocks: whatever it left (whole files, temp files
    cut short) opens, and every file that reads back holds exactly what was written."""
    import signal
    import subprocess
    import sys

    size = 4 << 20
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(size)],
                             stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[3])
    try:
        assert child.stdout is not None
        child.stdout.readline()  # 8 blocks queued and written: more are in flight
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    storage = FileStorage(tmp_path, FINGERPRINT, size, 1 << 40)
    try:
        keys = [path.stem for path in storage.directory.glob("*.kv")]
        assert len(keys) >= 8 and not list(storage.directory.glob("*.tmp"))
        for key in keys:
            data = read_through(storage, key)
            assert data is None or data == bytes([int(key[1:]) % 256]) * size
            storage.consume(key)
    finally:
        storage.close()
