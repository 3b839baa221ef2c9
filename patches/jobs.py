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
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Any, Literal, TypeVar

import redis
from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from patches.api import TERMINAL
from patches.bitfit import BIAS_SUBSETS
from patches.errors import InvalidTaskNameError, PatchServeError, describe_validation_errors
from patches.format import KINDS, POOLINGS, Label, shown, unprintable, validate_task_name
from patches.store.base import iso_time, redact_url
from patches.store.redis import (
    DurableWrites,
    call_redis,
    connect_redis,
    is_redis_url,
    parse_redis_url,
    run_transaction,
)
from patches.store.redis_keys import JOB_GROUP, RedisKeys

JOB_FILES = ("train", "dev", "test")
FINISHED_TTL_S = 7 * 24 * 3600
_T = TypeVar("_T")
JOB_ID_RE = re.compile(r"[0-9a-f]{32}")  # uuid4().hex; anything else names no job (and no Redis key)


class JobError(PatchServeError):
    """A job request is invalid, or a job cannot be found."""


class JobStateError(JobError):
    """The job is in a state that does not allow the request (cancelling a finished job)."""


class JobNotFoundError(JobError):
    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"job {shown(job_id)} does not exist (or expired); list jobs with GET /jobs or `patchserve jobs`"
        )


# Defaults that differ between BitFit and full fine-tuning, filled in by ``TrainConfig.resolved()`` where a field
# is None; docs/quality.md was measured with them. BitFit's few parameters need a larger rate and longer training,
# and improve late in the linear decay: with 4 dev evaluations per epoch a patience of 40 lets the 10 epochs run to
# the end (the best dev checkpoint is still restored). Where min_steps stretches a small data set's run, its epochs
# (and evaluations) stretch with it, so that holds on small data too (docs/few-sample.md).
BITFIT_DEFAULTS: dict[str, Any] = {"lr": 3e-3, "epochs": 10.0, "patience": 40}
FULL_DEFAULTS: dict[str, Any] = {"lr": 5e-5, "epochs": 5.0, "patience": 6}


# Hard bounds on a training config, whoever sends it: each keeps a typo or a hostile job from holding a worker
# forever or failing late. What a deployment allows a job to cost in total is the operator's ``JobLimits``.
MAX_UPDATES_PER_RUN = 10_000_000
MAX_RUNS = 100  # restarts x learning rates
# Small data is where fine-tuning is unstable across seeds (Zhang et al., ICLR 2021): with fewer than this many
# training rows and no `restarts` given, a config trains SMALL_DATA_RESTARTS seeds and averages them into one patch
# (`restarts_merge`; docs/few-sample.md measures it).
SMALL_DATA_ROWS = 1000
SMALL_DATA_RESTARTS = 3
# A dev set this small scores in steps of several points (26 rows: 4 points, a standard error near 9), too coarse
# to rank the checkpoints of one run: with no `checkpoint` given, such a run keeps its last checkpoint, not its best.
SMALL_DEV_ROWS = 100
# Dev metrics that may choose the checkpoint (`metric`), per task kind; the first is the kind's default, except
# that tags in a BIO/IOB2/BIOES scheme default to entity_f1 (TrainConfig.selection_metric).
SELECTION_METRICS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "macro_f1"),
    "regression": ("spearman", "pearson"),
    "token-classification": ("token_accuracy", "entity_f1"),
}
METRIC_NAMES = sorted({m for names in SELECTION_METRICS.values() for m in names})
ANY_VALUE = object()
# Options earlier releases took and this one does not (docs/experiments.md says why), each with its "off" value: a
# job an earlier release queued holds every option, so these are dropped at that value (ANY_VALUE: whatever it is,
# as distill_temperature did nothing without distill) and refused at any other.
RETIRED_OPTIONS: dict[str, Any] = {"contrastive": 0, "distill": 0.0, "distill_temperature": ANY_VALUE}
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # a bool is not an int, "5" is not a number, NaN is refused
_Steps = Annotated[int, Field(ge=1, le=MAX_UPDATES_PER_RUN)]
_Rate = Annotated[float, Field(gt=0, le=1)]


@pydantic_dataclass(config=_STRICT)
class TrainConfig:
    """How to train a patch. Defaults are the ones the README's quality table was measured with; a None among
    ``lr``, ``epochs`` and ``patience`` means the default for the mode (BitFit or ``full``), see ``resolved()``.

    Types are checked strictly and every value is bounded (see ``from_dict``); ``JobLimits`` caps a job's total
    cost."""

    task: str
    bias_subset: str = "all"
    # what trains besides the biases: "none" (BitFit, a "bitfit" patch) or "ia3" ((IA)^3 scales on every layer's
    # keys, values and feed-forward intermediate, a "bitfit-ia3" patch; trains on the packed model)
    scales: Literal["none", "ia3"] = "none"
    pooling: str | None = None  # None: the encoder's default (mean for sentence-embedding encoders)
    kind: str | None = None  # None: inferred from the data
    max_seq_length: Annotated[int, Field(ge=8, le=65536)] = 128
    epochs: Annotated[float, Field(gt=0, le=10_000)] | None = None  # None: 10 for BitFit, 5 for full fine-tuning
    min_steps: _Steps = 600  # small data sets still get this many updates (Zhang et al., ICLR 2021)
    max_steps: _Steps | None = None
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 16
    lr: _Rate | None = None  # None: 3e-3 for BitFit, 5e-5 for full fine-tuning
    head_lr: _Rate | None = None  # the task head's learning rate; None: the same as lr
    lr_search: Annotated[list[_Rate], Field(max_length=16)] = field(default_factory=list)  # e.g. [1e-4, 4e-4, 1e-3]
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    # seeds seed .. seed+restarts-1; the best dev score wins. None: SMALL_DATA_RESTARTS on small data, else 1
    restarts: Annotated[int, Field(ge=1, le=MAX_RUNS)] | None = None
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.1
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    dropout: Annotated[float, Field(ge=0, lt=1)] | None = None  # the encoder's dropout while training; None: its own
    eval_every: _Steps | None = None  # updates between dev evaluations; None: 4 per (min_steps-stretched) epoch
    patience: Annotated[int, Field(ge=1, le=1_000_000)] | None = None  # evaluations without gain; None: 40 / 6
    full: bool = False  # fine-tune every weight (report only, for comparison)
    # the dev metric that picks checkpoints and restarts (SELECTION_METRICS); None: the kind's default
    metric: str | None = None
    # which checkpoint of a run is kept: "best" (dev score) or "last"; None: last when dev has < SMALL_DEV_ROWS rows
    checkpoint: Literal["best", "last"] | None = None
    # what the restarts make: "best", the run with the best dev score; "average", one patch whose biases and head
    # are the mean of the restarts' (which then share their head's initialisation: a "model soup" of the seeds).
    # None: average where the restarts are automatic (small data), else best
    restarts_merge: Literal["best", "average"] | None = None
    # where each run's head starts: "random", a freshly initialised linear layer; "labels" (classification), each
    # class's row is the frozen encoder's pooled unit vector of the label's name ("positive", "card arrival":
    # underscores read as spaces) and the bias 0, so the head scores a row by its agreement with the names before
    # any training -- a zero-shot start. None: labels for a patch of a classification task on small data (under
    # SMALL_DATA_ROWS training rows, where it scored better on the sets' own dev splits, docs/few-sample.md), else
    # random
    head_init: Literal["random", "labels"] | None = None
    device: Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$")] = "auto"

    def __post_init__(self) -> None:
        try:
            validate_task_name(self.task)
        except InvalidTaskNameError as exc:
            raise JobError(f"training config: {exc}") from None
        checks = [
            (self.bias_subset in BIAS_SUBSETS, f"bias_subset must be one of {sorted(BIAS_SUBSETS)}"),
            (self.pooling is None or self.pooling in POOLINGS, f"pooling must be one of {list(POOLINGS)}"),
            (self.kind in (None, *KINDS), f"kind must be one of {list(KINDS)}"),
            (self.metric is None or self.metric in METRIC_NAMES, f"metric must be one of {METRIC_NAMES}"),
            (self.metric is None or self.kind is None or self.metric in SELECTION_METRICS[self.kind], _misfit(self)),
            (self.max_runs <= MAX_RUNS, f"restarts x learning rates is {self.max_runs}, over the limit of {MAX_RUNS}"),
            (not (self.full and self.scales != "none"), "full fine-tuning trains every weight; drop scales or full"),
        ]
        for ok, msg in checks:
            if not ok:
                raise JobError(f"training config: {msg}")
        if self.kind in KINDS:
            self.check_head_init(self.kind)

    def selection_metric(self, kind: str, labels: Sequence[Label]) -> str:
        """The dev metric that chooses checkpoints and restarts for a task of ``kind`` with these labels (tags):
        ``metric``, else accuracy, spearman, and for tags entity_f1 when BIO-style, else token_accuracy. A metric
        that cannot score the task is a JobError (checked before any training)."""
        if self.metric is None:
            return (
                "entity_f1" if kind == "token-classification" and is_bio_scheme(labels) else SELECTION_METRICS[kind][0]
            )
        if self.metric not in SELECTION_METRICS[kind]:
            raise JobError(f"training config: {_misfit(self, kind)}")
        if self.metric == "entity_f1" and not is_bio_scheme(labels):
            raise JobError(
                "metric 'entity_f1' needs tags in a BIO/IOB2/BIOES scheme (B-PER, I-PER, O...), got "
                f"{shown(list(labels)[:10])}; use token_accuracy"
            )
        return self.metric

    def checkpoint_for(self, dev_rows: int) -> Literal["best", "last"]:
        """Which checkpoint a run keeps with a dev set of ``dev_rows`` rows: ``checkpoint``, or when unset the last
        one on a dev set too small to rank checkpoints (SMALL_DEV_ROWS), else the best."""
        if self.checkpoint is not None:
            return self.checkpoint
        return "last" if dev_rows < SMALL_DEV_ROWS else "best"

    def restarts_for(self, train_rows: int) -> int:
        """Seeds to train on ``train_rows`` rows: ``restarts``, or when unset SMALL_DATA_RESTARTS on small data."""
        if self.restarts is not None:
            return self.restarts
        return SMALL_DATA_RESTARTS if train_rows < SMALL_DATA_ROWS else 1

    def restarts_merge_for(self, train_rows: int) -> Literal["best", "average"]:
        """What the restarts on ``train_rows`` rows make: ``restarts_merge``, or when unset their average where the
        restarts are automatic (small data: a dev set carved from so few rows cannot tell healthy seeds apart, and
        their average scored better on the sets' own dev splits, docs/few-sample.md), else the best dev score."""
        if self.restarts_merge is not None:
            return self.restarts_merge
        return "average" if self.restarts is None and train_rows < SMALL_DATA_ROWS else "best"

    def check_task(self, kind: str, labels: Sequence[Label]) -> None:
        """A JobError where this config cannot train a task of ``kind`` with these labels (tags): a metric that
        cannot score it, or a label-name head without labels. The server, the CLI and the worker ask before any
        training."""
        self.selection_metric(kind, labels)
        self.check_head_init(kind)

    def head_init_for(self, kind: str, train_rows: int) -> Literal["random", "labels"]:
        """Where the heads of a task of ``kind`` on ``train_rows`` rows start (``head_init_why``)."""
        return self.head_init_why(kind, train_rows)[0]

    def head_init_why(self, kind: str, train_rows: int) -> tuple[Literal["random", "labels"], str]:
        """Where the heads of a task of ``kind`` on ``train_rows`` rows start, and why: ``head_init``, or when unset
        the label names for a patch (not ``full``) of a classification task on small data (SMALL_DATA_ROWS), else a
        random head."""
        if self.head_init is not None:
            return self.head_init, f"set: head_init={self.head_init}"
        if self.full:
            return "random", "automatic: a random head for full fine-tuning"
        if kind != "classification":
            return "random", f"automatic: a random head: label names start classifiers, not a {kind} head"
        if train_rows >= SMALL_DATA_ROWS:
            return "random", f"automatic: a random head: {train_rows} training rows are not under {SMALL_DATA_ROWS}"
        return (
            "labels",
            f"automatic: a classifier on {train_rows} training rows (under {SMALL_DATA_ROWS}) starts from its names",
        )

    def check_head_init(self, kind: str) -> None:
        """A JobError where ``head_init`` asks for a start the task of ``kind`` cannot take: label-name heads score
        a pooled sentence vector, so classification only (checked before any training)."""
        if self.head_init == "labels" and kind != "classification":
            raise JobError(
                f"training config: head_init 'labels' starts a sentence classifier from its label names, not a "
                f"{kind} head; set head_init to 'random'"
            )

    def runs(self, train_rows: int) -> int:
        """Training runs this config makes on ``train_rows`` rows: one per restart and learning rate."""
        return self.restarts_for(train_rows) * max(1, len(self.lr_search))

    @property
    def max_runs(self) -> int:
        """The most runs this config can make, whatever the data."""
        return (self.restarts or SMALL_DATA_RESTARTS) * max(1, len(self.lr_search))

    def resolved(self) -> TrainConfig:
        """This config with the mode's defaults (``BITFIT_DEFAULTS`` / ``FULL_DEFAULTS``) in place of None."""
        defaults = FULL_DEFAULTS if self.full else BITFIT_DEFAULTS
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def planned_steps(self, train_rows: int) -> int:
        """Updates one run makes on ``train_rows`` rows: the epochs, stretched to ``min_steps``, capped by
        ``max_steps`` (early stopping may end it sooner)."""
        epochs = self.resolved().epochs
        assert epochs is not None
        steps_per_epoch = math.ceil(train_rows / self.batch_size)
        total = max(self.min_steps, math.ceil(epochs * steps_per_epoch))
        return min(total, self.max_steps) if self.max_steps else total

    @classmethod
    def from_dict(cls, raw: Any) -> TrainConfig:
        """A config from JSON (a job, the API); see ``_from_json``. A retired option (``RETIRED_OPTIONS``) at its
        "off" value, as a job queued by an earlier release holds it, is dropped; any other value is refused."""
        if isinstance(raw, dict):
            raw = dict(raw)
            for name, off in RETIRED_OPTIONS.items():
                if name in raw and raw.pop(name) != off and off is not ANY_VALUE:
                    raise JobError(
                        f"training config: {name} was removed (it did not pay; docs/experiments.md); drop {name}"
                    )
            if raw.get("scales") == "layernorm":
                raise JobError(
                    "training config: scales 'layernorm' (the bitfit-ln kind) was removed (it did not pay; "
                    "docs/experiments.md); use 'none' or 'ia3'"
                )
        return _from_json(cls, raw, "training config")


_SCHEME_TAG = re.compile(r"(?:[BIES]-.+|O)")  # IOB2, IOB1 and BIOES tags all look like this


def is_bio_scheme(tags: Sequence[Label]) -> bool:
    """Whether a tag set reads as entity spans (BIO / IOB2 / BIOES): every tag is O or B-/I-/E-/S-TYPE."""
    return (
        bool(tags)
        and all(isinstance(t, str) and _SCHEME_TAG.fullmatch(t) for t in tags)
        and any(t != "O" for t in tags)
    )


def _misfit(config: TrainConfig, kind: str | None = None) -> str:
    """The message for a ``metric`` that does not score a task of ``kind`` (default: the config's own kind)."""
    kind = kind or config.kind or ""
    return f"metric {config.metric!r} does not score a {kind} task; use one of {list(SELECTION_METRICS.get(kind, ()))}"


@pydantic_dataclass(config=_STRICT)
class Gate:
    """When a trained patch may be registered."""

    # the dev score of the selection metric (accuracy, Spearman, entity F1...) must reach this
    min_dev: float | None = None
    not_worse: bool = False  # ... and must not be below the current version's recorded dev score

    @classmethod
    def from_dict(cls, raw: Any) -> Gate:
        """A gate from JSON (None: no gate); see ``_from_json``."""
        return cls() if raw is None else _from_json(cls, raw, "gate")


def _from_json(cls: type[_T], raw: Any, what: str) -> _T:
    """``cls(**raw)`` for JSON a client sent: anything but an object, unknown fields, wrong types and out-of-range
    values are a :class:`JobError` naming each field (``what``: "training config", "gate")."""
    if not isinstance(raw, dict):
        raise JobError(f"{what} must be a JSON object")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise JobError(f"{what} has unknown fields {shown(unknown)}; known fields: {sorted(known)}")
    try:
        return cls(**raw)
    except ValidationError as exc:
        raise JobError(f"{what}: {describe_validation_errors(exc.errors())}") from None


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
