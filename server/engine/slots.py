"""Which patch sits in which device slot: LRU over idle slots, pinned while a batch uses them.

Slots are keyed by patch id (a content hash), so a re-registered task never serves stale weights: its new version
has a new id and lands in a new slot, while in-flight batches finish on the old one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class SlotsExhaustedError(RuntimeError):
    """More distinct patches are needed at once than there are slots."""


@dataclass
class TierStats:
    """Running totals of one tier of patches (the device slots, a host cache): patches found (``hits``), patches that
    had to be brought in (``misses``), patches dropped for room (``evictions``)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class SlotManager:
    """patch id -> slot with LRU eviction of idle slots; a pinned slot (used by an in-flight batch) never moves.

    Not thread-safe by design: only the runner thread calls it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("slot capacity must be at least 1")
        self.capacity = capacity
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: dict[str, int] = {}  # id -> batches in flight using it
        self.stats = TierStats()

    def __contains__(self, patch_id: str) -> bool:
        return patch_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def acquire(self, patch_ids: Sequence[str]) -> tuple[dict[str, int], list[tuple[str, int]]]:
        """Pin a slot for each id. Returns (id -> slot, [(id, slot) that must be loaded now])."""
        wanted = list(dict.fromkeys(patch_ids))
        if len(wanted) > self.capacity:
            raise SlotsExhaustedError(f"{len(wanted)} distinct patches in one batch, only {self.capacity} slots")
        slot_of, pins = self._slot_of, self._pins
        mapping: dict[str, int] = {}
        missing: list[str] = []
        for pid in wanted:  # pin the resident ones first so that loading the others cannot evict them
            slot = slot_of.get(pid)
            if slot is None:
                missing.append(pid)
                continue
            slot_of.move_to_end(pid)
            pins[pid] = pins.get(pid, 0) + 1
            mapping[pid] = slot
        self.stats.hits += len(mapping)
        to_load: list[tuple[str, int]] = []
        try:
            for pid in missing:
                slot = self._take_slot()
                slot_of[pid] = slot
                pins[pid] = pins.get(pid, 0) + 1
                mapping[pid] = slot
                to_load.append((pid, slot))
                self.stats.misses += 1
        except SlotsExhaustedError:  # all or nothing: the caller may retry once a batch in flight has finished
            loaded = {pid for pid, _ in to_load}
            for pid in loaded:
                self.forget(pid)
            self.release([pid for pid in mapping if pid not in loaded])
            raise
        return mapping, to_load

    def forget(self, patch_id: str) -> None:
        """Drop a mapping whose slot could not be loaded (the slot becomes free)."""
        slot = self._slot_of.pop(patch_id, None)
        self._pins.pop(patch_id, None)
        if slot is not None:
            self._free.append(slot)

    def release(self, patch_ids: Sequence[str]) -> None:
        """Unpin ``patch_ids`` once each (an id no longer pinned, e.g. forgotten after a failed load, is skipped)."""
        pins = self._pins
        for pid in dict.fromkeys(patch_ids):
            n = pins.get(pid, 0) - 1
            if n > 0:
                pins[pid] = n
            else:
                pins.pop(pid, None)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for pid in self._slot_of:  # least recently used first
            if not self._pins.get(pid):
                self.stats.evictions += 1
                return self._slot_of.pop(pid)
        raise SlotsExhaustedError(f"all {self.capacity} slots are in use by in-flight batches")
