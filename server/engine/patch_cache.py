"""A host-memory cache of parsed patches in front of the registry, keyed by patch id (a content hash)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from patchserve.patches.format import Patch


class PatchCache:
    """LRU of parsed patches by id, bounded in bytes; thread-safe (request handlers fill it from threads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Patch] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, patch_id: str) -> Patch | None:
        with self._lock:
            patch = self._items.get(patch_id)
            if patch is not None:
                self._items.move_to_end(patch_id)
            return patch

    def get_all(self, patch_ids: Iterable[str]) -> dict[str, Patch] | None:
        """Every patch of ``patch_ids``, or None when one of them is not held (one lock for all of them)."""
        found: dict[str, Patch] = {}
        with self._lock:
            for pid in patch_ids:
                patch = self._items.get(pid)
                if patch is None:
                    return None
                self._items.move_to_end(pid)
                found[pid] = patch
        return found

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
