"""The engine's adapter registry: adapter name -> registration -> runner slot.

Invariants:
- ``load`` validates an adapter and *registers* it: a ``Registration`` with a fresh ``adapter_id``
  (``name@n``, the prefix-cache root of its requests), so K/V computed with an earlier adapter of
  the same name is never matched. A request holds its registration's ``adapter_id`` from arrival.
- A registration gets a runner *slot* (its weights installed) when one of its requests is admitted
  (``acquire``), read from disk again if it was dropped from memory. Slots are never reused.
- Installed adapters are at most ``--max-loaded-loras``. To make room, the first installed adapter
  (LRU or FIFO order) that no *running* request uses is removed; its queued requests read it again
  when admitted. When every installed adapter has running requests, ``acquire`` answers None and
  the request waits in the queue (the scheduler tries again next step).
- ``unload`` unregisters the name at once (new requests get 404). Requests that already hold the
  registration, queued or running, still run with it; its slot is freed by ``release_unused``
  once no unfinished request holds it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from servelm.config import LoRAConfig
from servelm.lora.adapter import FUSED_TARGETS, BaseShapes, LoRAAdapter, LoRAAdapterError, load_adapter

logger = logging.getLogger(__name__)


class AdapterNotFoundError(LookupError):
    """No adapter of that name is loaded (HTTP 404)."""


def read_adapter(config: LoRAConfig, base: BaseShapes, name: str, path: str) -> LoRAAdapter:
    """Read and validate an adapter against the base model and the LoRA flags (rank, targets);
    LoRAAdapterError saying why it cannot be served."""
    adapter = load_adapter(name, path, base, config.max_lora_rank)
    outside = sorted(adapter.target_modules - set(config.target_modules))
    if outside:
        raise LoRAAdapterError(f"LoRA adapter {name!r} targets {', '.join(outside)}, not among "
                               f"--lora-target-modules ({' '.join(config.target_modules)})")
    return adapter


@runtime_checkable
class LoRASlots(Protocol):
    """What the registry needs of the model side: install and remove an adapter's deltas."""

    hf_config: Any
    """The base model's HF config (the shapes adapters must match)."""

    def set_lora(self, slot: int, entries: Any) -> None: ...

    def remove_lora(self, slot: int) -> None: ...


@dataclass
class Registration:
    """One load of a named adapter: where its files are and the key its requests carry."""

    name: str
    path: str
    adapter_id: str
    rank: int
    target_modules: tuple[str, ...]
    load_time_s: float
    slot: int | None = None
    """The runner slot holding its weights; None while it is only on disk."""
    is_registered: bool = True
    """False once unloaded: only requests that already hold it may still use it."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank,
                "target_modules": list(self.target_modules), "load_time_s": round(self.load_time_s, 4),
                "in_memory": self.slot is not None}


class LoRAManager:
    """Adapters by name for one engine (one data-parallel replica)."""

    def __init__(self, config: LoRAConfig, base: BaseShapes, slots: LoRASlots) -> None:
        self.config = config
        self.base = base
        self.slots = slots
        self.registered: dict[str, Registration] = {}
        """Name -> its current registration, for every name requests may use."""
        self.known: dict[str, Registration] = {}
        """adapter_id -> registration, for the registered ones and unloaded ones still held."""
        self.installed: OrderedDict[str, Registration] = OrderedDict()
        """adapter_id -> registration with a slot, in eviction order (lru: least recently used
        first; fifo: installed first)."""
        self.num_loads = 0
        """Registrations so far (load calls that succeeded)."""
        self.num_installs = 0
        """Adapters written into a runner slot so far: loads plus reads back from disk."""
        self._next_slot = 1

    # -- loading ----------------------------------------------------------------------------
    def read(self, name: str, path: str) -> tuple[LoRAAdapter, float]:
        """Read and validate an adapter, and the seconds it took."""
        start_s = time.perf_counter()
        adapter = read_adapter(self.config, self.base, name, path)
        return adapter, time.perf_counter() - start_s

    def load(self, name: str, path: str, running: set[str]) -> Registration:
        """Validate and register ``name``; install it now when memory allows (else on its first
        admitted request). ``running``: adapter_ids of running requests (never evicted)."""
        if name in self.registered:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        adapter, read_s = self.read(name, path)
        self.num_loads += 1
        registration = Registration(name, path, f"{name}@{self.num_loads}", adapter.rank,
                                    tuple(sorted(adapter.target_modules)), read_s)
        self.registered[name] = self.known[registration.adapter_id] = registration
        if self._make_room(running):
            self._install(registration, adapter, read_s)
        else:
            logger.info("LoRA adapter %r registered; installed on its first request (all "
                        "--max-loaded-loras %s are in use)", name, self.config.max_loaded_loras)
        return registration

    def _install(self, registration: Registration, adapter: LoRAAdapter, read_s: float) -> None:
        slot = self._next_slot
        self._next_slot += 1
        start_s = time.perf_counter()
        self.slots.set_lora(slot, [(layer, *FUSED_TARGETS[module], w.a, w.b, w.scale)
                                   for (layer, module), w in adapter.weights.items()])
        registration.slot = slot
        self.num_installs += 1
        registration.load_time_s = read_s + time.perf_counter() - start_s
        self.installed[registration.adapter_id] = registration
        logger.info("LoRA adapter %r (rank %d, %s) in slot %d, loaded in %.3f s", registration.name,
                    registration.rank, ",".join(registration.target_modules), slot,
                    registration.load_time_s)

    def _remove(self, registration: Registration) -> None:
        assert registration.slot is not None
        del self.installed[registration.adapter_id]
        self.slots.remove_lora(registration.slot)
        registration.slot = None

    def _make_room(self, running: set[str]) -> bool:
        """Free a slot under --max-loaded-loras if needed; False when every installed adapter
        has running requests."""
        capacity = self.config.max_loaded_loras
        if capacity is None:
            return True
        while len(self.installed) >= capacity:
            victim = next((r for r in self.installed.values() if r.adapter_id not in running), None)
            if victim is None:
                return False
            self._remove(victim)
            logger.info("LoRA adapter %r dropped from memory (%s, --max-loaded-loras %d); it is "
                        "read from disk again when asked for", victim.name,
                        self.config.lora_eviction_policy, capacity)
        return True

    # -- requests ---------------------------------------------------------------------------
    def resolve(self, name: str) -> str:
        """The adapter_id a new request for ``name`` carries (AdapterNotFoundError: 404)."""
        registration = self.registered.get(name)
        if registration is None:
            raise AdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        return registration.adapter_id

    def acquire(self, adapter_id: str, running: set[str]) -> int | None:
        """The slot of an admitted request's adapter, installing it (from disk) if needed; None
        when there is no room yet (the request waits). LoRAAdapterError if its files went bad."""
        registration = self.known[adapter_id]
        if registration.slot is not None:
            if self.config.lora_eviction_policy == "lru":
                self.installed.move_to_end(adapter_id)
            return registration.slot
        if not self._make_room(running):
            return None
        adapter, read_s = self.read(registration.name, registration.path)
        self._install(registration, adapter, read_s)
        return registration.slot

    # -- unloading --------------------------------------------------------------------------
    def unload(self, name: str, held: set[str]) -> bool:
        """Unregister ``name``: new requests get 404 at once; requests holding it (``held``: the
        adapter_ids of unfinished requests) still run with it. Returns whether any do."""
        registration = self.registered.pop(name, None)
        if registration is None:
            raise AdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        registration.is_registered = False
        self.release_unused(held)
        return registration.adapter_id in held

    def release_unused(self, held: set[str]) -> None:
        """Forget unloaded registrations no unfinished request holds (and free their slots)."""
        for adapter_id, registration in list(self.known.items()):
            if not registration.is_registered and adapter_id not in held:
                del self.known[adapter_id]
                if registration.slot is not None:
                    logger.info("LoRA adapter %r unloaded (slot %d freed)", registration.name,
                                registration.slot)
                    self._remove(registration)

    @property
    def has_unloaded(self) -> bool:
        """Some unloaded adapter is still held by requests (the engine checks after each step)."""
        return len(self.known) > len(self.registered)

    def describe(self) -> list[dict[str, Any]]:
        """Every registered adapter, for /v1/models and /get_server_info."""
        return [registration.describe() for registration in self.registered.values()]
