"""Disk registry: the embedded default. One folder, safe for several processes on one machine.

Layout under the root::

    GENERATION                       counter, rewritten atomically on every change (what watchers poll)
    locks/<task>.lock, locks/.global  flock files (outside task folders, so a delete cannot strand a waiter)
    tasks/<task>/manifest.json       {"current": n, "last": n, "versions": {"1": VersionInfo, ...}}
    tasks/<task>/v00000001.safetensors

Every file is written to a temporary name, fsynced, renamed into place and the folder fsynced. A patch file is
written before the manifest that names it, so a reader never sees a half-written patch and a crash mid-write leaves
the previous version current (the orphan file is overwritten by the next put).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patches.errors import RegistryError, RegistryUnavailableError, TaskNotFoundError, VersionNotFoundError
from patches.format import FILE_SUFFIX, Patch, validate_task_name
from patches.store.base import Registry, VersionInfo, utc_now

MANIFEST = "manifest.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
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
        try:
            for sub in ("tasks", "locks", "trash"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RegistryUnavailableError(f"cannot create registry folder {self.root}: {exc}") from exc
        self._clean_trash()

    # --- locking & manifests -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        with open(self.root / "locks" / name, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

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

    def _bump_generation(self) -> None:
        with self._lock(".global"):
            atomic_write(self.root / "GENERATION", str(self.generation() + 1).encode())

    @staticmethod
    def _info(manifest: dict[str, Any], version: int) -> VersionInfo:
        return VersionInfo.from_dict(manifest["versions"][str(version)])

    @staticmethod
    def _file(version: int) -> str:
        return f"v{version:08d}{FILE_SUFFIX}"

    def _clean_trash(self) -> None:
        for leftover in (self.root / "trash").iterdir():
            shutil.rmtree(leftover, ignore_errors=True)

    # --- writes --------------------------------------------------------------------------------------------
    def put(self, patch: Patch) -> VersionInfo:
        task = validate_task_name(patch.meta.task)
        data = patch.data
        with self._lock(f"{task}.lock"):
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
            manifest["current"] = manifest["last"] = version
            self._write_manifest(task, manifest)
        self._bump_generation()
        return info

    def delete(self, task: str) -> None:
        with self._lock(f"{validate_task_name(task)}.lock"):
            folder = self._task_dir(task)
            if not (folder / MANIFEST).is_file():
                raise TaskNotFoundError(task)
            trash = self.root / "trash" / f"{task}.{uuid.uuid4().hex}"
            os.replace(folder, trash)  # atomic: readers see the whole task or nothing
            _fsync_dir(self.root / "tasks")
            shutil.rmtree(trash, ignore_errors=True)
        self._bump_generation()

    def set_current(self, task: str, version: int) -> VersionInfo:
        with self._lock(f"{validate_task_name(task)}.lock"):
            manifest = self._read_manifest(task)
            if str(version) not in manifest["versions"]:
                raise VersionNotFoundError(task, version, sorted(int(v) for v in manifest["versions"]))
            manifest["current"] = version
            self._write_manifest(task, manifest)
        self._bump_generation()
        return self._info(manifest, version)

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
        return sorted(p.name for p in (self.root / "tasks").iterdir() if (p / MANIFEST).is_file())

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
            gen = self.generation()
            if gen != since or time.monotonic() >= deadline:
                return gen
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def ping(self) -> None:
        if not os.access(self.root / "tasks", os.R_OK | os.W_OK | os.X_OK):
            raise RegistryUnavailableError(f"registry folder {self.root} is not readable and writable")
