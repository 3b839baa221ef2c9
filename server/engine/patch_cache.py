"""The host tier: parsed patches in host memory between the registry and the device slots, keyed by patch id (a
content hash), bounded in bytes (``--host-cache-mb``). Each front end keeps one in front of the registry, and the
engine process one of the patches its front ends sent, so a task that lost its device slot comes back with a copy."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from patchserve.patches.format import Patch


@dataclass
class CacheStats:
    """Running totals: lookups that found their patch (``hits``), patches that had to be read or parsed because they
    were not held (``misses``, counted by whoever fetched them), patches dropped for room (``evictions``)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PatchCache:
    """LRU of parsed patches by id, bounded in bytes; thread-safe (request handlers fill it from threads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Patch] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def bytes(self) -> int:
        """What the patches held take (their bytes, as ``put`` counts them)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, patch_id: str) -> Patch | None:
        """The patch, or None; a patch found counts as a hit (a miss is counted by whoever then fetches it:
        ``missed``)."""
        with self._lock:
            patch = self._items.get(patch_id)
            if patch is not None:
                self._items.move_to_end(patch_id)
                self.stats.hits += 1
            return patch

    def get_all(self, patch_ids: Iterable[str]) -> dict[str, Patch] | None:
        """Every patch of ``patch_ids`` (each a hit), or None when one of them is not held (then none is counted:
        the caller looks them up one by one). One lock for all of them."""
        found: dict[str, Patch] = {}
        with self._lock:
            for pid in patch_ids:
                patch = self._items.get(pid)
                if patch is None:
                    return None
                self._items.move_to_end(pid)
                found[pid] = patch
            self.stats.hits += len(found)
        return found

    def holds(self, patch_id: str) -> bool:
        """Whether the patch is held (counts nothing, moves nothing)."""
        return patch_id in self._items

    def missed(self, n: int = 1) -> None:
        """Count ``n`` patches that were not held and had to be fetched or parsed."""
        with self._lock:
            self.stats.misses += n

    def put(self, patch: Patch) -> None:
        size = len(patch.data)
        with self._lock:
            if patch.patch_id in self._items:
                self._items.move_to_end(patch.patch_id)
                return
            self._items[patch.patch_id] = patch
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old.data)
                self.stats.evictions += 1
