"""Talking to Redis, for the registry and the job queue alike: URLs (plain, TLS, Sentinel), connections that follow
a failover, writes acknowledged by N replicas (``DurableWrites``), and Redis's errors as patchserve's, each saying
what to do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from patchserve.patches.errors import (
    RegistryError,
    RegistryUnavailableError,
    ReplicationError,
)
from patchserve.patches.store.base import redact_url
from patchserve.patches.store.redis_keys import DEFAULT_PREFIX

T = TypeVar("T")


def parse_redis_url(url: str) -> tuple[str, str]:
    """Split ``redis://host:port/db?prefix=p:`` into (connection URL, key prefix)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    prefix = query.pop("prefix", [DEFAULT_PREFIX])[0]
    rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")), prefix


SENTINEL_SCHEME = "redis+sentinel"
REDIS_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
# a Redis that stops answering (a partition, not a crash) fails a call after 10 s instead of hanging it; the longest
# blocking command is a worker's 2 s XREADGROUP
_TIMEOUTS = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0, "health_check_interval": 30}


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis (directly or through Sentinel) rather than a disk folder."""
    return "://" in url and url.split("://", 1)[0] in REDIS_SCHEMES


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None, str | None]:
    """``redis+sentinel://[:password@]host:port[,host:port...]/SERVICE[/DB][?sentinel_password=...]`` ->
    (sentinels, service name, db, the data nodes' password, the sentinels' password)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    password = unquote(userinfo.partition(":")[2]) or None
    bad = f"Sentinel URL {redact_url(url)!r}: "
    sentinels = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise RegistryError(bad + f"{node!r} is not host:port (list every Sentinel as host:port, comma-separated)")
        sentinels.append((host.strip("[]"), int(port)))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise RegistryError(bad + "the path must be /SERVICE_NAME or /SERVICE_NAME/DB (the name Sentinel monitors)")
    sentinel_password = parse_qs(parts.query).get("sentinel_password", [None])[0]
    return sentinels, path[0], int(path[1]) if len(path) == 2 else 0, password, sentinel_password


class _Sentinels(Sentinel):
    """redis-py's Sentinel client, except that a Sentinel in the middle of failing the primary over is not asked
    which node is primary: it names the old one until its failover ends (seconds after the others already name
    the new one), and in a switchover the old one still answers and takes writes that will be dropped."""

    def check_master_state(self, state: dict[str, Any], service_name: str) -> bool:
        if "failover_in_progress" in str(state.get("flags", "")).split(","):
            return False
        return bool(super().check_master_state(state, service_name))


def connect_redis(conn_url: str, *, max_connections: int | None = None, retry: bool = True) -> redis.Redis:
    """A client for ``conn_url`` (no ``prefix``): ``redis://``, ``rediss://`` and ``unix://`` directly;
    ``redis+sentinel://`` to whichever node the Sentinels name primary, asking them again whenever it fails or
    turns out to be a replica, so a failover is followed without a restart. ``retry=False``: a command that fails
    on its connection raises at once instead of being sent again on a new one (redis-py's default retries)."""
    options: dict[str, Any] = dict(_TIMEOUTS)
    if not retry:
        options["retry"] = Retry(NoBackoff(), 0)
    if not conn_url.startswith(SENTINEL_SCHEME + "://"):
        return redis.Redis.from_url(conn_url, max_connections=max_connections, **options)
    sentinels, service, db, password, sentinel_password = parse_sentinel_url(conn_url)
    sentinel = _Sentinels(
        sentinels,
        sentinel_kwargs={"socket_connect_timeout": 2.0, "socket_timeout": 2.0, "password": sentinel_password},
        password=password,
        **options,
    )
    return sentinel.master_for(service, db=db, max_connections=max_connections)


REPLICA_WAIT_S = 2.0  # how long a write waits for --redis-min-replicas replicas before it answers 503


class DurableWrites:
    """Writes that count as made only once ``min_replicas`` replicas hold them too (``--redis-min-replicas``).

    Redis replicates asynchronously, and its WAIT command blocks until the replicas hold every earlier write *of the
    connection it runs on*. So with ``min_replicas`` > 0 every write goes through one dedicated connection (one
    write at a time per process: registrations and job submissions are rare), followed there by WAIT. With 0,
    writes run on the caller's client as before.

    The write and its WAIT must run on the same connection: had the primary died between them, a WAIT sent on a new
    connection -- to the new primary, or to whatever answers at that address now -- would find no write of its own to
    wait for and answer at once with every replica, acknowledging a write that may be lost. redis-py replaces a
    broken connection silently (when it takes one from its pool, and when it retries a command), so each write is
    bracketed by the connection's identity, the server's run id and the connection's client id: if they differ
    after the WAIT, the connection was replaced, and the answer is a ReplicationError (the write may or may not
    have been made), never an acknowledgement. The connection does not retry commands either.

    Through Sentinel, a write that enough replicas hold can still be lost when the Sentinels promote another
    replica while the primary it was made on lives on (a second failover started on a healthy new primary that
    answered a Sentinel's ping late: the old side keeps a replica attached, so WAIT still passes, until the
    Sentinels demote it and its writes are dropped; in a switchover, every time). So the write is acknowledged
    only when, after its WAIT, ``PrimaryCheck`` finds its node a primary the Sentinels name and no other node they
    know acting as one (the node it took over from excepted). What it cannot catch: a write that reached only the
    replica not promoted, in the milliseconds before a promotion."""

    def __init__(self, conn_url: str, min_replicas: int, what: str, wait_s: float = REPLICA_WAIT_S) -> None:
        if min_replicas < 0:
            raise RegistryError(f"--redis-min-replicas must be 0 or more, got {min_replicas}")
        self.min_replicas, self.what, self.wait_s = min_replicas, what, wait_s
        self._client = connect_redis(conn_url, max_connections=1, retry=False) if min_replicas else None
        self._primary_check = PrimaryCheck.of(self._client) if self._client is not None else None
        self._lock = threading.Lock()

    def run(self, client: redis.Redis, write: Callable[[redis.Redis], T]) -> T:
        """``write(a client)``, then (with ``min_replicas``) wait until enough replicas hold it: ReplicationError
        when they do not in time, saying that the write may still have happened."""
        if self._client is None:
            return write(client)
        with self._lock:
            try:  # the one step that may reconnect: a connection left dead by a failover is replaced here
                before = self._identity()
            except (redis.ConnectionError, redis.TimeoutError):
                before = call_redis(self._identity, self.what)
            value = write(self._client)
            try:
                acked = int(self._client.wait(self.min_replicas, int(self.wait_s * 1000)))
                after = self._identity()
                replication = self._client.info("replication") if self._primary_check else {}
            except redis.RedisError as exc:
                raise ReplicationError(
                    f"{self.what}: the write was sent to the primary, then the connection failed ({exc}) before "
                    f"{self.min_replicas} replica(s) confirmed it: it may or may not have been made, and may not "
                    "survive a failover. Check whether it is there before retrying."
                ) from exc
            try:
                # also when too few replicas confirmed: a node being demoted has lost them, and the next write must
                # not go to it again
                same = after == before
                usurped = self._primary_check.usurped(replication) if self._primary_check and same else None
            except redis.RedisError as exc:
                raise ReplicationError(
                    f"{self.what}: the write was made on the primary and {acked} replica(s) hold it, but the Sentinels "
                    f"could not confirm that it is still the primary ({exc}): it may be lost in a failover. Check "
                    "whether it is there before retrying."
                ) from exc
        if after != before:
            raise ReplicationError(
                f"{self.what}: the connection to the primary was replaced while the write waited for "
                f"{self.min_replicas} replica(s) (a failover?): it may or may not have been made, and may not survive "
                "it. Check whether it is there before retrying."
            )
        if usurped is not None:
            # the next write (and read) asks the Sentinels again instead of going on with a node being demoted: it
            # answers until they make it a replica, which can take them 10 s
            self._client.connection_pool.disconnect()
            client.connection_pool.disconnect(inuse_connections=False)
            raise ReplicationError(
                f"{self.what}: the write was made on the primary and {acked} replica(s) hold it, but {usurped} (a "
                "failover is under way): it may be lost when this primary is demoted. Check whether it is there "
                "before retrying."
            )
        if acked < self.min_replicas:
            raise ReplicationError(
                f"{self.what}: the write was made on the primary, but {acked} of the {self.min_replicas} replica(s) "
                f"required (--redis-min-replicas) confirmed it within {self.wait_s:g} s, so it may be lost if the "
                "primary fails now. Check whether it is there before retrying."
            )
        return value

    def _identity(self) -> tuple[str, int]:
        """(the server's run id, this connection's client id): equal twice only on one unbroken connection."""
        assert self._client is not None
        return str(self._client.info("server")["run_id"]), int(self._client.client_id())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._primary_check is not None:
            self._primary_check.close()


class PrimaryCheck:
    """Whether the primary a Sentinel-managed client is connected to is still the only one: asked after a write's
    WAIT, before it is acknowledged (see ``DurableWrites``)."""

    NODE_TIMEOUT_S = 0.5  # a replica that does not answer in this long is not asked (a dead node takes no writes)

    def __init__(self, pool: SentinelConnectionPool) -> None:
        self.pool = pool
        self._nodes: dict[tuple[str, int], redis.Redis] = {}

    @classmethod
    def of(cls, client: redis.Redis) -> PrimaryCheck | None:
        """A check for ``client`` when it reaches its primary through Sentinel; None otherwise (nothing to ask)."""
        pool = client.connection_pool
        return cls(pool) if isinstance(pool, SentinelConnectionPool) else None

    def usurped(self, ours: dict[str, Any]) -> str | None:
        """None while the node the client is connected to (``ours``: its INFO replication) is a primary the Sentinels
        name and no other node they know acts as a primary, other than the node ours took over from (in a switchover
        the old primary answers as one until the Sentinels demote it: its writes are the ones at risk, not ours).
        Otherwise what is wrong, in words. Every Sentinel is asked: during a failover they disagree for a second
        or two. When none can be asked, a ConnectionError (redis-py's MasterNotFoundError): the write is not
        acknowledged then either."""
        address = self.pool.master_address
        manager, service = self.pool.sentinel_manager, self.pool.service_name
        named: set[tuple[str, int]] = set()
        known: set[tuple[str, int]] = set()
        for sentinel in manager.sentinels:
            try:
                state = sentinel.sentinel_masters().get(service)
                replicas = sentinel.sentinel_slaves(service)
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            if state and manager.check_master_state(state, service):
                named.add((state["ip"], int(state["port"])))
            known.update((r["ip"], int(r["port"])) for r in replicas if not (r["is_sdown"] or r["is_odown"]))
        if not named:
            raise MasterNotFoundError(f"no Sentinel of {service!r} names a primary")
        if address not in named:
            return f"the Sentinels name {', '.join(sorted(map(_address, named)))} primary, not {_address(address)}"
        for other in sorted((named | known) - {address}):
            try:
                theirs = self._node(other).info("replication")
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            # a promoted replica keeps its old primary's replication id as master_replid2: that old primary, still
            # answering as one, is ours's predecessor; any other node acting as a primary may be its successor
            predecessor = theirs.get("master_replid") == ours.get("master_replid2")
            if theirs.get("role") == "master" and not predecessor:
                return f"{_address(other)} acts as a primary too"
        return None

    def _node(self, address: tuple[str, int]) -> redis.Redis:
        if address not in self._nodes:
            kwargs = self.pool.connection_kwargs
            self._nodes[address] = redis.Redis(
                host=address[0],
                port=int(address[1]),
                username=kwargs.get("username"),
                password=kwargs.get("password"),
                socket_connect_timeout=self.NODE_TIMEOUT_S,
                socket_timeout=self.NODE_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0),
            )
        return self._nodes[address]

    def close(self) -> None:
        for client in self._nodes.values():
            client.close()
        self._nodes.clear()


def _address(address: tuple[str, int] | None) -> str:
    return "no node" if address is None else f"{address[0]}:{address[1]}"


def _refusal_hint(exc: redis.ResponseError) -> str | None:
    """What to do about a Redis that answers but refuses writes; None for any other error."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "it is out of memory: raise its maxmemory or free memory"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "it is a read-only replica: point the URL at the primary"
    if "MISCONF" in str(exc):  # (in a pipeline the text comes after "Command # n ... caused error: ")
        return "it cannot save to disk: check its disk and logs"
    return None


def call_redis(fn: Callable[[], T], what: str) -> T:
    """``fn()``, with Redis being unreachable or refusing writes raised as RegistryUnavailableError (503 in the
    server) naming ``what`` ("Redis registry at URL") and what to do."""
    try:
        return fn()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RegistryUnavailableError(f"{what} is unreachable: {exc}") from exc
    except redis.ResponseError as exc:
        hint = _refusal_hint(exc)
        if hint is None:
            raise
        raise RegistryUnavailableError(f"{what} refuses writes ({exc}); {hint}") from exc


def run_transaction(client: redis.Redis, fn: Callable[[Any], T], *watched: str, what: str) -> T:
    """``fn(pipe)`` under WATCH on ``watched``, retried on a conflicting write; returns its value. Errors as in
    ``call_redis``."""
    run: Any = client.transaction
    return call_redis(lambda: cast(T, run(fn, *watched, value_from_callable=True)), what)
