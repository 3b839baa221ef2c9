"""Patch registries: ``open_registry(url)`` picks the backend from the URL scheme.

* ``disk:///abs/path`` or a plain folder path (the default, embedded);
* ``redis://host:port/db`` or ``rediss://...`` (several replicas); ``?prefix=name:`` sets the key prefix;
* ``redis+sentinel://[:password@]host:port[,host:port...]/SERVICE[/DB]``: the primary that Sentinel names, followed
  across failovers.
"""

from __future__ import annotations

from collections.abc import Callable

from patchserve.patches.errors import RegistryError
from patchserve.patches.store.base import Change, Registry, TaskPage, VersionInfo, diff_snapshots, redact_url
from patchserve.patches.store.disk import DiskRegistry


def _open_disk(url: str, min_replicas: int) -> Registry:
    if min_replicas:
        raise RegistryError(
            "--redis-min-replicas needs a Redis registry; a disk registry has no replicas (set it to 0)"
        )
    path = url[len("disk://") :] if url.startswith("disk://") else url
    if not path:
        raise RegistryError("disk registry URL has no path: use disk:///absolute/path or disk://relative/path")
    return DiskRegistry(path)


def _open_redis(url: str, min_replicas: int) -> Registry:
    from patchserve.patches.store.redis import RedisRegistry

    return RedisRegistry(url, min_replicas=min_replicas)


BACKENDS: dict[str, Callable[[str, int], Registry]] = {
    "disk": _open_disk,
    "redis": _open_redis,
    "rediss": _open_redis,
    "unix": _open_redis,
    "redis+sentinel": _open_redis,
}


def open_registry(url: str, *, keep_versions: int | None = None, min_replicas: int = 0) -> Registry:
    """Open the registry a URL names. A URL without a scheme is a disk folder. ``keep_versions``: after each put,
    delete the task's versions beyond the newest N (``Registry.prune``); None keeps all. ``min_replicas`` (Redis):
    a write counts as made only once that many replicas hold it (``DurableWrites``)."""
    scheme = url.split("://", 1)[0] if "://" in url else "disk"
    if scheme not in BACKENDS:
        raise RegistryError(
            f"unknown registry URL scheme {scheme!r} in {redact_url(url)!r}; use one of {sorted(BACKENDS)}"
        )
    registry = BACKENDS[scheme](url, min_replicas)
    registry.keep_versions = keep_versions
    return registry


__all__ = [
    "BACKENDS",
    "Change",
    "DiskRegistry",
    "Registry",
    "TaskPage",
    "VersionInfo",
    "diff_snapshots",
    "open_registry",
    "redact_url",
]
