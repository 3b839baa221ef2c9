"""Training jobs: the contract (TrainConfig, Gate) and the Redis Streams queue that carries them.

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
import math
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import redis

from patches.bitfit import BIAS_SUBSETS
from patches.errors import PatchServeError
from patches.format import POOLINGS, validate_task_name
from patches.store.redis import call_redis, parse_redis_url
from patches.store.redis_keys import JOB_GROUP, RedisKeys

JOB_FILES = ("train", "dev", "test")
TERMINAL = frozenset({"succeeded", "failed", "rejected"})
FINISHED_TTL_S = 7 * 24 * 3600


class JobError(PatchServeError):
    """A job request is invalid, or a job cannot be found."""


class JobNotFoundError(JobError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} does not exist (or expired); list jobs with GET /jobs or `patchserve jobs`")


# Defaults that differ between BitFit and full fine-tuning, filled in by ``TrainConfig.resolved()`` where a field
# is None; docs/quality.md was measured with them. BitFit's few parameters need a larger rate and longer training,
# and improve late in the linear decay: with 4 dev evaluations per epoch a patience of 40 lets the 10 epochs run to
# the end (the best dev checkpoint is still restored). Where min_steps stretches a small data set's run, its epochs
# (and evaluations) stretch with it, so that holds on small data too (docs/few-sample.md).
BITFIT_DEFAULTS: dict[str, Any] = {"lr": 3e-3, "epochs": 10.0, "patience": 40}
FULL_DEFAULTS: dict[str, Any] = {"lr": 5e-5, "epochs": 5.0, "patience": 6}


@dataclass
class TrainConfig:
    """How to train a patch. Defaults are the ones the README's quality table was measured with; a None among
    ``lr``, ``epochs`` and ``patience`` means the default for the mode (BitFit or ``full``), see ``resolved()``."""

    task: str
    bias_subset: str = "all"
    pooling: str | None = None  # None: the encoder's default (mean for sentence-embedding encoders)
    kind: str | None = None  # None: inferred from the data
    max_seq_length: int = 128
    epochs: float | None = None  # None: 10 for BitFit, 5 for full fine-tuning
    min_steps: int = 600  # small data sets still get this many updates (Zhang et al., ICLR 2021)
    max_steps: int | None = None
    batch_size: int = 16
    lr: float | None = None  # None: 3e-3 for BitFit, 5e-5 for full fine-tuning
    head_lr: float | None = None  # the task head's learning rate; None: the same as lr
    lr_search: list[float] = field(default_factory=list)  # e.g. the BitFit paper's [1e-4, 4e-4, 7e-4, 1e-3]
    seed: int = 0
    restarts: int = 1  # seeds seed .. seed+restarts-1; the best dev score wins
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    dropout: float | None = None  # dropout rate in the encoder while training; None: the encoder's own
    eval_every: int | None = None  # updates between dev evaluations; None: 4 per (min_steps-stretched) epoch
    patience: int | None = None  # dev evaluations without improvement before stopping early; None: 40 BitFit, 6 full
    full: bool = False  # fine-tune every weight (report only, for comparison)
    device: str = "auto"

    def __post_init__(self) -> None:
        validate_task_name(self.task)
        checks = [
            (self.bias_subset in BIAS_SUBSETS, f"bias_subset must be one of {sorted(BIAS_SUBSETS)}"),
            (self.pooling is None or self.pooling in POOLINGS, f"pooling must be one of {list(POOLINGS)}"),
            (self.kind in (None, "classification", "regression", "token-classification"), "unknown kind"),
            (self.max_seq_length >= 8, "max_seq_length must be at least 8"),
            (self.epochs is None or (self.epochs > 0 and math.isfinite(self.epochs)), "epochs must be positive"),
            (self.min_steps >= 1 and (self.max_steps is None or self.max_steps >= 1), "steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (
                all(x > 0 for x in [*(self.lr_search or []), *(x for x in (self.lr, self.head_lr) if x is not None)]),
                "learning rates must be positive",
            ),
            (
                self.restarts >= 1 and (self.patience is None or self.patience >= 1),
                "restarts and patience must be >= 1",
            ),
            (0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)"),
            (self.dropout is None or 0 <= self.dropout < 1, "dropout must be in [0, 1)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise JobError(f"training config: {msg}")

    def resolved(self) -> TrainConfig:
        """This config with the mode's defaults (``BITFIT_DEFAULTS`` / ``FULL_DEFAULTS``) in place of None."""
        defaults = FULL_DEFAULTS if self.full else BITFIT_DEFAULTS
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise JobError(f"training config has unknown fields {unknown}; known fields: {sorted(known)}")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise JobError(f"training config: {exc}") from exc


@dataclass
class Gate:
    """When a trained patch may be registered."""

    min_dev: float | None = None  # the dev score (accuracy / Spearman / token accuracy) must reach this
    not_worse: bool = False  # ... and must not be below the current version's recorded dev score


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        for k in ("created_at", "started_at", "finished_at"):
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

    def __init__(self, url: str, *, max_file_bytes: int = 256 * 1024 * 1024) -> None:
        conn, prefix = parse_redis_url(url)
        if not conn.startswith(("redis://", "rediss://", "unix://")):
            raise JobError(f"the job queue needs Redis (redis://host:port/db), got {url!r}")
        self.url = url
        self.keys = RedisKeys(prefix)
        self.r = redis.Redis.from_url(conn, socket_connect_timeout=5, health_check_interval=30)
        self.max_file_bytes = max_file_bytes

    def _call(self, fn: Any) -> Any:
        return call_redis(fn, f"job queue at {self.url}")

    # --- producers -----------------------------------------------------------------------------------------
    def submit(
        self, config: dict[str, Any], files: dict[str, tuple[str, bytes]], gate: dict[str, Any] | None = None
    ) -> Job:
        """Validate and enqueue a job. ``files`` maps train/dev/test to (file name, bytes)."""
        cfg = TrainConfig.from_dict(config)
        g = Gate(**(gate or {}))
        if "train" not in files:
            raise JobError("a training job needs a 'train' data file")
        unknown = sorted(set(files) - set(JOB_FILES))
        if unknown:
            raise JobError(f"unknown data files {unknown}; a job takes {list(JOB_FILES)}")
        for role, (name, data) in files.items():
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
        pipe = self.r.pipeline(transaction=True)
        for role, (_, data) in files.items():
            pipe.set(k.job_file(job.id, role), data)
        pipe.hset(k.job(job.id), mapping=job.to_hash())
        pipe.zadd(k.job_index, {job.id: job.created_at})
        pipe.xadd(k.job_stream, {"job": job.id})
        self._call(pipe.execute)
        return job

    def get(self, job_id: str) -> Job:
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

    # --- workers -------------------------------------------------------------------------------------------
    def file(self, job_id: str, role: str) -> bytes | None:
        data: bytes | None = self._call(lambda: self.r.get(self.keys.job_file(job_id, role)))
        return data

    def update(self, job_id: str, **values: Any) -> None:
        mapping: dict[Any, Any] = {
            k: json.dumps(v) if k in Job._JSON else str(v) for k, v in values.items() if v is not None
        }
        self._call(lambda: self.r.hset(self.keys.job(job_id), mapping=mapping))

    def stash_patch(self, job_id: str, data: bytes, patch_id: str) -> None:
        """Record the trained patch in the job before registering it (what makes registration idempotent)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.job(job_id), mapping={"patch": data, "patch_id": patch_id})
        self._call(pipe.execute)

    def stashed_patch(self, job_id: str) -> bytes | None:
        data: bytes | None = self._call(lambda: self.r.hget(self.keys.job(job_id), "patch"))
        return data

    def finish(self, job_id: str, status: str, **values: Any) -> None:
        """Terminal state: record it, drop the data files and the stashed patch, expire the record later."""
        k = self.keys
        self.update(job_id, status=status, finished_at=time.time(), **values)
        pipe = self.r.pipeline(transaction=True)
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
        self.r.close()
