"""The ``nixl`` transfer backend: NVIDIA's NIXL library moves the K/V with one-sided WRITEs from
the prefill pool into the decode pool (over UCX; DRAM to DRAM on a CPU build, VRAM with CUDA).

- Decode side (``NixlReceiver``): a NIXL agent registers every layer's K and V tensor of the pool
  at start-up. Each pull carries the agent's metadata (its UCX address and registered regions,
  base64), the regions' base addresses, the destination block ids and a fresh pull id.
- Prefill side (``NixlSender``): its agent registers its own pool, loads the puller's metadata the
  first time it sees that agent, and posts one WRITE whose descriptors are the runs of blocks
  consecutive on both sides, per region; the transfer carries the pull id as its NIXL
  notification. When the WRITE is done the ``kv`` reply goes out over zmq with the pull id.
- The decode side counts the K/V landed when it holds both the reply and the notification (the
  notification follows the data on the same connection).

On a host without RDMA devices (no /sys/class/infiniband entries) UCX's InfiniBand modules are
not loaded (``UCX_MODULES=^ib``, unless set already): loading them there only finds the system's
libibverbs providers, whose second copy of libnl crashes the process at exit.
``--disaggregation-ib-device`` names the UCX devices to use (NIXL's ``ucx_devices``).

Agents run without NIXL's progress thread (it spins a core even when idle; these machines have
two). A WRITE completes only once the decode agent has progressed too (UCX acknowledges it from
there; on one host the bytes themselves move at once, by cross-memory attach), and the ``kv``
reply goes out only once the prefill side has seen it complete. So:
- the decode side reads notifications on a short timer (``POLL_INTERVAL_S``) from a thread of its
  own while pulls are outstanding (the engine's calls to ``progress``, each step while blocks are
  held, keep it going for ``ACTIVE_S``), also while its engine runs a forward pass; idle, the
  thread sleeps on an event;
- the prefill side drives a new write for up to ``DRIVE_S`` right after posting it (the decode
  thread acknowledges it within a millisecond or two), and only a write still unfinished then
  waits for the engine's next steps (``poll``). Before, every write waited at least one more
  prefill step (a long prompt's chunk: seconds) and the decode side's next step.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from servelm.disagg import transfer
from servelm.disagg.transport import Outcome, block_runs, pool_regions
from servelm.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

RDMA_DEVICES_DIR = "/sys/class/infiniband"
NOTIFICATION_KEEP_S = 600.0
"""How long a notification nobody claimed is kept (its reply may still be on its way)."""
DRIVE_S = 0.05
"""How long the prefill side checks a new write's state before leaving it to the next steps."""
POLL_INTERVAL_S = 0.001
"""How often the decode side's thread reads notifications while pulls are outstanding."""
ACTIVE_S = 2.0
"""The decode side's thread stops polling this long after the engine's last ``progress`` call
(nothing is in flight any more)."""


def load_nixl() -> tuple[ModuleType, tuple[type[BaseException], ...]]:
    """NIXL's Python API and the exception classes its bindings raise. The ``nixl`` package
    picks the build for the installed CUDA; ``nixl-cu12`` alone works too."""
    for package in ("nixl", "nixl_cu12"):
        try:
            _api = importlib.import_module(f"{package}._api")
            _bindings = importlib.import_module(f"{package}._bindings")
            break
        except ImportError:
            continue
    else:
        raise ImportError("--disaggregation-transfer-backend nixl needs NIXL: pip install "
                          "--no-deps nixl nixl-cu12")
    errors = tuple(getattr(_bindings, name) for name in dir(_bindings)
                   if name.startswith("nixl") and name.endswith("Error"))
    return _api, errors


def _has_rdma_devices() -> bool:
    return os.path.isdir(RDMA_DEVICES_DIR) and bool(os.listdir(RDMA_DEVICES_DIR))


def _agent(api: ModuleType, role: str, engine_id: str, cache: KVCache,
           devices: str | None) -> tuple[Any, Any]:
    if devices is None and not _has_rdma_devices():
        os.environ.setdefault("UCX_MODULES", "^ib")
    agent = api.nixl_agent(f"servelm-{role}-{engine_id}-{uuid.uuid4().hex[:8]}",
                           api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    if "UCX" not in agent.get_plugin_list():
        raise RuntimeError("NIXL has no UCX plugin here; --disaggregation-transfer-backend nixl "
                           "needs it")
    agent.create_backend("UCX", {"ucx_devices": devices} if devices else {})
    registered = agent.register_memory(pool_regions(cache))
    return agent, registered


def _mem_type(cache: KVCache) -> tuple[str, int]:
    device = cache.k_caches[0].device if cache.k_caches else None
    if device is not None and device.type == "cuda":
        return "VRAM", device.index or 0
    return "DRAM", 0


@dataclass(slots=True)
class _Write:
    handle: Any
    pull_id: str
    agent_name: str
    num_bytes: int


class NixlSender:
    """The prefill side: one-sided WRITEs into the pullers' registered pools."""

    def __init__(self, cache: KVCache, engine_id: str, devices: str | None = None) -> None:
        self.api, self.errors = load_nixl()
        self.cache = cache
        self.agent, self.registered = _agent(self.api, "prefill", engine_id, cache, devices)
        self.mem_type, self.device_id = _mem_type(cache)
        self.regions = [t.data_ptr() for t in pool_regions(cache)]
        self.bytes_per_block = transfer.bytes_per_block(cache)
        self.remotes: set[str] = set()
        """Decode agents whose metadata this agent has loaded."""
        self.writes: dict[str, _Write] = {}

    def start(self, key: str, pull: dict[str, Any], block_ids: list[int]) -> Outcome | None:
        try:
            name, pull_id = str(pull["nixl_agent"]), str(pull["nixl_pull"])
            destination = [int(b) for b in pull["block_ids"]]
            addresses = [int(a) for a in pull["nixl_addresses"]]
            if name not in self.remotes:
                loaded = self.agent.add_remote_agent(base64.b64decode(pull["nixl_metadata"]))
                if (loaded.decode() if isinstance(loaded, bytes) else loaded) != name:
                    raise ValueError("the NIXL metadata names another agent")
                self.remotes.add(name)
        except (KeyError, TypeError, ValueError) as error:
            return Outcome(error=f"a nixl pull needs the decode agent's metadata, addresses and "
                                 f"block ids: {error}")
        except self.errors as error:
            return Outcome(error=f"NIXL could not load the decode agent's metadata: {error!r}")
        if len(destination) != len(block_ids) or len(addresses) != len(self.regions):
            return Outcome(error=f"the pull names {len(destination)} blocks in {len(addresses)} "
                                 f"regions; {len(block_ids)} blocks in {len(self.regions)} expected")
        local, remote = self._descriptors(block_ids, destination, addresses)
        num_bytes = len(block_ids) * self.bytes_per_block * len(self.regions)
        try:
            handle = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs(local, self.mem_type),
                self.agent.get_xfer_descs(remote, self.mem_type), name, pull_id.encode())
            state = self.agent.transfer(handle)
        except self.errors as error:
            self._forget(name)
            return Outcome(error=f"the NIXL write to {name} failed: {error!r}")
        write = _Write(handle, pull_id, name, num_bytes)
        state = self._drive(write, state)
        if state == "PROC":
            self.writes[key] = write
            return None
        return self._end(write, state)

    def _drive(self, write: _Write, state: str) -> str:
        """Check the write's state until it ends or ``DRIVE_S`` passes (the decode side's
        acknowledgement takes a millisecond or two); its last state."""
        deadline = time.monotonic() + DRIVE_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S / 5)
            try:
                state = self.agent.check_xfer_state(write.handle)
            except self.errors:
                state = "ERR"
        return state

    def _descriptors(self, source: list[int], destination: list[int],
                     addresses: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``[address, length, device]`` rows: each run of consecutive blocks, in every region."""
        size = self.bytes_per_block
        runs = block_runs(source, destination)
        local = np.zeros((len(runs) * len(self.regions), 3), dtype=np.uint64)
        remote = np.zeros_like(local)
        row = 0
        for local_base, remote_base in zip(self.regions, addresses):
            for first_source, first_destination, count in runs:
                local[row] = (local_base + first_source * size, count * size, self.device_id)
                remote[row] = (remote_base + first_destination * size, count * size, self.device_id)
                row += 1
        return local, remote

    def _end(self, write: _Write, state: str) -> Outcome:
        try:
            write.handle.release()
        except self.errors as error:
            logger.warning("NIXL transfer handle not released: %r", error)
        if state == "DONE":
            return Outcome({"nixl_pull": write.pull_id}, num_bytes=write.num_bytes)
        self._forget(write.agent_name)
        return Outcome(error=f"the NIXL write to {write.agent_name} failed (state {state}; "
                             "the decode server may be gone)")

    def _forget(self, name: str) -> None:
        """Drop a decode agent after a failure: its next pull loads its metadata again."""
        if name in self.remotes:
            self.remotes.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except self.errors:
                pass

    def poll(self, now: float) -> list[tuple[str, Outcome]]:
        ended = []
        for key, write in list(self.writes.items()):
            try:
                state = self.agent.check_xfer_state(write.handle)
            except self.errors:
                state = "ERR"
            if state != "PROC":
                del self.writes[key]
                ended.append((key, self._end(write, state)))
        return ended

    def abandon(self, key: str) -> bool:
        write = self.writes.get(key)
        if write is None:
            return True
        try:
            write.handle.release()  # NIXL cancels a write in progress, or refuses
        except self.errors as error:
            logger.warning("NIXL write %s could not be cancelled: %r", key, error)
            return False
        del self.writes[key]
        return True

    def close(self) -> None:
        for key in list(self.writes):
            self.abandon(key)
        _close_agent(self.agent, self.registered, self.errors)


class NixlReceiver:
    """The decode side: a registered pool the prefill servers write into."""

    is_one_sided = True

    def __init__(self, cache: KVCache, engine_id: str, devices: str | None = None) -> None:
        self.api, self.errors = load_nixl()
        self.cache = cache
        self.agent, self.registered = _agent(self.api, "decode", engine_id, cache, devices)
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.addresses = [t.data_ptr() for t in pool_regions(cache)]
        self.arrived: dict[str, float] = {}
        """Pull ids whose notification has come, and when."""
        self.lock = threading.Lock()
        """Held around every use of the agent and ``arrived`` (the engine's thread and the poller)."""
        self.active_until = 0.0
        self.wake = threading.Event()
        self.closing = False
        self.poller = threading.Thread(target=self._poll_loop, name="nixl-notifications",
                                       daemon=True)
        self.poller.start()

    def _poll_loop(self) -> None:
        """Read notifications every ``POLL_INTERVAL_S`` while pulls are outstanding, so writes
        complete while the engine computes; sleep on ``wake`` otherwise."""
        while not self.closing:
            if time.monotonic() > self.active_until:
                self.wake.wait()
                self.wake.clear()
                continue
            with self.lock:
                if self.closing:
                    return
                try:
                    self._read_notifications()
                except self.errors as error:
                    logger.warning("NIXL notifications not read: %r", error)
            time.sleep(POLL_INTERVAL_S)

    def _keep_polling(self) -> None:
        self.active_until = time.monotonic() + ACTIVE_S
        self.wake.set()

    def pull_fields(self, key: str, host: str, block_ids: list[int]) -> dict[str, Any]:
        self._keep_polling()
        return {"nixl_agent": self.agent.name, "nixl_metadata": self.metadata,
                "nixl_addresses": self.addresses, "block_ids": block_ids,
                "nixl_pull": uuid.uuid4().hex}

    def _read_notifications(self) -> None:
        now = time.monotonic()
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                self.arrived[message.decode(errors="replace")] = now
        for pull_id in [p for p, at in self.arrived.items() if now - at > NOTIFICATION_KEEP_S]:
            del self.arrived[pull_id]

    def land(self, message: dict[str, Any], frames: list[bytes], block_ids: list[int]) -> bool:
        pull_id = message.get("nixl_pull")
        if not isinstance(pull_id, str):
            raise ValueError("the reply names no NIXL pull (is the prefill server on the nixl backend?)")
        with self.lock:
            self._read_notifications()
            return self.arrived.pop(pull_id, None) is not None

    def discard(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.arrived.pop(str(message.get("nixl_pull")), None)

    def progress(self) -> None:
        """Let NIXL move what is in flight (no progress thread: see the module's docstring)."""
        self._keep_polling()
        with self.lock:
            self._read_notifications()

    def close(self) -> None:
        with self.lock:
            self.closing = True
        self.wake.set()
        self.poller.join()
        _close_agent(self.agent, self.registered, self.errors)


def _close_agent(agent: Any, registered: Any, errors: tuple[type[BaseException], ...]) -> None:
    """Deregister the pool and destroy the agent now: left to interpreter exit, UCX's teardown
    can run after libraries it needs were unloaded (a crash at exit)."""
    try:
        agent.deregister_memory(registered)
    except errors:
        pass
    del agent.agent  # the bindings' agent: its destructor closes UCX
