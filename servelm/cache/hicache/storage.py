"""The storage tier: one file per KV block under a directory, written and read by background
threads so the engine step never waits on the disk.

Layout: ``<root>/<fingerprint digest>/<block key>.kv``. A file is::

    b"SERVELMKV1\\n" | header length (4 bytes, little endian) | header (JSON) | payload

and the header names the writer's fingerprint (model, dtype, layer/head shapes, block size), the
block key, the payload size and its sha256.

Invariants:
- A file is written to ``<key>.<pid>.<thread>.tmp`` and renamed into place, so a reader sees a
  whole file or none; a file that is truncated, corrupt or from another fingerprint anyway (a
  crash before the data reached the disk, a copied directory) fails validation on read, is
  counted, deleted and skipped: the block is recomputed, never loaded wrong.
- The payload is the device block's exact bytes (no quantization), so a block served from disk
  gives the same K/V as computing it.
- The directory's total size stays under ``max_bytes``: the least recently written or read files
  go first. The index of present files is rebuilt from the directory at start (oldest mtime
  first), which is how a restarted server finds the blocks of the previous one.
- ``put`` and ``prefetch`` never block: a full write queue drops the write (counted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"SERVELMKV1\n"
SUFFIX = ".kv"


@dataclass(frozen=True)
class StorageFingerprint:
    """What must match for one server to read another's K/V."""

    model: str
    """The model path or name as loaded, plus its revision and quantization."""
    config_digest: str
    """sha256 of the model's config (architecture, sizes, rope): same name, other model -> miss."""
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class FileStorage:
    """Block key -> exact K/V bytes on disk, with background write and prefetch threads."""

    def __init__(self, root: Path, fingerprint: StorageFingerprint, payload_nbytes: int,
                 max_bytes: int, max_pending_bytes: int = 512 << 20, max_ready_blocks: int = 512) -> None:
        self.fingerprint = fingerprint
        self.payload_nbytes = payload_nbytes
        self.max_bytes = max_bytes
        self.directory = Path(root).expanduser() / fingerprint.digest()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._header = asdict(fingerprint)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        """Present files, least recently used first: key -> file size."""
        self._total_bytes = 0
        self._ready: OrderedDict[str, bytes] = OrderedDict()
        """Prefetched, validated payloads waiting to be loaded (bounded by max_ready_blocks)."""
        self._reading: set[str] = set()
        self._read_done = threading.Event()
        self._max_ready_blocks = max_ready_blocks
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue(
            max(16, max_pending_bytes // max(1, payload_nbytes)))
        """Blocks waiting for the writer thread: at most ``max_pending_bytes`` of copies."""
        self._reads: queue.Queue[str | None] = queue.Queue()
        self.num_written_blocks = 0
        self.num_written_bytes = 0
        self.num_read_blocks = 0
        self.num_read_bytes = 0
        self.num_dropped_writes = 0
        self.num_invalid_files = 0
        self.num_evicted_files = 0
        self._scan()
        self._threads = [threading.Thread(target=self._write_loop, name="hicache-write", daemon=True),
                         threading.Thread(target=self._read_loop, name="hicache-read", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _scan(self) -> None:
        entries = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):  # a write cut short by a crash: never renamed in
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                stat = path.stat()
                entries.append((stat.st_mtime, path.stem, stat.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._total_bytes += size
        self._evict_over_limit()

    # -- the engine side (never blocks) ------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._ready

    def put(self, key: str, payload: bytes) -> bool:
        """Queue a block for writing; False when it is already stored or the queue is full."""
        assert len(payload) == self.payload_nbytes, (len(payload), self.payload_nbytes)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
        try:
            self._writes.put_nowait((key, payload))
        except queue.Full:
            self.num_dropped_writes += 1
            return False
        return True

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start reading the stored ones of ``keys`` that are not read or being read yet."""
        with self._lock:
            for key in keys:
                if key in self._index and key not in self._ready and key not in self._reading:
                    self._reading.add(key)
                    self._reads.put(key)

    def is_pending(self, key: str) -> bool:
        """A prefetch of ``key`` is in flight."""
        with self._lock:
            return key in self._reading

    def ready(self, key: str) -> bytes | None:
        """The prefetched payload of ``key``, if its read finished and validated."""
        with self._lock:
            return self._ready.get(key)

    def wait_for_read(self, timeout_s: float) -> None:
        """Block until a read finishes or ``timeout_s`` passes."""
        self._read_done.wait(timeout_s)
        self._read_done.clear()

    def consume(self, key: str) -> None:
        """The payload was loaded into the device pool: drop the prefetched copy."""
        with self._lock:
            self._ready.pop(key, None)

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until queued writes are on disk (shutdown, tests)."""
        done = threading.Event()

        def drained() -> None:
            self._writes.join()
            done.set()
        threading.Thread(target=drained, daemon=True).start()
        done.wait(timeout_s)

    def close(self) -> None:
        """Finish queued writes, then stop both threads."""
        self.wait_idle()
        self._writes.put(None)
        self._reads.put(None)
        for thread in self._threads:
            thread.join(5.0)

    # -- the threads ---------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError:
                logger.warning("hicache: writing a block to %s failed", self.directory, exc_info=True)
            finally:
                self._writes.task_done()

    def _write(self, key: str, payload: bytes) -> None:
        header = json.dumps({"fingerprint": self._header, "key": key, "payload_nbytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = self._path(key)
        temp = path.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(temp, "wb") as file:
            file.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
        os.replace(temp, path)
        size = path.stat().st_size
        with self._lock:
            if key in self._index:
                self._total_bytes -= self._index[key]
            self._index[key] = size
            self._total_bytes += size
            self.num_written_blocks += 1
            self.num_written_bytes += len(payload)
            self._evict_over_limit()

    def _evict_over_limit(self) -> None:
        """Delete least recently used files until the directory fits (caller holds the lock)."""
        while self._total_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._total_bytes -= size
            self._path(key).unlink(missing_ok=True)
            self.num_evicted_files += 1

    def _read_loop(self) -> None:
        while True:
            key = self._reads.get()
            if key is None:
                return
            payload = None
            try:
                payload = self.read(key)
            except OSError:
                logger.warning("hicache: reading block %s failed", key, exc_info=True)
            with self._lock:
                self._reading.discard(key)
                self._read_done.set()
                if payload is None:
                    if key in self._index:
                        self._total_bytes -= self._index.pop(key)
                    continue
                self.num_read_blocks += 1
                self.num_read_bytes += len(payload)
                if key in self._index:
                    self._index.move_to_end(key)
                self._ready[key] = payload
                while len(self._ready) > self._max_ready_blocks:
                    self._ready.popitem(last=False)

    def read(self, key: str) -> bytes | None:
        """The validated payload of ``key``'s file; None (and the file deleted) when it is
        missing, truncated, corrupt or written for another fingerprint."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        reason = self._invalid(key, data)
        if reason is None:
            os.utime(path)  # LRU order survives a restart
            return data[-self.payload_nbytes:]
        self.num_invalid_files += 1
        logger.warning("hicache: skipping stored block %s: %s (file deleted)", path, reason)
        path.unlink(missing_ok=True)
        return None

    def _invalid(self, key: str, data: bytes) -> str | None:
        """Why ``data`` is not a valid file for ``key``, or None."""
        if not data.startswith(MAGIC):
            return "bad magic"
        start = len(MAGIC) + 4
        header_nbytes = int.from_bytes(data[len(MAGIC):start], "little")
        try:
            header = json.loads(data[start:start + header_nbytes])
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "unreadable header"
        if not isinstance(header, dict):
            return "unreadable header"
        if header.get("fingerprint") != self._header:
            return "written by another model or settings"
        if header.get("key") != key:
            return "key mismatch"
        payload = data[start + header_nbytes:]
        if header.get("payload_nbytes") != self.payload_nbytes or len(payload) != self.payload_nbytes:
            return f"truncated ({len(payload)} of {self.payload_nbytes} payload bytes)"
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return "checksum mismatch"
        return None
