"""The host tier: parsed patches in host memory between the registry and the device slots, keyed by patch id (a
content hash), bounded in bytes (``--host-cache-mb``). Each front end keeps one in front of the registry, and the
engine process one of the patches its front ends sent, so a task that lost its device slot comes back with a copy."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from patchserve.patches.format import Patch
from patchserve.patches.stored_patch import StoredPatch
from patchserve.server.engine.slots import TierStats

# What a parsed patch takes in host memory beyond its values (measured with torch 2.13 on x86-64, 2026-12-08: 5,000
# patches of a 1-layer BERT, 12 tensors and 3.3 KB of bytes each, took 19.5 KB each): a tensor object, its storage
# and the dict entry that names it, and the patch's own objects (metadata, dicts).
TENSOR_OVERHEAD_BYTES = 1300
PATCH_OVERHEAD_BYTES = 2500


def footprint(patch: Patch) -> int:
    """The host memory ``patch`` takes: its bytes, its tensors' values and the objects around them (a small patch's
    objects outweigh its values several times: counting only its bytes would let the cache grow 6x its bound)."""
    if isinstance(patch, StoredPatch) and not patch.loaded:  # its bytes and metadata only: 7.6 KB, not 35 KB,
        # for a 5.2 KB patch (tests/test_engine.py)
        return len(patch.data) + PATCH_OVERHEAD_BYTES
    tensors = [patch.head_weight, patch.head_bias, *patch.values.values()]
    return (
        len(patch.data) + sum(t.nbytes for t in tensors) + TENSOR_OVERHEAD_BYTES * len(tensors) + PATCH_OVERHEAD_BYTES
    )


class PatchCache:
    """LRU of parsed patches by id, bounded in bytes; thread-safe (request handlers fill it from threads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[Patch, int]] = OrderedDict()  # id -> (patch, its footprint)
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = TierStats()  # a miss is counted by whoever fetched the patch: ``missed``

    @property
    def bytes(self) -> int:
        """The host memory the patches held take (``footprint``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, patch_id: str) -> Patch | None:
        """The patch, or None; a patch found counts as a hit (a miss is counted by whoever then fetches it:
        ``missed``)."""
        with self._lock:
            item = self._items.get(patch_id)
            if item is None:
                return None
            self._items.move_to_end(patch_id)
            self.stats.hits += 1
            return item[0]

    def get_all(self, patch_ids: Iterable[str]) -> dict[str, Patch] | None:
        """Every patch of ``patch_ids`` (each a hit), or None when one of them is not held (then none is counted:
        the caller looks them up one by one). One lock for all of them."""
        found: dict[str, Patch] = {}
        with self._lock:
            for pid in patch_ids:
                item = self._items.get(pid)
                if item is None:
                    return None
                self._items.move_to_end(pid)
                found[pid] = item[0]
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
        size = footprint(patch)
        with self._lock:
            if patch.patch_id in self._items:
                self._items.move_to_end(patch.patch_id)
                return
            self._items[patch.patch_id] = (patch, size)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= old
                self.stats.evictions += 1
