"""The ``mooncake`` transfer backend: Mooncake's transfer engine (the ``-non-cuda`` build, over
TCP) WRITEs the K/V from the prefill pool into the decode pool, one-sided like ``nixl``.

- Decode side (``MooncakeReceiver``): a transfer engine in peer-to-peer handshake mode (no
  metadata server) registers every layer's K and V tensor of the pool; it is named by this
  host's address on the route toward the prefill server (one engine per such address). Each
  pull carries that engine's session (``ip:rpc_port``), the regions' base addresses and the
  destination block ids.
- Prefill side (``MooncakeSender``): its engine registers its own pool and submits one batch of
  writes (one per run of blocks consecutive on both sides, per region) on a worker thread, since
  Mooncake's batch write blocks; ``start`` waits for it up to ``DRIVE_S`` (a write still
  running then is collected by ``poll`` in a later step), and the ``kv`` reply goes out over zmq.
  (Left to ``poll`` alone, every write waited at least one more prefill step: seconds behind a
  long prompt's chunk.)
  The write has returned, so the bytes are in the decode pool when the reply is sent: the decode
  side needs no further notice.
"""

from __future__ import annotations

import importlib
import logging
import socket
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from servelm.disagg import transfer
from servelm.disagg.transport import Outcome, block_runs, pool_regions
from servelm.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

DRIVE_S = 0.05
"""How long ``start`` waits for a new write before leaving it to the next steps' ``poll``."""


def _engine(device: str | None, host: str) -> tuple[Any, str]:
    """A started transfer engine named ``host`` (the address its peers reach it by) and its
    session name (``host:rpc_port``)."""
    try:
        module = importlib.import_module("mooncake.engine")
    except ImportError as error:
        raise ImportError("--disaggregation-transfer-backend mooncake needs Mooncake's transfer "
                          "engine: pip install mooncake-transfer-engine-non-cuda (and apt-get "
                          f"install libibverbs1): {error}") from None
    engine = module.TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", device or "") != 0:
        raise RuntimeError("Mooncake's transfer engine did not start (tcp, peer-to-peer handshake)")
    return engine, f"{host}:{engine.get_rpc_port()}"


def _local_ip(toward: str = "10.255.255.255") -> str:
    """This host's address on the route toward ``toward`` (the default route unless given; no
    packet is sent); 127.0.0.1 without one."""
    try:
        family = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((toward, 1))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _register(engine: Any, cache: KVCache) -> None:
    for tensor in pool_regions(cache):
        if engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
            raise RuntimeError("Mooncake's transfer engine could not register the KV pool")


def _unregister(engine: Any, cache: KVCache) -> None:
    for tensor in pool_regions(cache):
        engine.unregister_memory(tensor.data_ptr())


@dataclass(slots=True)
class _Write:
    future: Future[int]
    session: str
    num_bytes: int


def _outcome(write: _Write) -> Outcome:
    """A finished write's outcome."""
    error = write.future.exception()
    status = write.future.result() if error is None else None
    if status == 0:
        return Outcome(num_bytes=write.num_bytes)
    return Outcome(error=f"the Mooncake write to {write.session} failed "
                         f"({error or status}; the decode server may be gone)")


class MooncakeSender:
    """The prefill side: batch writes into the pullers' registered pools, on one worker thread."""

    def __init__(self, cache: KVCache, device: str | None = None) -> None:
        self.cache = cache
        self.engine, self.session = _engine(device, _local_ip())
        _register(self.engine, cache)
        self.regions = [t.data_ptr() for t in pool_regions(cache)]
        self.bytes_per_block = transfer.bytes_per_block(cache)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="servelm-mooncake")
        self.writes: dict[str, _Write] = {}

    def start(self, key: str, pull: dict[str, Any], block_ids: list[int]) -> Outcome | None:
        try:
            session = str(pull["mooncake_session"])
            destination = [int(b) for b in pull["block_ids"]]
            addresses = [int(a) for a in pull["mooncake_addresses"]]
        except (KeyError, TypeError, ValueError) as error:
            return Outcome(error=f"a mooncake pull needs the decode engine's session, addresses "
                                 f"and block ids: {error}")
        if len(destination) != len(block_ids) or len(addresses) != len(self.regions):
            return Outcome(error=f"the pull names {len(destination)} blocks in {len(addresses)} "
                                 f"regions; {len(block_ids)} blocks in {len(self.regions)} expected")
        size = self.bytes_per_block
        sources, targets, lengths = [], [], []
        for local_base, remote_base in zip(self.regions, addresses):
            for first_source, first_destination, count in block_runs(block_ids, destination):
                sources.append(local_base + first_source * size)
                targets.append(remote_base + first_destination * size)
                lengths.append(count * size)
        future = self.worker.submit(self.engine.batch_transfer_sync_write, session, sources,
                                    targets, lengths)
        write = _Write(future, session, sum(lengths))
        if wait([future], timeout=DRIVE_S).done:
            return _outcome(write)
        self.writes[key] = write
        return None

    def poll(self, now: float) -> list[tuple[str, Outcome]]:
        ended = []
        for key, write in list(self.writes.items()):
            if write.future.done():
                del self.writes[key]
                ended.append((key, _outcome(write)))
        return ended

    def abandon(self, key: str) -> bool:
        write = self.writes.get(key)
        if write is None or write.future.cancel():  # not started yet: it never will
            self.writes.pop(key, None)
            return True
        return False  # running: a blocking write cannot be stopped

    def close(self) -> None:
        for key in list(self.writes):
            self.abandon(key)
        self.worker.shutdown(wait=True)
        _unregister(self.engine, self.cache)


class MooncakeReceiver:
    """The decode side: a registered pool the prefill servers write into.

    A Mooncake peer sends its data to the address the engine was started with, so the pool is
    registered with one engine per local address that prefill servers are reached from (the
    address on the route toward each; usually one)."""

    is_one_sided = True

    def __init__(self, cache: KVCache, device: str | None = None) -> None:
        self.cache = cache
        self.device = device
        self.addresses = [t.data_ptr() for t in pool_regions(cache)]
        self.engines: dict[str, tuple[Any, str]] = {}
        """Local address -> its engine and session."""
        self.sessions: dict[str, str] = {}
        """Prefill host -> the session it writes to."""
        self._session_from(_local_ip())  # fails start-up, not the first pull, without the package

    def _session_from(self, local_ip: str) -> str:
        if local_ip not in self.engines:
            engine, session = _engine(self.device, local_ip)
            _register(engine, self.cache)
            self.engines[local_ip] = (engine, session)
        return self.engines[local_ip][1]

    def pull_fields(self, key: str, host: str, block_ids: list[int]) -> dict[str, Any]:
        session = self.sessions.get(host)
        if session is None:
            session = self.sessions[host] = self._session_from(_local_ip(host))
        return {"mooncake_session": session, "mooncake_addresses": self.addresses,
                "block_ids": block_ids}

    def land(self, message: dict[str, Any], frames: list[bytes], block_ids: list[int]) -> bool:
        return True  # the prefill side replies after its write returned

    def discard(self, message: dict[str, Any]) -> None:
        pass

    def progress(self) -> None:
        pass

    def close(self) -> None:
        for engine, _ in self.engines.values():
            _unregister(engine, self.cache)
