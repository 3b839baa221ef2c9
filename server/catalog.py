"""The server's view of the registry: which version of each task is current, and the parsed patches.

A request resolves its task to a (version, patch) when it arrives and keeps that patch until it is answered, so
a new version, a rollback or a delete applies to requests that arrive after it -- in-flight ones finish on what
they started with, and none fails.

Tasks are read as they are asked for, not at start-up: ``current`` holds the tasks this replica has served or heard
change, so start-up and memory do not grow with the registry (100,000 tasks start as fast as 100). A watcher thread
follows the registry's changes (from this replica or any other sharing the registry) by the names the registry's
change log gives; where it cannot name them, only the tasks held are read again. A task this replica has not heard
of yet is looked up directly, so a version registered elsewhere is served at once on first use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator

from patchserve.patches.errors import PatchServeError
from patchserve.patches.format import BaseSpec, Patch
from patchserve.patches.store import Change, Registry, VersionInfo
from patchserve.patches.stored_patch import StoredPatch
from patchserve.server.engine.patch_cache import PatchCache

log = logging.getLogger(__name__)


class Catalog:
    def __init__(
        self,
        registry: Registry,
        spec: BaseSpec,
        cache: PatchCache,
        *,
        watch_timeout: float = 1.0,
        on_fetch: Callable[[float], None] | None = None,
        tensors: bool = True,
    ) -> None:
        self.registry = registry
        self.spec = spec
        self.cache = cache
        self.watch_timeout = watch_timeout
        self.current: dict[str, VersionInfo] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_fetch = on_fetch  # seconds to fetch + parse a patch from the registry
        # parse a fetched patch's tensors before it is held (False: a front end of the engine process, which only
        # forwards a patch's bytes, holds it unparsed: StoredPatch)
        self.tensors = tensors

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="patchserve-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.watch_timeout + 5)

    def _apply(self, changes: list[Change]) -> None:
        for change in changes:
            if change.current is None:
                self.current.pop(change.task, None)
            else:
                self.current[change.task] = change.current
            log.info(
                "registry change: %s -> %s",
                change.task,
                "deleted" if change.current is None else f"v{change.current.version}",
            )

    def _watch(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                changes = self.registry.watch(self._stop, timeout=self.watch_timeout, known=self.current)
                # resync after (re)connecting: what changed of the tasks held while disconnected is applied now
                self._apply(self.registry.recheck(self.current))
                backoff = 0.5
                for batch in changes:
                    self._apply(batch)
            except PatchServeError as exc:
                log.warning("registry watch failed (%s); retrying in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    # --- reads ---------------------------------------------------------------------------------------------
    def lookup(self, task: str) -> tuple[VersionInfo, Patch] | None:
        """The current version of ``task`` and its patch when both are in memory (no I/O: call it on the event
        loop); None when ``resolve`` has to read the registry."""
        info = self.current.get(task)
        if info is None:
            return None
        patch = self.cache.get(info.patch_id)
        return None if patch is None else (info, patch)

    async def resolve_async(self, task: str, version: int | None = None) -> tuple[VersionInfo, Patch]:
        """``resolve`` from the event loop: at once from memory, else in a worker thread."""
        found = self.lookup(task) if version is None else None
        if found is not None:
            return found
        return await asyncio.to_thread(self.resolve, task, version)

    def resolve(self, task: str, version: int | None = None) -> tuple[VersionInfo, Patch]:
        """The current (or the given) version of ``task`` and its patch (blocking: call from a worker thread)."""
        known = self.current.get(task) if version is None else self.registry.info(task, version)
        patch = None if known is None else self.cache.get(known.patch_id)
        if known is not None and patch is not None:
            return known, patch
        t0 = time.perf_counter()
        if known is None:  # a task not held: one read gives its current version and the patch (TaskNotFound: 404)
            info, patch = self.registry.get(task)
            self.current.setdefault(task, info)
        else:
            info, patch = self.registry.get(task, known.version)
        self.cache.missed()
        patch.check_compatible(self.spec)
        if self.tensors and isinstance(patch, StoredPatch):
            patch.load()
        self.cache.put(patch)
        if self.on_fetch is not None:
            self.on_fetch(time.perf_counter() - t0)
        return info, patch

    def recent_patches(self) -> Iterator[Patch]:
        """The current patch of every task, most recently registered first, fetched one at a time (what a preload
        fills the slots with: it reads every task's record). A patch that cannot be read or does not fit this
        encoder is logged and skipped."""
        everything = self.registry.snapshot()
        for task, info in everything.items():
            self.current.setdefault(task, info)
        for info in sorted(everything.values(), key=lambda i: (i.registered_at, i.task), reverse=True):
            try:
                yield self.resolve(info.task, info.version)[1]
            except PatchServeError as exc:
                log.warning("preload: skipping %s v%d: %s", info.task, info.version, exc)

    # --- writes (this replica sees its own writes at once) ------------------------------------------------------
    def register(self, patch: Patch) -> VersionInfo:
        patch.check_compatible(self.spec)
        info = self.registry.put(patch)
        self.cache.put(patch)
        self.current[info.task] = info
        return info

    def delete(self, task: str) -> None:
        self.registry.delete(task)
        self.current.pop(task, None)

    def rollback(self, task: str, version: int) -> VersionInfo:
        info = self.registry.set_current(task, version)
        self.current[task] = info
        return info
