"""The engine's adapter registry: adapter name -> runner slot, loading, LRU eviction, draining.

Invariants:
- A *registered* name may be used by requests. A registered adapter is either *loaded* (its
  weights installed in a runner slot) or only on disk (dropped by ``--max-loaded-loras``); a
  request for it reads it back from disk (``acquire``).
- Slots are never reused: every load of a name gets a fresh slot and a fresh ``adapter_id``
  (``name@slot``, the prefix-cache root), so K/V computed with an adapter's old weights is
  never matched by requests using new weights loaded under the same name.
- An adapter that a queued or running request uses (its adapter_id is in ``in_use``) is never
  evicted or removed: ``unload`` unregisters the name at once (new requests get 404) and moves
  the slot to ``draining``; ``release_drained`` removes it once its last request has ended.
- Loaded plus draining adapters are at most ``--max-loaded-loras``; when every one is in use,
  a request for another adapter is refused (``AdapterBusyError``, 503), never queued unbounded.
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


class AdapterBusyError(RuntimeError):
    """Every adapter slot --max-loaded-loras allows is in use by queued or running requests (503)."""


@runtime_checkable
class LoRASlots(Protocol):
    """What the registry needs of the model side: install and remove an adapter's deltas."""

    hf_config: Any
    """The base model's HF config (the shapes adapters must match)."""

    def set_lora(self, slot: int, entries: Any) -> None: ...

    def remove_lora(self, slot: int) -> None: ...


@dataclass
class LoadedAdapter:
    """One load of a named adapter in one runner slot."""

    name: str
    path: str
    slot: int
    rank: int
    target_modules: tuple[str, ...]
    load_time_s: float

    @property
    def adapter_id(self) -> str:
        """The prefix-cache key of requests using this load."""
        return f"{self.name}@{self.slot}"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank,
                "target_modules": list(self.target_modules), "load_time_s": round(self.load_time_s, 4)}


class LoRAManager:
    """Adapters by name for one engine (one data-parallel replica)."""

    def __init__(self, config: LoRAConfig, base: BaseShapes, slots: LoRASlots) -> None:
        self.config = config
        self.base = base
        self.slots = slots
        self.registered: dict[str, str] = {}
        """Name -> adapter directory, for every name requests may use."""
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()
        """Installed adapters, in eviction order (lru: least recently used first; fifo: load order)."""
        self.draining: dict[int, LoadedAdapter] = {}
        """Slot -> an unloaded (or replaced) adapter whose requests have not all ended."""
        self.num_loads = 0
        self._next_slot = 1

    # -- loading ----------------------------------------------------------------------------
    def read(self, name: str, path: str) -> tuple[LoRAAdapter, float]:
        """Read and validate an adapter (LoRAAdapterError saying why it cannot be served)."""
        start_s = time.perf_counter()
        adapter = load_adapter(name, path, self.base, self.config.max_lora_rank)
        outside = sorted(adapter.target_modules - set(self.config.target_modules))
        if outside:
            raise LoRAAdapterError(f"LoRA adapter {name!r} targets {', '.join(outside)}, not among "
                                   f"--lora-target-modules ({' '.join(self.config.target_modules)})")
        return adapter, time.perf_counter() - start_s

    def load(self, name: str, path: str, in_use: set[str]) -> LoadedAdapter | None:
        """Register ``name`` (validated now) and install it when memory allows; None when it was
        registered but left on disk because every slot is in use (a request reads it then)."""
        if name in self.registered:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        adapter, read_s = self.read(name, path)
        self.registered[name] = path
        try:
            return self._install(adapter, read_s, in_use)
        except AdapterBusyError:
            logger.info("LoRA adapter %r registered; not kept in memory (--max-loaded-loras %s, "
                        "all in use): it is read again on its first request", name,
                        self.config.max_loaded_loras)
            return None

    def _install(self, adapter: LoRAAdapter, read_s: float, in_use: set[str]) -> LoadedAdapter:
        self._make_room(in_use)
        slot = self._next_slot
        self._next_slot += 1
        start_s = time.perf_counter()
        self.slots.set_lora(slot, [(layer, *FUSED_TARGETS[module], w.a, w.b, w.scale)
                                   for (layer, module), w in adapter.weights.items()])
        loaded = LoadedAdapter(adapter.name, adapter.path, slot, adapter.rank,
                               tuple(sorted(adapter.target_modules)),
                               read_s + time.perf_counter() - start_s)
        self.loaded[adapter.name] = loaded
        self.num_loads += 1
        logger.info("LoRA adapter %r (rank %d, %s) in slot %d, loaded in %.3f s", adapter.name,
                    adapter.rank, ",".join(loaded.target_modules), slot, loaded.load_time_s)
        return loaded

    def _make_room(self, in_use: set[str]) -> None:
        capacity = self.config.max_loaded_loras
        if capacity is None:
            return
        self.release_drained(in_use)
        while len(self.loaded) + len(self.draining) >= capacity:
            victim = next((a for a in self.loaded.values() if a.adapter_id not in in_use), None)
            if victim is None:
                raise AdapterBusyError(
                    f"all {capacity} LoRA adapters held in memory (--max-loaded-loras) are in use "
                    "by queued or running requests; retry when they finish")
            del self.loaded[victim.name]
            self.slots.remove_lora(victim.slot)
            logger.info("LoRA adapter %r dropped from memory (%s, --max-loaded-loras %d); it is "
                        "read from disk again when asked for", victim.name,
                        self.config.lora_eviction_policy, capacity)

    # -- requests ---------------------------------------------------------------------------
    def acquire(self, name: str, in_use: set[str]) -> LoadedAdapter:
        """The loaded adapter a new request runs with, read back from disk if it was dropped."""
        loaded = self.loaded.get(name)
        if loaded is not None:
            if self.config.lora_eviction_policy == "lru":
                self.loaded.move_to_end(name)
            return loaded
        path = self.registered.get(name)
        if path is None:
            raise AdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        adapter, read_s = self.read(name, path)
        return self._install(adapter, read_s, in_use)

    # -- unloading --------------------------------------------------------------------------
    def unload(self, name: str, in_use: set[str]) -> bool:
        """Unregister ``name``: new requests get 404 at once; its weights go when its last request
        ends. Returns whether requests were still using it (it is draining)."""
        if name not in self.registered:
            raise AdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        del self.registered[name]
        loaded = self.loaded.pop(name, None)
        if loaded is None:
            return False
        self.draining[loaded.slot] = loaded
        self.release_drained(in_use)
        return loaded.slot in self.draining

    def release_drained(self, in_use: set[str]) -> None:
        """Remove the weights of unloaded adapters no request uses any more."""
        for slot, loaded in list(self.draining.items()):
            if loaded.adapter_id not in in_use:
                del self.draining[slot]
                self.slots.remove_lora(slot)
                logger.info("LoRA adapter %r unloaded (slot %d freed)", loaded.name, slot)

    def describe(self) -> list[dict[str, Any]]:
        """Every registered adapter, for /v1/models and /get_server_info."""
        result = []
        for name, path in self.registered.items():
            loaded = self.loaded.get(name)
            entry: dict[str, Any] = (loaded.describe() if loaded is not None
                                     else {"name": name, "path": path})
            entry["in_memory"] = loaded is not None
            result.append(entry)
        return result

