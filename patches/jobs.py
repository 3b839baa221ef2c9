"""Training jobs: the gate, the deployment's limits and the Redis Streams queue that carries them (the training
config itself is ``patchserve.patches.train_config``).

Why Redis Streams with a consumer group (and not a job library): the deployment already runs Redis for the
registry; a consumer group gives exactly what the trainer needs -- each job delivered to one worker, a pending
list of unacknowledged jobs, and XAUTOCLAIM to hand a dead worker's job to another after a lease -- with no extra
dependency and no pickled payloads (rq and celery pickle by default; arq is asyncio-only). Jobs are JSON.

Lifecycle: queued -> running -> succeeded | rejected (failed the gate) | failed (bad data, a bug). A worker that
dies mid-job leaves the message pending; after ``lease`` seconds without a heartbeat another worker claims it and
retries (at most ``max_attempts`` times). Registration is idempotent: the trained patch's id is recorded in the
job before it is registered, and a retry that finds that id among the task's versions does not register it again.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass

from patchserve.patches.api import TERMINAL
from patchserve.patches.errors import JobError
from patchserve.patches.store.base import iso_time, redact_url
from patchserve.patches.store.redis_client import (
    DurableWrites,
    call_redis,
    connect_redis,
    is_redis_url,
    parse_redis_url,
    run_transaction,
)
from patchserve.patches.store.redis_keys import JOB_GROUP, RedisKeys
from patchserve.patches.train_config import TrainConfig, from_json
from patchserve.patches.validation import shown, unprintable

__all__ = ["TERMINAL", "Gate", "Job", "JobError", "JobLimits", "JobNotFoundError", "JobQueue", "JobStateError"]

JOB_FILES = ("train", "dev", "test")
FINISHED_TTL_S = 7 * 24 * 3600
JOB_ID_RE = re.compile(r"[0-9a-f]{32}")  # uuid4().hex; anything else names no job (and no Redis key)


class JobStateError(JobError):
    """The job is in a state that does not allow the request (cancelling a finished job)."""


class JobNotFoundError(JobError):
    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"job {shown(job_id)} does not exist (or expired); list jobs with GET /jobs or `patchserve jobs`"
        )


@pydantic_dataclass(config=ConfigDict(strict=True, allow_inf_nan=False))
class Gate:
    """When a trained patch may be registered."""

    # the dev score of the selection metric (accuracy, Spearman, entity F1...) must reach this
    min_dev: float | None = None
    not_worse: bool = False  # ... and must not be below the current version's recorded dev score

    @classmethod
    def from_dict(cls, raw: Any) -> Gate:
        """A gate from JSON (None: no gate); see ``_from_json``."""
        return cls() if raw is None else from_json(cls, raw, "gate")


@dataclass(frozen=True)
class JobLimits:
    """What a deployment lets one job cost, set by its operator (server and worker settings). A job over a limit
    is refused when it is submitted (422) and, if it reaches a worker anyway, failed there before training."""

    max_updates: int = 100_000  # optimizer updates over all of a job's runs (restarts x learning rates)
    max_seconds: float = 24 * 3600.0  # wall-clock time a worker gives one job before stopping it

    def check(self, config: TrainConfig, train_rows: int) -> None:
        """A JobError when ``config`` on ``train_rows`` rows would make more updates than ``max_updates``."""
        per_run, runs = config.planned_steps(train_rows), config.runs(train_rows)
        total = per_run * runs
        if total > self.max_updates:
            raise JobError(
                f"this job would make {total} updates ({runs} run(s) x {per_run}), over this deployment's limit of "
                f"{self.max_updates} (PATCHSERVE_MAX_JOB_UPDATES); lower epochs, min_steps, restarts or lr_search, or "
                "set max_steps"
            )


@dataclass
class Job:
    id: str
    task: str
    status: str
    config: dict[str, Any]
    gate: dict[str, Any]
    files: dict[str, str]  # role -> original file name
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    attempts: int = 0
    progress: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    cancel_requested: float | None = None  # when POST /jobs/{id}/cancel asked a running job to stop

    def to_dict(self) -> dict[str, Any]:
        """As shown to people and clients (the API, the CLI): times as ISO-8601 UTC strings, like task times."""
        shown = asdict(self)
        for key in self._TIMES:
            if shown[key] is not None:
                shown[key] = iso_time(shown[key])
        return shown

    _TIMES = ("created_at", "started_at", "finished_at", "cancel_requested")
    _JSON = ("config", "gate", "files", "progress", "result")

    def to_hash(self) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k, v in asdict(self).items():
            if v is None:
                continue
            out[k] = json.dumps(v) if k in self._JSON else str(v)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Job:
        d = {k.decode(): v.decode() for k, v in raw.items() if k != b"patch"}
        kw: dict[str, Any] = {k: json.loads(d[k]) for k in cls._JSON if k in d}
        for k in cls._TIMES:
            if k in d:
                kw[k] = float(d[k])
        return cls(
            id=d["id"],
            task=d["task"],
            status=d["status"],
            attempts=int(d.get("attempts", 0)),
            worker=d.get("worker"),
            error=d.get("error"),
            **kw,
        )


class JobQueue:
    """Training jobs in Redis (``redis://host:port/db``, ``?prefix=`` as for the registry)."""

    def __init__(self, url: str, *, max_file_bytes: int = 256 * 1024 * 1024, min_replicas: int = 0) -> None:
        conn, prefix = parse_redis_url(url)
        if not is_redis_url(conn):
            raise JobError(
                f"the job queue needs Redis (redis://host:port/db or redis+sentinel://...), got {redact_url(url)!r}"
            )
        self.url = redact_url(url)
        self.keys = RedisKeys(prefix)
        self.r = connect_redis(conn)
        self.max_file_bytes = max_file_bytes
        # a job answered 202 (and a cancel answered) is on min_replicas replicas too: DurableWrites
        self.durable = DurableWrites(conn, min_replicas, self._what)

    @property
    def _what(self) -> str:
        return f"job queue at {self.url}"

    def _call(self, fn: Any) -> Any:
        return call_redis(fn, self._what)

    # --- producers -----------------------------------------------------------------------------------------
    def submit(
        self, config: dict[str, Any], files: dict[str, tuple[str, bytes]], gate: dict[str, Any] | None = None
    ) -> Job:
        """Validate and enqueue a job. ``files`` maps train/dev/test to (file name, bytes)."""
        cfg = TrainConfig.from_dict(config)
        g = Gate.from_dict(gate)
        if "train" not in files:
            raise JobError("a training job needs a 'train' data file")
        unknown = sorted(set(files) - set(JOB_FILES))
        if unknown:
            raise JobError(f"unknown data files {unknown}; a job takes {list(JOB_FILES)}")
        for role, (name, data) in files.items():
            if (ch := unprintable(name)) is not None:
                raise JobError(f"{role} file name {shown(name)} contains the control character {ch}; rename the file")
            if len(data) > self.max_file_bytes:
                raise JobError(f"{role} file {name!r} is {len(data)} bytes, over the {self.max_file_bytes} limit")
            if not name.lower().endswith((".jsonl", ".json", ".csv", ".tsv")):
                raise JobError(f"{role} file {name!r} must be .jsonl, .csv or .tsv")
        job = Job(
            id=uuid.uuid4().hex,
            task=cfg.task,
            status="queued",
            config=asdict(cfg),
            gate=asdict(g),
            files={role: name for role, (name, _) in files.items()},
            created_at=time.time(),
        )
        k = self.keys

        def write(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=True)
            for role, (_, data) in files.items():
                pipe.set(k.job_file(job.id, role), data)
            pipe.hset(k.job(job.id), mapping=job.to_hash())
            pipe.zadd(k.job_index, {job.id: job.created_at})
            pipe.xadd(k.job_stream, {"job": job.id})
            self._call(pipe.execute)

        self.durable.run(self.r, write)
        return job

    def get(self, job_id: str) -> Job:
        if not JOB_ID_RE.fullmatch(job_id):
            raise JobNotFoundError(job_id)
        raw = self._call(lambda: self.r.hgetall(self.keys.job(job_id)))
        if not raw:
            raise JobNotFoundError(job_id)
        return Job.from_hash(raw)

    def list(self, limit: int = 50) -> list[Job]:
        ids = self._call(lambda: self.r.zrevrange(self.keys.job_index, 0, limit - 1))
        jobs = []
        for i in ids:
            try:
                jobs.append(self.get(i.decode()))
            except JobNotFoundError:
                self.r.zrem(self.keys.job_index, i)  # expired record
        return jobs

    def cancel(self, job_id: str) -> Job:
        """Cancel a job: a queued one ends as ``cancelled`` now; a running one is asked to stop, and its worker
        ends it as ``cancelled`` at its next step (within a few seconds). A finished job raises JobStateError."""
        job = self.get(job_id)  # 404 for an unknown id
        key = self.keys.job(job.id)

        def tx(pipe: Any) -> str:
            status = (pipe.hget(key, "status") or b"").decode()
            if status in TERMINAL:
                raise JobStateError(f"job {job.id} already ended as {status}; there is nothing to cancel")
            pipe.multi()
            pipe.hset(key, "cancel_requested", str(time.time()))
            if status == "queued":  # no worker holds it: end it here (a worker that claims it later just acks)
                pipe.hset(key, mapping={"status": "cancelled", "finished_at": str(time.time())})
                pipe.hset(key, "error", "cancelled before it started")
            return status

        if self.durable.run(self.r, lambda client: run_transaction(client, tx, key, what=self._what)) == "queued":
            self._drop_data(job.id)
        return self.get(job.id)

    # --- workers -------------------------------------------------------------------------------------------
    def start(self, job_id: str, worker: str, attempts: int) -> bool:
        """Mark a job running on ``worker``, unless it ended or a cancel came first (then False). Atomic with
        ``cancel``: a job is never both cancelled and started."""
        key = self.keys.job(job_id)

        def tx(pipe: Any) -> bool:
            status = (pipe.hget(key, "status") or b"").decode()
            if status in TERMINAL or pipe.hexists(key, "cancel_requested"):
                return False
            pipe.multi()
            mapping = {"status": "running", "worker": worker, "attempts": attempts, "started_at": time.time()}
            pipe.hset(key, mapping=mapping)
            return True

        return run_transaction(self.r, tx, key, what=self._what)

    def cancel_requested(self, job_id: str) -> bool:
        requested: bool = self._call(lambda: self.r.hexists(self.keys.job(job_id), "cancel_requested"))
        return requested

    def hand_back(self, job_id: str, msg_id: str, attempts: int) -> None:
        """Return a job to the queue at once (a worker shutting down): it is queued again with its attempt count
        as before, and a fresh message replaces the old one, so the next free worker takes it without waiting
        for a lease to run out."""
        k = self.keys
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(k.job(job_id), mapping={"status": "queued", "attempts": attempts})
        pipe.hdel(k.job(job_id), "worker", "started_at")
        pipe.xack(k.job_stream, JOB_GROUP, msg_id)
        pipe.xdel(k.job_stream, msg_id)
        pipe.xadd(k.job_stream, {"job": job_id})
        self._call(pipe.execute)

    def file(self, job_id: str, role: str) -> bytes | None:
        data: bytes | None = self._call(lambda: self.r.get(self.keys.job_file(job_id, role)))
        return data

    def update(self, job_id: str, client: redis.Redis | None = None, **values: Any) -> None:
        mapping: dict[Any, Any] = {
            k: json.dumps(v) if k in Job._JSON else str(v) for k, v in values.items() if v is not None
        }
        r = client or self.r
        self._call(lambda: r.hset(self.keys.job(job_id), mapping=mapping))

    def stash_patch(self, job_id: str, data: bytes, patch_id: str) -> None:
        """Record the trained patch in the job before registering it (what makes registration idempotent; on
        --redis-min-replicas replicas too, so a retry after a failover registers this patch, not a new one)."""

        def write(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.hset(self.keys.job(job_id), mapping={"patch": data, "patch_id": patch_id})
            self._call(pipe.execute)

        self.durable.run(self.r, write)

    def stashed_patch(self, job_id: str) -> bytes | None:
        data: bytes | None = self._call(lambda: self.r.hget(self.keys.job(job_id), "patch"))
        return data

    def finish(self, job_id: str, status: str, **values: Any) -> None:
        """Terminal state: record it, drop the data files and the stashed patch, expire the record later."""

        def write(client: redis.Redis) -> None:
            self.update(job_id, client, status=status, finished_at=time.time(), **values)
            self._drop_data(job_id, client)

        self.durable.run(self.r, write)

    def _drop_data(self, job_id: str, client: redis.Redis | None = None) -> None:
        k = self.keys
        pipe = (client or self.r).pipeline(transaction=True)
        pipe.hdel(k.job(job_id), "patch")
        pipe.delete(*[k.job_file(job_id, role) for role in JOB_FILES])
        pipe.expire(k.job(job_id), FINISHED_TTL_S)
        self._call(pipe.execute)

    def ensure_group(self) -> None:
        try:
            self._call(lambda: self.r.xgroup_create(self.keys.job_stream, JOB_GROUP, id="0", mkstream=True))
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def claim(self, consumer: str, *, lease_s: float, block_s: float) -> tuple[str, str] | None:
        """The next job for ``consumer``: a dead worker's (idle longer than the lease) first, else a new one.

        Returns (message id, job id) or None when nothing came within ``block_s``.
        """
        k = self.keys
        stale = self._call(
            lambda: self.r.xautoclaim(
                k.job_stream, JOB_GROUP, consumer, min_idle_time=int(lease_s * 1000), start_id="0-0", count=1
            )
        )
        messages = stale[1] if stale else []
        if not messages:
            got = self._call(
                lambda: self.r.xreadgroup(
                    JOB_GROUP, consumer, {k.job_stream: ">"}, count=1, block=max(1, int(block_s * 1000))
                )
            )
            messages = got[0][1] if got else []
        for msg_id, fields_ in messages:
            if fields_ and b"job" in fields_:
                return msg_id.decode(), fields_[b"job"].decode()
            self.ack(msg_id.decode())  # a trimmed or malformed entry: nothing to do
        return None

    def heartbeat(self, consumer: str, msg_id: str) -> bool:
        """Keep the lease on a job alive; False when another worker has taken it over."""
        k = self.keys
        pending = self._call(lambda: self.r.xpending_range(k.job_stream, JOB_GROUP, min=msg_id, max=msg_id, count=1))
        if not pending or pending[0]["consumer"].decode() != consumer:
            return False
        self._call(lambda: self.r.xclaim(k.job_stream, JOB_GROUP, consumer, 0, [msg_id], justid=True))
        return True

    def ack(self, msg_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.job_stream, JOB_GROUP, msg_id)
        pipe.xdel(self.keys.job_stream, msg_id)
        self._call(pipe.execute)

    def close(self) -> None:
        self.durable.close()
        self.r.close()
