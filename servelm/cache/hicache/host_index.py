"""The host tier's bookkeeping: block key -> host slot, least recently used first.

Invariants: every slot in [0, num_slots) is free or holds exactly one key; a pinned key (being
loaded this very moment) is never evicted to make room.
"""

from __future__ import annotations

from collections import OrderedDict


class HostIndex:
    """Which block keys the host buffer holds, and in which slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[str] = set()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: str) -> bool:
        return key in self._slots

    def get(self, key: str) -> int | None:
        """The slot of ``key`` (marked recently used), or None."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def assign(self, key: str) -> int | None:
        """A slot to store ``key`` in (the least recently used unpinned key loses its slot when
        none is free); None when every slot is pinned. The caller writes the slot."""
        assert key not in self._slots, key
        if not self._free:
            victim = next((k for k in self._slots if k not in self.pinned), None)
            if victim is None:
                return None
            self._free.append(self._slots.pop(victim))
            self.num_evicted += 1
        slot = self._free.pop()
        self._slots[key] = slot
        return slot

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
