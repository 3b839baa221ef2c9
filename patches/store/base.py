"""The registry interface shared by the disk and Redis backends.

A registry maps task names to numbered versions of patches; one version per task is *current* (what the server
serves). Versions are immutable. Every change bumps a *generation* counter, which makes watching cheap and lossless:
a watcher waits for the generation to move, then reads the tasks the backend's change log names for those steps
(or, where the log cannot account for every step, diffs a snapshot of the current versions) -- so a missed
notification can only delay a change, never lose it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from patchserve.patches.errors import (
    PatchError,
    PatchServeError,
    RegistryError,
    RetiredPatchTypeError,
    TaskNotFoundError,
    VersionNotFoundError,
)
from patchserve.patches.format import DEFAULT_MAX_PATCH_BYTES, Patch
from patchserve.patches.patch_file import content_id
from patchserve.patches.stored_patch import StoredPatch

log = logging.getLogger(__name__)

# A version that was current this recently is kept by retention whatever its age: a replica that has not yet heard
# of the change that replaced it may still fetch it (replicas hear within milliseconds; this covers one cut off from
# the registry for a while).
RETIRED_GRACE_S = 600.0


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (``redis://:s3cret@host`` -> ``redis://:***@host``,
    and a ``?password=`` parameter likewise). Every registry or queue URL shown in an error, a log line or a
    response is this form: ``Registry.url`` and ``JobQueue.url`` hold it, and only the connection sees the secret.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    secret_query = any(k.lower().endswith("password") for k, _ in query)
    if parts.password is None and not secret_query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    if secret_query:
        query = [(k, "***" if k.lower().endswith("password") else v) for k, v in query]
    return parts._replace(netloc=netloc, query=urlencode(query, safe="*:/")).geturl()


def iso_time(seconds: float) -> str:
    """A Unix time as the ISO-8601 UTC string every time patchserve shows is written in."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def utc_now() -> str:
    return iso_time(datetime.now(UTC).timestamp())


@dataclass(frozen=True)
class VersionInfo:
    """One stored version of a task's patch."""

    task: str
    version: int
    patch_id: str
    size: int
    registered_at: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VersionInfo:
        return cls(**raw)


@dataclass(frozen=True)
class Change:
    """The current version of ``task`` changed; ``current`` is None when the task was deleted."""

    task: str
    current: VersionInfo | None


@dataclass(frozen=True)
class TaskPage:
    """One page of the task listing: the current version of each task, by name; ``next_after`` is the name to pass
    as ``after`` for the next page (None: this is the last)."""

    items: list[VersionInfo]
    next_after: str | None


def page_names(names: list[str], after: str | None, prefix: str, count: int) -> list[str]:
    """Of the sorted ``names``: up to ``count`` starting with ``prefix`` and sorting after ``after``."""
    if after is not None and after >= prefix:
        start = bisect.bisect_right(names, after)
    else:
        start = bisect.bisect_left(names, prefix)
    out = []
    for name in names[start : start + count]:
        if not name.startswith(prefix):
            break
        out.append(name)
    return out


def parse_time(iso: str) -> float:
    """An ISO-8601 time as written by ``iso_time``, as Unix seconds."""
    return datetime.fromisoformat(iso).timestamp()


def versions_to_prune(
    versions: list[VersionInfo],
    current: int,
    retired: dict[int, float],
    keep: int | None,
    now: float,
    grace_s: float,
    also: Collection[int] = (),
) -> list[VersionInfo]:
    """Which of a task's ``versions`` retention deletes: those beyond the newest ``keep`` (None: none of them) and
    those in ``also``; never the current one, nor one registered or made current within ``grace_s`` seconds of
    ``now`` (``retired``: version -> when it stopped being current), since a replica may still be serving it."""
    ordered = sorted(versions, key=lambda v: v.version)
    newest = {v.version for v in ordered} if keep is None else {v.version for v in ordered[-keep:]} if keep else set()
    return [
        v
        for v in ordered
        if (v.version not in newest or v.version in also)
        and v.version != current
        and parse_time(v.registered_at) < now - grace_s
        and retired.get(v.version, 0.0) < now - grace_s
    ]


def diff_snapshots(old: dict[str, VersionInfo], new: dict[str, VersionInfo]) -> list[Change]:
    """Changes that turn snapshot ``old`` into ``new`` (new/updated/rolled-back tasks, then deleted ones)."""
    changes = [Change(t, v) for t, v in sorted(new.items()) if old.get(t) != v]
    changes += [Change(t, None) for t in sorted(old) if t not in new]
    return changes


class Registry(ABC):
    """Where patches live. Thread-safe; every method is blocking (the server calls it from worker threads)."""

    url: str
    max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES
    # retention: after each put, delete the task's versions beyond the newest ``keep_versions`` (None: keep all)
    keep_versions: int | None = None
    retired_grace_s: float = RETIRED_GRACE_S

    # --- writes --------------------------------------------------------------------------------------------
    @abstractmethod
    def put(self, patch: Patch) -> VersionInfo:
        """Store ``patch`` as a new version (n+1) of ``patch.meta.task`` and make it current."""

    @abstractmethod
    def delete(self, task: str) -> None:
        """Remove a task and all its versions. Raises TaskNotFoundError when absent."""

    @abstractmethod
    def set_current(self, task: str, version: int) -> VersionInfo:
        """Make an existing version current (rollback / roll forward)."""

    @abstractmethod
    def prune(
        self, task: str, keep: int | None, *, dry_run: bool = False, also: Collection[int] = ()
    ) -> list[VersionInfo]:
        """Delete ``task``'s versions beyond the newest ``keep`` (None: none for their age) and the versions in
        ``also`` (``versions_to_prune`` says which are kept whatever their age); returns what was deleted, or with
        ``dry_run`` what would be. The current version never changes, so watchers see nothing."""

    # --- reads ---------------------------------------------------------------------------------------------
    @abstractmethod
    def info(self, task: str, version: int | None = None) -> VersionInfo:
        """The current (or given) version's record, without reading the patch."""

    @abstractmethod
    def get_bytes(self, task: str, version: int | None = None) -> tuple[VersionInfo, bytes]:
        """The current (or given) version's record and its patch bytes, read consistently."""

    @abstractmethod
    def versions(self, task: str) -> list[VersionInfo]:
        """Every stored version of a task, oldest first."""

    @abstractmethod
    def tasks(self) -> list[str]:
        """Names of all registered tasks, sorted."""

    @abstractmethod
    def snapshot(self) -> dict[str, VersionInfo]:
        """The current version of every task."""

    def page(self, limit: int, *, after: str | None = None, prefix: str = "") -> TaskPage:
        """Up to ``limit`` tasks whose names start with ``prefix`` and sort after ``after``, by name, each with its
        current version. Keyset paging: a page's ``next_after`` stays valid while tasks are added or deleted (a task
        added behind it is not listed, one ahead of it is). Reads ``limit`` tasks' records, not every task's."""
        if limit < 1:
            raise ValueError("a page holds at least one task")
        items: list[VersionInfo] = []
        while True:
            need = limit - len(items)
            names = self._names_after(after, prefix, need + 1)  # one more: whether anything follows
            taken = names[:need]
            infos = self._current_infos(taken)
            items += [infos[n] for n in taken if n in infos]  # a task deleted since it was listed is left out
            if len(names) <= need:
                return TaskPage(items, None)
            after = taken[-1]
            if len(items) == limit:
                return TaskPage(items, after)

    def count(self) -> int:
        """How many tasks are registered."""
        return len(self.tasks())

    def _names_after(self, after: str | None, prefix: str, count: int) -> list[str]:
        """Up to ``count`` task names starting with ``prefix`` and sorting after ``after``, in order. A backend
        with an ordered index answers from it; this reads every name."""
        names = self.tasks()
        return page_names(names, after, prefix, count)

    def _current_infos(self, names: list[str]) -> dict[str, VersionInfo]:
        """The current version of each of ``names`` that still exists."""
        out: dict[str, VersionInfo] = {}
        for name in names:
            try:
                out[name] = self.info(name)
            except TaskNotFoundError:
                continue
        return out

    @abstractmethod
    def generation(self) -> int:
        """A counter that moves on every change."""

    @abstractmethod
    def wait_for_change(self, since: int, timeout: float) -> int:
        """Block until the generation differs from ``since`` or ``timeout`` passes; return the generation."""

    @abstractmethod
    def ping(self) -> None:
        """Raise RegistryUnavailableError when the backend cannot be reached."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # --- shared behaviour ----------------------------------------------------------------------------------
    def _retain(self, task: str) -> None:
        """After a put: apply ``keep_versions``. A failure is logged, not raised: the put itself has succeeded, and
        the next put (or ``patchserve prune``) tries again."""
        if self.keep_versions is None:
            return
        try:
            gone = self.prune(task, self.keep_versions)
        except (PatchServeError, OSError) as exc:  # the registration stands; say why retention did not run
            log.warning("retention: could not prune %s's old versions (%s); the next registration retries", task, exc)
            return
        if gone:
            log.info("retention: deleted %s v%s", task, ",".join(str(v.version) for v in gone))

    def unservable(self, task: str) -> list[VersionInfo]:
        """``task``'s versions whose patch type this build no longer serves (``RETIRED_PATCH_TYPES``), oldest
        first: what ``patchserve prune --unservable`` deletes."""
        found = []
        for info in self.versions(task):
            try:
                self.get(task, info.version)
            except RetiredPatchTypeError:
                found.append(info)
            except (PatchError, VersionNotFoundError):  # damaged (another matter), or pruned meanwhile
                continue
        return found

    def get(self, task: str, version: int | None = None) -> tuple[VersionInfo, Patch]:
        """The current (or given) version, its bytes checked against their recorded content id, its metadata read
        (the tensors are parsed on first use: ``StoredPatch``). A stored patch this build cannot use (a retired patch
        type, say) is a PatchError of the same kind that names the version."""
        info, data = self.get_bytes(task, version)
        read = content_id(data)
        if read != info.patch_id:
            raise RegistryError(
                f"stored patch {task!r} v{info.version} does not match its recorded id {info.patch_id} "
                f"(read {read}): the registry is damaged; re-register the patch"
            )
        try:
            patch = StoredPatch.from_stored(data, read, max_bytes=max(self.max_patch_bytes, len(data)))
        except PatchError as exc:
            raise type(exc)(f"{task!r} v{info.version} ({info.patch_id}) in {self.url}: {exc}") from exc
        return info, patch

    def watch(
        self, stop: threading.Event, timeout: float = 1.0, known: dict[str, VersionInfo] | None = None
    ) -> Iterator[list[Change]]:
        """Yield batches of changes made after this call, until ``stop`` is set.

        Without ``known``, the starting snapshot is taken here, not at the first ``next()``, so nothing between the
        call and the iteration is missed. With ``known`` (the current versions of the tasks a caller holds, such as a
        catalog that reads tasks as they are asked for), no task is read to start: every change the backend names
        is reported, and where it cannot name them, only the known tasks are read again (``recheck``), not every
        task. Backend errors propagate to the caller.
        """
        gen, cursor = self.change_cursor()
        if known is None:
            return self._changes_since(gen, cursor, self.snapshot(), stop, timeout)
        return self._changes_since(gen, cursor, known, stop, timeout, lazy=True)

    def recheck(self, known: dict[str, VersionInfo]) -> list[Change]:
        """The changes of the ``known`` tasks against the registry (each read again: O(known), not O(tasks))."""
        names = sorted(known)
        now = self._current_infos(names)
        return [Change(t, now.get(t)) for t in names if now.get(t) != known.get(t)]

    def change_cursor(self) -> tuple[int, Any]:
        """The generation and a backend's position in its change log, read together (None: it keeps no log)."""
        return self.generation(), None

    def changed_tasks(self, since: int, cursor: Any) -> tuple[int, Any, set[str] | None]:
        """(generation, new cursor, the tasks changed since ``since`` / ``cursor``), or None for the tasks when the
        backend cannot name exactly which changed: then the caller diffs a whole snapshot."""
        return self.generation(), None, None

    def _changes_since(
        self,
        gen: int,
        cursor: Any,
        last: dict[str, VersionInfo],
        stop: threading.Event,
        timeout: float,
        lazy: bool = False,
    ) -> Iterator[list[Change]]:
        while not stop.is_set():
            new_gen = self.wait_for_change(gen, timeout)
            if new_gen == gen:
                continue
            # read before the reads below: a change during them moves the generation again
            gen, cursor, touched = self.changed_tasks(gen, cursor)
            if touched is None and lazy:
                changes = self.recheck(last)
                for change in changes:
                    if change.current is None:
                        last.pop(change.task, None)
                    else:
                        last[change.task] = change.current
            elif touched is None:
                snap = self.snapshot()
                changes = diff_snapshots(last, snap)
                last = snap
            else:  # only the tasks the log names: O(changes), not O(tasks); their current state is the truth
                changes = []
                for task in sorted(touched):
                    try:
                        now: VersionInfo | None = self.info(task)
                    except TaskNotFoundError:
                        now = None
                    if now != last.get(task):
                        changes.append(Change(task, now))
                        if now is None:
                            last.pop(task, None)
                        else:
                            last[task] = now
            if changes:
                yield changes
