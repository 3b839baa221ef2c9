"""The server's settings: one pydantic-settings class. Every field is also an env var ``PATCHSERVE_<NAME>`` and a
``patchserve serve --<name>`` option; the description under each field is its ``--help`` text.
"""

from __future__ import annotations

import json
import logging
import math
import os
import typing
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from patchserve.patches.cli import DEFAULT_REGISTRY
from patchserve.patches.jobs import JobLimits

log = logging.getLogger(__name__)

DEFAULT_WORKERS_RULE = (
    "1 when the engine runs on the CPU (there the forward is the limit, and it gets every core); on a GPU one per "
    "CPU core, at most 8"
)


DEFAULT_BATCH_ROWS = {"cpu": 32, "gpu": 256}
DEFAULT_BATCH_ROWS_RULE = (
    f"{DEFAULT_BATCH_ROWS['cpu']} when the engine runs on the CPU (a batch costs there what its rows cost, and a "
    f"smaller one answers sooner); {DEFAULT_BATCH_ROWS['gpu']} on a GPU (a forward costs about the same from one row "
    "to a few hundred: bigger batches are nearly free throughput)"
)


def available_cpus() -> int:
    """The CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (what a container's
    ``--cpus`` or a Kubernetes CPU limit sets; ``os.cpu_count()`` sees the whole host)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def available_memory() -> int:
    """Bytes of host memory this process could still take: the kernel's MemAvailable, capped by what a cgroup v2
    memory limit leaves (a container's ``--memory``, a Kubernetes memory limit)."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if not available:  # not Linux: the physical memory's free pages
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def default_workers(gpu: bool, cpus: int | None = None) -> int:
    """How many front ends ``--workers`` means when unset (docs/architecture.md says why, with the measurements).

    On the CPU the engine's forward is the limit with any real model, and a front end needs a fraction of a core to
    keep it fed; on a GPU the front ends are the limit (the free-model grid: throughput grows up to one front end per
    core, and no further)."""
    if not gpu:
        return 1
    return max(1, min(8, cpus or available_cpus()))


RENAMED = {"patch_cache_mb": "host_cache_mb"}  # former setting name -> its name now (env var and flag)


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PATCHSERVE_", extra="ignore", env_ignore_empty=True)

    workers: int | None = Field(
        None,
        ge=0,
        le=64,
        description="HTTP front-end processes. N >= 1: one engine process owns the device and N front ends parse, "
        "validate, authorize and tokenize requests and feed it token rows over ZeroMQ; a front end that dies is "
        "replaced, an engine that dies is restarted. 0: one process does everything (no IPC). Default: "
        f"{DEFAULT_WORKERS_RULE}.",
    )
    engine_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads of the engine's forward pass (torch intra-op threads) with --workers N >= 1. "
        "Default: every core when the engine runs on the CPU (its forward is the work there); on a GPU the cores "
        "the front ends leave, at least 1. A model that costs almost nothing on the CPU runs faster with 1.",
    )
    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 to accept connections from others.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    registry: str = Field(
        DEFAULT_REGISTRY,
        description="Where patches live: disk:///path (one machine) or redis://host:port/db (shared by replicas).",
    )
    queue: str | None = Field(
        None,
        description="Redis URL of the training-job queue (POST /jobs). Default: the registry, when it is Redis.",
    )
    redis_min_replicas: int = Field(
        0,
        ge=0,
        description="With a Redis registry or queue: a registration, rollback, delete or job submission answers "
        "only once this many replicas hold it too (Redis WAIT, up to 2 s; else 503 saying the write may still have "
        "happened), so it survives a failover. 0: acknowledged by the primary alone (Redis replicates later).",
    )
    keep_versions: int | None = Field(
        None,
        ge=1,
        description="After each registration through this server, delete the task's versions beyond the newest N; "
        "the current version and any version current in the last 10 minutes stay whatever their age. Default: keep "
        "all (patchserve prune does it once).",
    )
    model: str = Field(
        "default",
        description="Frozen base encoder: 'default' (packaged all-MiniLM-L6-v2), a local HF folder or a hub id.",
    )
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|float16|bfloat16)$",
        description="Compute dtype: 'auto' (float16 on GPU, float32 on CPU), float32, float16 or bfloat16. On a CPU "
        "bfloat16 is faster on some CPUs and slower on others (docs/configuration.md): measure before choosing it.",
    )
    slots: int | None = Field(
        None,
        ge=1,
        description="Tasks resident on the device at once; more are swapped in LRU (from the host tier, "
        "--host-cache-mb). Default: as many as 1% of the available host memory holds on the CPU, 5% of the free "
        "device memory on a GPU (256..4096 and 64..4096).",
    )
    preload: bool = Field(
        False,
        description="At start-up, load the current version of every registered task into a device slot (the most "
        "recently registered first, as many as there are slots), so that the first requests after a (re)start find "
        "their task resident. Readiness waits for it.",
    )
    max_batch_rows: int | None = Field(
        None,
        ge=1,
        description="Most inputs (of any tasks) run in one forward pass; --max-batch-tokens bounds a batch too. "
        f"Default: {DEFAULT_BATCH_ROWS_RULE}.",
    )
    max_batch_tokens: int = Field(
        8192,
        ge=16,
        description="Most tokens in one forward pass; bounds memory. Real tokens on the packed engine (no padding), "
        "rows x longest row on the slotted one.",
    )
    max_wait_ms: float = Field(
        5.0,
        ge=0,
        description="How long the first input of a batch may wait for others to join it. Trades latency "
        "for throughput.",
    )
    max_queue_rows: int = Field(
        1024, ge=1, description="Inputs allowed to wait; beyond this requests get 503 with Retry-After."
    )
    request_timeout_s: float = Field(30.0, gt=0, description="A predict request that takes longer gets 504.")
    max_seq_length: int = Field(
        512, ge=8, description="Longest input in tokens; longer inputs are truncated and the response says so."
    )
    max_input_chars: int = Field(
        8192,
        ge=64,
        description="Longest input text in characters: longer texts are cut before tokenizing (and the response "
        "says truncated), which bounds the work one request can cause. 8192 holds 512 tokens of ordinary text.",
    )
    max_inputs_per_request: int = Field(256, ge=1, description="Most inputs in one predict request.")
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body accepted (patch uploads included); else 413."
    )
    max_predict_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest body of an inference request (predict, infer, embed); else 413. Smaller than the upload "
        "limit because such a body is parsed on the event loop: this bounds how long one request can hold up every "
        "other (probes included).",
    )
    max_patch_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Largest patch file accepted.")
    host_cache_mb: int = Field(
        512,
        ge=1,
        description="The host tier between the registry and the device slots: memory for recently used patches (LRU "
        "by patch id) in each front end and in the engine process, so that a task that lost its slot comes back "
        "with a copy, not a registry read and a parse. (Formerly --patch-cache-mb, still accepted.)",
    )
    metrics_task_labels: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Tasks with series of their own in /metrics (requests, latency): the first N each process serves; "
        'every other task\'s requests count under task="_other". 0: none, so /metrics does not grow with the tasks.',
    )
    admin_token: SecretStr | None = Field(
        None, description="When set, registering, deleting and rolling back need 'Authorization: Bearer <token>'."
    )
    predict_token: SecretStr | None = Field(
        None, description="When set, predict needs 'Authorization: Bearer <token>' (this token or the admin one)."
    )
    max_job_updates: int = Field(
        100_000,
        ge=1,
        description="Most optimizer updates one training job may plan over all its runs (restarts x learning "
        "rates); POST /jobs refuses bigger jobs with 422. Workers have the same cap (patchserve worker).",
    )
    engine: str = Field(
        "auto",
        pattern="^(auto|packed|slotted)$",
        description="'packed' (padding-free, folded biases, CUDA graphs on a GPU; BERT encoders), 'slotted' (the "
        "Hugging Face model with per-row bias modules; any encoder) or 'auto' (packed where it can run).",
    )
    cuda_graphs: bool = Field(
        True, description="On a GPU in half precision, replay the packed forward as CUDA graphs (one per size)."
    )
    overlap_batches: bool = Field(
        False,
        description="Launch the next batch while the GPU still runs the previous one (packed engine).",
    )
    fold_ln_bias: bool = Field(
        True, description="Fold each LayerNorm's beta into the biases after it per task (exact; packed engine)."
    )
    drop_key_bias: bool = Field(
        True, description="Skip the key bias, which cannot change attention (exact); off only for comparisons."
    )
    fold_value_bias: bool = Field(
        True, description="Fold the value bias into the attention-output bias per task (exact)."
    )
    log_level: str = Field("info", description="Log level: debug, info, warning or error.")
    access_log: bool = Field(
        False,
        description="Log a line per HTTP request (uvicorn's access log). Off by default: at thousands of requests a "
        "second it costs a front end a measurable share of its time; /metrics counts requests by task and status.",
    )

    def front_ends(self, gpu: bool) -> int:
        """The front-end processes to run: ``workers``, or the default for this machine and device."""
        return default_workers(gpu) if self.workers is None else self.workers

    def batch_rows(self, gpu: bool) -> int:
        """The most rows of one batch: ``max_batch_rows``, or the default for the device."""
        if self.max_batch_rows is not None:
            return self.max_batch_rows
        return DEFAULT_BATCH_ROWS["gpu" if gpu else "cpu"]

    def forward_threads(self, gpu: bool) -> int:
        """The engine process's torch threads: ``engine_threads``; else every core on the CPU, the cores the front
        ends leave on a GPU."""
        if self.engine_threads is not None:
            return self.engine_threads
        cpus = available_cpus()
        return cpus if not gpu else max(1, cpus - self.front_ends(gpu))

    def to_json(self) -> str:
        """Every setting, secrets included, for the server's own child processes (``from_json``)."""
        values = {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in self.model_dump().items()}
        return json.dumps(values)

    @classmethod
    def from_json(cls, text: str) -> ServerSettings:
        """The settings ``to_json`` wrote, as they were (validated then; environment variables are not read again
        and start-up warnings are not repeated by every child)."""
        values = json.loads(text)
        for name, field in cls.model_fields.items():
            if SecretStr in typing.get_args(field.annotation) and values.get(name) is not None:
                values[name] = SecretStr(values[name])
        return cls.model_construct(**values)

    @property
    def job_limits(self) -> JobLimits:
        return JobLimits(max_updates=self.max_job_updates)

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: typing.Any) -> typing.Any:
        """Settings renamed since a release, read under their former env var too (the new name wins)."""
        if isinstance(data, dict):
            for old, new in RENAMED.items():
                former = os.environ.get(f"PATCHSERVE_{old.upper()}")
                if former is not None and new not in data:
                    log.warning("PATCHSERVE_%s is now PATCHSERVE_%s; please rename it", old.upper(), new.upper())
                    data = {**data, new: former}
        return data

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 is not supported on the CPU: use float32 (or bfloat16)")
        if self.max_queue_rows < self.max_inputs_per_request:
            # a full-size request would be told to retry (503) although it could never fit
            raise ValueError(
                f"max_queue_rows ({self.max_queue_rows}) must be at least max_inputs_per_request "
                f"({self.max_inputs_per_request})"
            )
        if self.host not in ("127.0.0.1", "localhost", "::1") and self.admin_token is None:
            log.warning(
                "listening on %s without an admin token: anyone who can reach it may register or delete tasks; "
                "set PATCHSERVE_ADMIN_TOKEN",
                self.host,
            )
        return self
