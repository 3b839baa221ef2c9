"""Redis registry, for several server replicas and trainer workers sharing one set of patches.

A version's blob, its record and the task's pointer are written in one MULTI/EXEC transaction guarded by WATCH
on the task's hash, so concurrent puts get distinct, ordered versions and a reader never sees a pointer to a blob
that is not there. Changes are announced on a pub/sub channel, counted in a generation key and logged in a
stream of task names, so a watcher reads only the tasks that changed (a snapshot of every task only when the log
cannot say exactly: trimmed, or written by an older version).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import redis

from patchserve.patches.errors import RegistryUnavailableError, TaskNotFoundError, VersionNotFoundError
from patchserve.patches.format import Patch
from patchserve.patches.store.base import Registry, VersionInfo, redact_url, utc_now, versions_to_prune
from patchserve.patches.store.redis_client import (
    DurableWrites,
    call_redis,
    connect_redis,
    parse_redis_url,
    run_transaction,
)
from patchserve.patches.store.redis_keys import CHANGE_LOG_LENGTH, RedisKeys
from patchserve.patches.validation import validate_task_name

T = TypeVar("T")
log = logging.getLogger(__name__)
_MAX_LOG_READ = 1000  # a watcher further behind than this diffs a snapshot instead (bounded memory per read)


class RedisRegistry(Registry):
    """Registry in Redis (``redis://host:port/db``, or ``redis+sentinel://host:port,.../SERVICE[/DB]`` to follow
    failovers; add ``?prefix=name:`` to change the key prefix)."""

    def __init__(
        self, url: str, *, prefix: str | None = None, client: redis.Redis | None = None, min_replicas: int = 0
    ) -> None:
        conn_url, url_prefix = parse_redis_url(url)
        self.url = redact_url(url)
        self.keys = RedisKeys(prefix if prefix is not None else url_prefix)
        self.r = client or connect_redis(conn_url)
        self._what = f"Redis registry at {self.url}"
        self.durable = DurableWrites(conn_url, min_replicas, self._what)
        self._pubsub: Any = None
        self._pubsub_lock = threading.Lock()
        self._names_indexed = False

    def _call(self, fn: Callable[[], T]) -> T:
        return call_redis(fn, self._what)

    def _transaction(self, fn: Callable[[Any], T], *watched: str) -> T:
        return self.durable.run(self.r, lambda client: run_transaction(client, fn, *watched, what=self._what))

    # --- writes --------------------------------------------------------------------------------------------
    def put(self, patch: Patch) -> VersionInfo:
        task = validate_task_name(patch.meta.task)
        data, k = patch.data, self.keys

        def tx(pipe: Any) -> VersionInfo:
            last, current = pipe.hmget(k.task(task), "last", "current")
            version = int(last or 0) + 1
            info = VersionInfo(task, version, patch.patch_id, len(data), utc_now())
            pipe.multi()
            if current is not None:  # it stops being current now (retention keeps it a while)
                pipe.hset(k.retired(task), current, time.time())
            pipe.set(k.blob(task, version), data)
            pipe.hset(k.versions(task), str(version), json.dumps(info.to_dict()))
            pipe.hset(k.task(task), mapping={"current": version, "last": version})
            pipe.sadd(k.tasks, task)
            pipe.zadd(k.task_names, {task: 0})
            pipe.incr(k.generation)
            pipe.xadd(k.change_log, {"task": task}, maxlen=CHANGE_LOG_LENGTH, approximate=True)
            pipe.publish(k.changes, task)
            return info

        info = self._transaction(tx, k.task(task))
        self._retain(task)
        return info

    def delete(self, task: str) -> None:
        k = self.keys
        validate_task_name(task)

        def tx(pipe: Any) -> None:
            if not pipe.exists(k.task(task)):
                raise TaskNotFoundError(task)
            versions = pipe.hkeys(k.versions(task))
            pipe.multi()
            pipe.delete(k.task(task), k.versions(task), k.retired(task), *[k.blob(task, int(v)) for v in versions])
            pipe.srem(k.tasks, task)
            pipe.zrem(k.task_names, task)
            pipe.incr(k.generation)
            pipe.xadd(k.change_log, {"task": task}, maxlen=CHANGE_LOG_LENGTH, approximate=True)
            pipe.publish(k.changes, task)

        self._transaction(tx, k.task(task), k.versions(task))

    def set_current(self, task: str, version: int) -> VersionInfo:
        k = self.keys
        validate_task_name(task)

        def tx(pipe: Any) -> VersionInfo:
            raw = pipe.hget(k.versions(task), str(version))
            if raw is None:
                if not pipe.exists(k.task(task)):
                    raise TaskNotFoundError(task)
                raise VersionNotFoundError(task, version, sorted(int(v) for v in pipe.hkeys(k.versions(task))))
            current = pipe.hget(k.task(task), "current")
            pipe.multi()
            if current is not None and int(current) != version:
                pipe.hset(k.retired(task), current, time.time())
            pipe.hset(k.task(task), "current", version)
            pipe.incr(k.generation)
            pipe.xadd(k.change_log, {"task": task}, maxlen=CHANGE_LOG_LENGTH, approximate=True)
            pipe.publish(k.changes, task)
            return VersionInfo.from_dict(json.loads(raw))

        return self._transaction(tx, k.task(task), k.versions(task))

    def prune(
        self, task: str, keep: int | None, *, dry_run: bool = False, also: Collection[int] = ()
    ) -> list[VersionInfo]:
        k = self.keys
        validate_task_name(task)

        def tx(pipe: Any) -> list[VersionInfo]:
            current = pipe.hget(k.task(task), "current")
            if current is None:
                raise TaskNotFoundError(task)
            infos = [VersionInfo.from_dict(json.loads(raw)) for raw in pipe.hvals(k.versions(task))]
            retired = {int(v): float(t) for v, t in pipe.hgetall(k.retired(task)).items()}
            gone = versions_to_prune(infos, int(current), retired, keep, time.time(), self.retired_grace_s, also)
            if dry_run or not gone:
                return gone
            pipe.multi()  # the current version does not change: no generation bump, nothing for watchers
            pipe.delete(*[k.blob(task, v.version) for v in gone])
            pipe.hdel(k.versions(task), *[str(v.version) for v in gone])
            pipe.hdel(k.retired(task), *[str(v.version) for v in gone])
            return gone

        watched = (k.task(task), k.versions(task), k.retired(task))
        if dry_run:  # writes nothing: no replicas to wait for
            return run_transaction(self.r, tx, *watched, what=self._what)
        return self._transaction(tx, *watched)

    # --- reads ---------------------------------------------------------------------------------------------
    def _current(self, task: str) -> int:
        raw = self._call(lambda: self.r.hget(self.keys.task(validate_task_name(task)), "current"))
        if raw is None:
            raise TaskNotFoundError(task)
        return int(raw)

    def info(self, task: str, version: int | None = None) -> VersionInfo:
        v = self._current(task) if version is None else version
        raw = self._call(lambda: self.r.hget(self.keys.versions(task), str(v)))
        if raw is None:
            if version is not None:
                self._current(task)  # TaskNotFound when the whole task is gone
            raise VersionNotFoundError(task, v, [i.version for i in self.versions(task)])
        return VersionInfo.from_dict(json.loads(raw))

    def get_bytes(self, task: str, version: int | None = None) -> tuple[VersionInfo, bytes]:
        # Versions are immutable: once the pointer names v, v's record and blob never change, so three plain
        # reads are consistent; a delete in between shows as a missing key, reported as "not found".
        k = self.keys
        v = self._current(task) if version is None else version
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(k.versions(task), str(v))
        pipe.get(k.blob(task, v))
        raw, data = self._call(pipe.execute)
        if raw is None or data is None:
            if version is not None:
                self._current(task)
                raise VersionNotFoundError(task, v, [i.version for i in self.versions(task)])
            raise TaskNotFoundError(task)
        return VersionInfo.from_dict(json.loads(raw)), bytes(data)

    def versions(self, task: str) -> list[VersionInfo]:
        raw = self._call(lambda: self.r.hgetall(self.keys.versions(validate_task_name(task))))
        if not raw:
            raise TaskNotFoundError(task)
        infos = [VersionInfo.from_dict(json.loads(v)) for v in raw.values()]
        return sorted(infos, key=lambda i: i.version)

    def tasks(self) -> list[str]:
        members: Any = self._call(lambda: self.r.smembers(self.keys.tasks))
        return sorted(n.decode() for n in members)

    def snapshot(self) -> dict[str, VersionInfo]:
        return self._current_infos(self.tasks())

    def _current_infos(self, names: list[str]) -> dict[str, VersionInfo]:
        if not names:
            return {}
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hget(k.task(n), "current")
        currents = self._call(pipe.execute)
        pipe = self.r.pipeline(transaction=False)
        live = [(n, int(c)) for n, c in zip(names, currents, strict=True) if c is not None]
        for n, c in live:
            pipe.hget(k.versions(n), str(c))
        records = self._call(pipe.execute)
        return {n: VersionInfo.from_dict(json.loads(r)) for (n, _), r in zip(live, records, strict=True) if r}

    def count(self) -> int:
        return int(self._call(lambda: self.r.scard(self.keys.tasks)))

    def _names_after(self, after: str | None, prefix: str, count: int) -> list[str]:
        self._index_names()
        low = b"(" + after.encode() if after is not None and after >= prefix else b"[" + prefix.encode()
        high = b"[" + prefix.encode() + b"\xff" if prefix else b"+"  # names are ASCII: 0xff sorts after them all
        names: Any = self._call(lambda: self.r.zrangebylex(self.keys.task_names, low, high, start=0, num=count))
        return [n.decode() for n in names]

    def _index_names(self) -> None:
        """Build the by-name index where it lacks names the task set holds (a registry written before the index
        existed), once per registry object: writes keep both since."""
        if self._names_indexed:
            return
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.scard(k.tasks)
        pipe.zcard(k.task_names)
        in_set, indexed = self._call(pipe.execute)
        if in_set != indexed:
            members: Any = self._call(lambda: self.r.smembers(k.tasks))
            names: list[bytes] = list(members)
            stale: Any = self._call(lambda: self.r.zrange(k.task_names, 0, -1))
            pipe = self.r.pipeline(transaction=False)
            for chunk in range(0, len(names), 10_000):
                pipe.zadd(k.task_names, dict.fromkeys(names[chunk : chunk + 10_000], 0))
            gone = set(stale) - set(names)
            if gone:
                pipe.zrem(k.task_names, *gone)
            self._call(pipe.execute)
            log.info("indexed %d task names for paging in %s", len(names), self.url)
        self._names_indexed = True

    def generation(self) -> int:
        return int(self._call(lambda: self.r.get(self.keys.generation)) or 0)

    def change_cursor(self) -> tuple[int, Any]:
        k = self.keys
        pipe = self.r.pipeline(transaction=True)  # one atomic read: the counter and the log move together
        pipe.get(k.generation)
        pipe.xrevrange(k.change_log, count=1)
        gen, newest = self._call(pipe.execute)
        return int(gen or 0), newest[0][0] if newest else b"0-0"

    def changed_tasks(self, since: int, cursor: Any) -> tuple[int, Any, set[str] | None]:
        """The log's entries after ``cursor``; exact when they are as many as the generation moved (every change
        adds one of each in the same transaction). Fewer -- trimmed away, or written by a version without the
        log -- and the caller diffs a snapshot."""
        k = self.keys
        pipe = self.r.pipeline(transaction=True)
        pipe.get(k.generation)
        pipe.xrange(k.change_log, min=b"(" + cursor, count=_MAX_LOG_READ + 1)
        pipe.xrevrange(k.change_log, count=1)
        raw_gen, entries, newest = self._call(pipe.execute)
        gen = int(raw_gen or 0)
        position = newest[0][0] if newest else cursor
        if len(entries) != gen - since:
            return gen, position, None
        return gen, position, {fields[b"task"].decode() for _, fields in entries}

    def wait_for_change(self, since: int, timeout: float) -> int:
        with self._pubsub_lock:
            if self._pubsub is None:
                ps = self.r.pubsub(ignore_subscribe_messages=True)
                self._call(lambda: ps.subscribe(self.keys.changes))
                self._pubsub = ps
            # Subscribed before reading the generation: a change after this read is either seen in the counter
            # now or arrives as a message below.
            try:
                gen = self.generation()
                if gen != since:
                    return gen
                self._call(lambda: self._pubsub.get_message(timeout=timeout))
                while self._call(lambda: self._pubsub.get_message(timeout=0)) is not None:
                    pass
            except RegistryUnavailableError:  # subscribe afresh next time, to the primary as it is then
                self._pubsub.close()
                self._pubsub = None
                raise
        return self.generation()

    def ping(self) -> None:
        self._call(self.r.ping)

    def close(self) -> None:
        with self._pubsub_lock:
            if self._pubsub is not None:
                self._pubsub.close()
                self._pubsub = None
        self.durable.close()
        self.r.close()
