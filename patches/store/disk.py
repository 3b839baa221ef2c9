"""Disk registry: the embedded default. One folder, safe for several processes on one machine.

Layout under the root::

    GENERATION                       counter, rewritten atomically on every change (what watchers poll)
    CHANGES                          "<generation> <task>" a line per change, appended before GENERATION moves
                                     (watchers read what changed since their last look, not every task);
                                     rewritten with its newer half past CHANGE_LOG_MAX_BYTES
    locks/<task>.lock, locks/.global  flock files (outside task folders, so a delete cannot strand a waiter)
    pending/<task>                   a change of that task is under way (see below)
    tasks/<task>/manifest.json       {"current": n, "last": n, "versions": {"1": VersionInfo, ...},
                                      "retired": {"1": unix time it stopped being current, ...}}
    tasks/<task>/v00000001.safetensors

Every file is written to a temporary name, fsynced, renamed into place and the folder fsynced. A patch file is
written before the manifest that names it, so a reader never sees a half-written patch and a crash mid-write leaves
the previous version current.

Watchers poll GENERATION and read CHANGES from where they stopped: a change costs a watcher O(changes), however
many tasks there are. When the lines they read do not account for every step of the generation (the log was
trimmed past them, lost in a crash, or an older patchserve wrote without it), they diff a whole snapshot instead.

Watchers poll GENERATION, so a change must never become visible without the generation moving, even when its
writer dies in between. Each change is bracketed by a marker, ``pending/<task>``, created before its first
visible write and removed after the generation moved (all under the task's lock). A marker whose task lock is free
belongs to a writer that died: whoever finds it (a watcher polling, or anyone opening the registry) moves the
generation on its behalf, clears what the writer left in the task's folder (temporary files, a patch file no
manifest names, a folder without a manifest) and removes the marker. Opening a registry does the same, and empties
the trash of half-deleted tasks, without reading every task folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from patchserve.patches.errors import (
    InvalidTaskNameError,
    RegistryError,
    RegistryUnavailableError,
    TaskNotFoundError,
    VersionNotFoundError,
)
from patchserve.patches.format import FILE_SUFFIX, Patch
from patchserve.patches.store.base import Registry, VersionInfo, page_names, utc_now, versions_to_prune
from patchserve.patches.validation import validate_task_name

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
CHANGE_LOG = "CHANGES"
CHANGE_LOG_MAX_BYTES = 1 << 20  # about 40,000 changes; a watcher further behind diffs a snapshot


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_task_name(name: str) -> bool:
    try:
        validate_task_name(name)
    except InvalidTaskNameError:
        return False
    return True


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


class DiskRegistry(Registry):
    """Registry in a local folder (``disk:///path``)."""

    def __init__(self, root: str | Path, *, poll_interval: float = 0.2) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = f"disk://{self.root}"
        self.poll_interval = poll_interval
        self._names: tuple[int, list[str]] | None = None  # (generation, every task folder's name, sorted): paging
        self._names_lock = threading.Lock()
        try:
            for sub in ("tasks", "locks", "trash", "pending"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RegistryUnavailableError(f"cannot create registry folder {self.root}: {exc}") from exc
        self._recover()
        self._clean_up()

    # --- locking & manifests -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lock(self, name: str, *, wait: bool = True) -> Iterator[bool]:
        """Hold the flock ``locks/<name>``; with ``wait=False``, yield False at once when another holds it."""
        with open(self.root / "locks" / name, "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _changing(self, task: str) -> Iterator[None]:
        """One change of ``task``: under its lock, between a ``pending/`` marker and a generation bump."""
        marker = self.root / "pending" / task
        with self._lock(f"{task}.lock"):
            marker.touch()
            _fsync_dir(marker.parent)
            try:
                yield
            finally:  # also after an error: whatever was written is announced (a spurious bump costs a diff)
                self._bump_generation(task)
                marker.unlink()

    def _recover(self) -> None:
        """Move the generation for every change whose writer died between its first visible write and its
        generation bump (its marker is there, its task lock is free), and clear what that writer left in its task's
        folder: temporary files, a patch file no manifest names, a folder without one."""
        for marker in (self.root / "pending").iterdir():
            with self._lock(f"{marker.name}.lock", wait=False) as held:
                if held and marker.exists():  # else: a live writer, or one that finished since the listing
                    folder = self.root / "tasks" / marker.name
                    if _is_task_name(marker.name) and folder.is_dir():
                        self._clean_task_folder(folder)
                    self._bump_generation(marker.name)
                    marker.unlink()

    def _clean_up(self) -> None:
        """Remove what a crash leaves outside task folders: half-deleted tasks, temporary files of the registry's
        own files. (What a writer that died leaves in its task's folder is cleared by ``_recover``, which its marker
        leads to: opening a registry reads no task folder, however many there are.)"""
        for leftover in (self.root / "trash").iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        with self._lock(".global"):
            for tmp in self.root.glob(f".*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)

    def _clean_task_folder(self, folder: Path) -> None:
        if not (folder / MANIFEST).is_file():  # a first put that died before its manifest: nothing was visible
            shutil.rmtree(folder, ignore_errors=True)
            return
        named = {self._file(int(v)) for v in self._read_manifest(folder.name)["versions"]}
        for path in folder.iterdir():
            if path.name.endswith(TMP_SUFFIX) or (path.name.endswith(FILE_SUFFIX) and path.name not in named):
                path.unlink(missing_ok=True)

    def _task_dir(self, task: str) -> Path:
        return self.root / "tasks" / validate_task_name(task)

    def _read_manifest(self, task: str) -> dict[str, Any]:
        try:
            raw = (self._task_dir(task) / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise TaskNotFoundError(task) from None
        try:
            manifest: dict[str, Any] = json.loads(raw)
        except ValueError as exc:
            raise RegistryError(f"manifest of task {task!r} is damaged ({exc}); restore it from a backup") from exc
        return manifest

    def _write_manifest(self, task: str, manifest: dict[str, Any]) -> None:
        atomic_write(self._task_dir(task) / MANIFEST, json.dumps(manifest, sort_keys=True, indent=1).encode())

    def _bump_generation(self, task: str) -> None:
        with self._lock(".global"):
            gen = self.generation() + 1
            log_path = self.root / CHANGE_LOG
            # the log line first: a watcher that sees the generation finds the line (a crash in between leaves a
            # line for a step that never came; the next change takes its number, and a watcher checks both tasks)
            with open(log_path, "ab") as f:
                f.write(f"{gen} {task}\n".encode())
                size = f.tell()
            if size > CHANGE_LOG_MAX_BYTES:  # keep the newer half (a new file: watchers see it by its inode)
                kept = log_path.read_bytes()[size // 2 :]
                atomic_write(log_path, kept[kept.index(b"\n") + 1 :])
            atomic_write(self.root / "GENERATION", str(gen).encode())

    def change_cursor(self) -> tuple[int, Any]:
        """The generation and the change log's end (its inode and size), read together."""
        with self._lock(".global"):
            return self.generation(), self._log_end()

    def _log_end(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.root / CHANGE_LOG)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size

    def changed_tasks(self, since: int, cursor: Any) -> tuple[int, Any, set[str] | None]:
        """The tasks the log names for the generation's steps after ``since``, read from ``cursor`` (the whole
        file when it was rewritten since); None when those lines do not account for every step."""
        with self._lock(".global"):
            gen = self.generation()
            try:
                f = open(self.root / CHANGE_LOG, "rb")  # noqa: SIM115 - closed below, after the lock's reads
            except FileNotFoundError:
                return gen, None, None
            with f:
                st = os.fstat(f.fileno())
                if cursor is not None and cursor[0] == st.st_ino and cursor[1] <= st.st_size:
                    f.seek(cursor[1])
                tail = f.read()
                end = (st.st_ino, f.tell())
        steps, touched = set(), set()
        for line in tail.splitlines():
            number, _, task = line.decode(errors="replace").partition(" ")
            if number.isdigit() and since < int(number) <= gen and _is_task_name(task):  # else: not accounted for
                steps.add(int(number))
                touched.add(task)
        if len(steps) != gen - since:
            return gen, end, None
        return gen, end, touched

    @staticmethod
    def _info(manifest: dict[str, Any], version: int) -> VersionInfo:
        return VersionInfo.from_dict(manifest["versions"][str(version)])

    @staticmethod
    def _file(version: int) -> str:
        return f"v{version:08d}{FILE_SUFFIX}"

    # --- writes --------------------------------------------------------------------------------------------
    def put(self, patch: Patch) -> VersionInfo:
        task = validate_task_name(patch.meta.task)
        data = patch.data
        with self._changing(task):
            try:
                manifest = self._read_manifest(task)
            except TaskNotFoundError:
                manifest = {"task": task, "current": 0, "last": 0, "versions": {}}
            version = int(manifest["last"]) + 1
            folder = self._task_dir(task)
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(folder / self._file(version), data)
            info = VersionInfo(task, version, patch.patch_id, len(data), utc_now())
            manifest["versions"][str(version)] = info.to_dict()
            self._retire(manifest)
            manifest["current"] = manifest["last"] = version
            self._write_manifest(task, manifest)
        self._retain(task)
        return info

    @staticmethod
    def _retire(manifest: dict[str, Any]) -> None:
        """The current version stops being current now (retention keeps it a while: versions_to_prune)."""
        if manifest["current"]:
            manifest.setdefault("retired", {})[str(manifest["current"])] = time.time()

    def delete(self, task: str) -> None:
        folder = self._task_dir(task)
        if not (folder / MANIFEST).is_file():
            raise TaskNotFoundError(task)
        with self._changing(task):
            if not (folder / MANIFEST).is_file():
                raise TaskNotFoundError(task)  # deleted while we waited for the lock (nothing changed)
            trash = self.root / "trash" / f"{task}.{uuid.uuid4().hex}"
            os.replace(folder, trash)  # atomic: readers see the whole task or nothing
            _fsync_dir(self.root / "tasks")
            shutil.rmtree(trash, ignore_errors=True)

    def set_current(self, task: str, version: int) -> VersionInfo:
        manifest = self._read_manifest(task)
        if str(version) not in manifest["versions"]:
            raise VersionNotFoundError(task, version, sorted(int(v) for v in manifest["versions"]))
        with self._changing(task):
            manifest = self._read_manifest(task)  # again, under the lock
            if str(version) not in manifest["versions"]:
                raise VersionNotFoundError(task, version, sorted(int(v) for v in manifest["versions"]))
            if int(manifest["current"]) != version:
                self._retire(manifest)
            manifest["current"] = version
            self._write_manifest(task, manifest)
        return self._info(manifest, version)

    def prune(
        self, task: str, keep: int | None, *, dry_run: bool = False, also: Collection[int] = ()
    ) -> list[VersionInfo]:
        with self._lock(f"{task}.lock"):  # the current version does not change: no generation bump
            manifest = self._read_manifest(task)
            retired = {int(v): t for v, t in manifest.get("retired", {}).items()}
            infos = [self._info(manifest, int(v)) for v in manifest["versions"]]
            current = int(manifest["current"])
            gone = versions_to_prune(infos, current, retired, keep, time.time(), self.retired_grace_s, also)
            if dry_run or not gone:
                return gone
            for info in gone:  # the manifest first: a crash before the files go leaves files it no longer names,
                del manifest["versions"][str(info.version)]  # which opening the registry removes
                manifest.get("retired", {}).pop(str(info.version), None)
            self._write_manifest(task, manifest)
            for info in gone:
                (self._task_dir(task) / self._file(info.version)).unlink(missing_ok=True)
        return gone

    # --- reads ---------------------------------------------------------------------------------------------
    def info(self, task: str, version: int | None = None) -> VersionInfo:
        manifest = self._read_manifest(task)
        v = int(manifest["current"]) if version is None else version
        if str(v) not in manifest["versions"]:
            raise VersionNotFoundError(task, v, sorted(int(x) for x in manifest["versions"]))
        return self._info(manifest, v)

    def get_bytes(self, task: str, version: int | None = None) -> tuple[VersionInfo, bytes]:
        info = self.info(task, version)
        try:
            data = (self._task_dir(task) / self._file(info.version)).read_bytes()
        except FileNotFoundError:
            raise TaskNotFoundError(task) from None  # deleted between the manifest read and this one
        if len(data) != info.size:
            raise RegistryError(f"patch file of {task!r} v{info.version} has the wrong size: the registry is damaged")
        return info, data

    def versions(self, task: str) -> list[VersionInfo]:
        manifest = self._read_manifest(task)
        return [self._info(manifest, int(v)) for v in sorted(manifest["versions"], key=int)]

    def tasks(self) -> list[str]:
        # a folder whose name is not a task name (one written before names were checked strictly) is not listed
        return sorted(
            p.name for p in (self.root / "tasks").iterdir() if _is_task_name(p.name) and (p / MANIFEST).is_file()
        )

    def _names_after(self, after: str | None, prefix: str, count: int) -> list[str]:
        return page_names(self._folder_names(), after, prefix, count)

    def count(self) -> int:
        return len(self._folder_names())  # a first put under way may count a moment early

    def _folder_names(self) -> list[str]:
        """The task folders' names, sorted: listed again only when the generation moved (every change moves it). A
        folder that is not a task yet (no manifest) or any more is left out by the reads of its record."""
        gen = self.generation()
        with self._names_lock:
            if self._names is None or self._names[0] != gen:
                with os.scandir(self.root / "tasks") as entries:
                    self._names = (gen, sorted(e.name for e in entries if _is_task_name(e.name)))
            return self._names[1]

    def snapshot(self) -> dict[str, VersionInfo]:
        out: dict[str, VersionInfo] = {}
        for task in self.tasks():
            try:
                out[task] = self.info(task)
            except TaskNotFoundError:
                continue  # deleted while we listed
        return out

    def generation(self) -> int:
        try:
            return int((self.root / "GENERATION").read_bytes() or 0)
        except FileNotFoundError:
            return 0

    def wait_for_change(self, since: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            self._recover()  # a writer that died mid-change: its change is announced here
            gen = self.generation()
            if gen != since or time.monotonic() >= deadline:
                return gen
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def ping(self) -> None:
        if not os.access(self.root / "tasks", os.R_OK | os.W_OK | os.X_OK):
            raise RegistryUnavailableError(f"registry folder {self.root} is not readable and writable")
