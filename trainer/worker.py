"""The trainer worker: claims jobs from the queue, trains, gates, registers, acks.

The encoder is loaded once at start-up and handed to every job. Several workers (on several machines) share one
queue; each job goes to one of them. A worker killed mid-job leaves its job pending; another worker claims it once
the lease has run out and retries it. A worker told to stop (SIGTERM) stops training within a second or so and
hands its job back to the queue at once. A job is registered at most once (see ``patches.jobs``), and stops early
when it is cancelled or runs past the operator's time limit (``JobLimits``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from patches.data import DataError, Dataset, job_splits
from patches.encoder import Encoder
from patches.errors import PatchServeError, RegistryUnavailableError, TaskNotFoundError
from patches.format import Patch
from patches.jobs import TERMINAL, Gate, Job, JobError, JobLimits, JobQueue, TrainConfig
from patches.store import Registry
from trainer.train import TrainingStopped, progress_line, train_patch

log = logging.getLogger(__name__)
LOG_EVERY_S = 30.0  # seconds between progress lines in the log
POLL_CANCEL_S = 1.0  # how often a training job looks for a cancel request


class LeaseLostError(RuntimeError):
    """Another worker took over this job (this one was presumed dead)."""


class JobStop:
    """Asked by the training loop before every update: should this job stop now, and why.

    ``shutdown`` (the worker was told to stop: it hands the job back), ``cancelled`` (POST /jobs/{id}/cancel, seen
    by polling the job at most once a second) or ``time limit`` (the job ran past ``JobLimits.max_seconds``)."""

    def __init__(self, queue: JobQueue, job_id: str, shutdown: threading.Event, max_seconds: float) -> None:
        self.queue, self.job_id, self.shutdown = queue, job_id, shutdown
        self.deadline = time.monotonic() + max_seconds
        self.reason: str | None = None
        self._polled = time.monotonic()

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.shutdown.is_set():
            self.reason = "shutdown"
        elif now > self.deadline:
            self.reason = "time limit"
        elif now - self._polled >= POLL_CANCEL_S:
            self._polled = now
            if self.queue.cancel_requested(self.job_id):
                self.reason = "cancelled"
        return self.reason is not None


class Worker:
    def __init__(
        self,
        queue: JobQueue,
        registry: Registry,
        encoder: Encoder,
        *,
        name: str | None = None,
        lease_s: float = 60.0,
        block_s: float = 2.0,
        max_attempts: int = 3,
        device: str = "auto",
        limits: JobLimits | None = None,
        alive_file: Path | None = None,
    ) -> None:
        self.queue = queue
        self.registry = registry
        self.encoder = encoder
        # host and pid say where it runs; the random part keeps two workers apart that share both (containers on
        # the host's network all run as pid 1 under one hostname), since the queue tells consumers apart by name
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.lease_s = lease_s
        self.block_s = block_s
        self.max_attempts = max_attempts
        self.device = device
        self.limits = limits or JobLimits()
        self.shutdown = threading.Event()
        # touched while the worker's loop turns: between claims (every block_s) and at each heartbeat of a job, so a
        # container healthcheck can tell a live worker from a hung one by the file's age (docker-compose.yml)
        self.alive_file = alive_file

    def _alive(self) -> None:
        if self.alive_file is not None:
            self.alive_file.touch()

    def run(self, stop: threading.Event | None = None, max_jobs: int | None = None) -> int:
        """Process jobs until ``stop`` is set or ``max_jobs`` were handled; returns how many were handled.

        Setting ``stop`` (SIGTERM in ``patchserve worker``) also stops a job in training within a second or so and
        hands it back to the queue, where the next free worker takes it at once."""
        self.shutdown = stop = stop or threading.Event()
        self.queue.ensure_group()
        done = 0
        log.info("worker %s: waiting for jobs on %s", self.name, self.queue.url)
        while not stop.is_set() and (max_jobs is None or done < max_jobs):
            self._alive()
            try:
                claimed = self.queue.claim(self.name, lease_s=self.lease_s, block_s=self.block_s)
            except RegistryUnavailableError as exc:
                log.warning("queue unreachable (%s); retrying", exc)
                stop.wait(2.0)
                continue
            if claimed is not None:
                self.process(*claimed)
                done += 1
        return done

    # --- one job -------------------------------------------------------------------------------------------
    def process(self, msg_id: str, job_id: str) -> None:
        try:
            job = self.queue.get(job_id)
        except PatchServeError:
            self.queue.ack(msg_id)  # its record expired: nothing to retry
            return
        if job.status in TERMINAL:
            self.queue.ack(msg_id)
            return
        attempts = job.attempts + 1
        if attempts > self.max_attempts:
            self.queue.finish(
                job_id,
                "failed",
                error=f"gave up after {self.max_attempts} attempts: the worker "
                f"stopped during each (last error: {job.error or 'none recorded'})",
            )
            self.queue.ack(msg_id)
            return
        if not self.queue.start(job_id, self.name, attempts):  # cancelled before it started
            if self.queue.get(job_id).status not in TERMINAL:
                self.queue.finish(job_id, "cancelled", error="cancelled before it started")
            self.queue.ack(msg_id)
            return
        log.info("job %s (%s): attempt %d on %s", job_id, job.task, attempts, self.name)
        stop = JobStop(self.queue, job_id, self.shutdown, self.limits.max_seconds)
        try:
            status, values = self._execute(job, msg_id, stop)
        except LeaseLostError:
            log.warning("job %s was taken over by another worker; dropping it here", job_id)
            return
        except TrainingStopped as exc:
            if stop.reason == "shutdown":
                self.queue.hand_back(job_id, msg_id, job.attempts)
                log.info("job %s: stopped at update %d of %d and handed back to the queue", job_id, exc.step, exc.total)
                return
            status, values = self._stopped(stop.reason, exc)
        except (RegistryUnavailableError, ConnectionError) as exc:
            # transient: leave the message pending, so this or another worker retries after the lease
            log.warning("job %s: %s; it will be retried", job_id, exc)
            self.queue.update(job_id, status="queued", error=str(exc))
            return
        except Exception as exc:  # a bug or bad input: fail the job with the reason, never the worker
            log.exception("job %s failed", job_id)
            status, values = (
                "failed",
                {"error": f"{type(exc).__name__}: {exc}", "result": {"traceback": traceback.format_exc(limit=5)}},
            )
        self.queue.finish(job_id, status, **values)
        self.queue.ack(msg_id)
        log.info("job %s: %s%s", job_id, status, f" ({values['error']})" if values.get("error") else "")

    def _stopped(self, reason: str | None, exc: TrainingStopped) -> tuple[str, dict[str, Any]]:
        where = f"at update {exc.step} of {exc.total}" if exc.total else "before training"
        if reason == "cancelled":
            return "cancelled", {"error": f"cancelled {where}"}
        return "failed", {
            "error": f"stopped {where}: the job ran past this worker's limit of {self.limits.max_seconds:g} s "
            "(PATCHSERVE_MAX_JOB_SECONDS)"
        }

    def _execute(self, job: Job, msg_id: str, stop: JobStop) -> tuple[str, dict[str, Any]]:
        stashed = self.queue.stashed_patch(job.id)
        if stashed is not None:  # an earlier attempt trained it and may have died while registering
            patch = Patch.from_bytes(stashed)
            return "succeeded", {"result": job.result | self._register_once(patch)}
        config = TrainConfig.from_dict(job.config)
        if config.device == "auto":
            config.device = self.device
        try:
            train, dev, test = self._datasets(job, config)
            self.limits.check(config, len(train))  # a job queued past the server (patchserve submit) meets it here
            config.selection_metric(train.kind, train.labels)
        except DataError as exc:
            return "failed", {"error": f"bad data: {exc}"}
        except JobError as exc:
            return "failed", {"error": str(exc)}
        last_beat, last_log = [0.0], [0.0]

        def progress(p: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last_beat[0] >= 1.0 or p["step"] == p["total_steps"]:
                last_beat[0] = now
                if not self.queue.heartbeat(self.name, msg_id):
                    raise LeaseLostError(job.id)
                self._alive()
                self.queue.update(job.id, progress=p)
            if now - last_log[0] >= LOG_EVERY_S:  # a line in the worker's log too (docker compose logs worker)
                last_log[0] = now
                log.info("job %s: %s", job.id, progress_line(p))

        result = train_patch(self.encoder, train, dev, config, test=test, on_progress=progress, should_stop=stop)
        report, primary = result.report, result.report["metric"]
        summary = {
            "metric": primary,
            "dev": report["dev"],
            "test": report.get("test"),
            "selection": report["selection"],
            "steps": report["steps"],
            "lr": report["lr"],
            "seed": report["seed"],
            "seconds": report["seconds"],
            "trainable_params": report["trainable_params"],
        }
        if result.patch is None:  # --full: a report only
            return "succeeded", {"result": summary}
        if self.queue.cancel_requested(job.id):  # cancelled while the last steps ran: do not register
            return "cancelled", {"result": summary, "error": "cancelled after training; the patch was not registered"}
        verdict = self._gate(Gate.from_dict(job.gate), job.task, report["dev"][primary], primary)
        if verdict is not None:
            return "rejected", {"result": summary, "error": verdict}
        if not self.queue.heartbeat(self.name, msg_id):
            raise LeaseLostError(job.id)
        self.queue.stash_patch(job.id, result.patch.data, result.patch.patch_id)
        return "succeeded", {"result": summary | self._register_once(result.patch)}

    def _datasets(self, job: Job, config: TrainConfig) -> tuple[Dataset, Dataset, Dataset | None]:
        files = {}
        for role, name in job.files.items():
            data = self.queue.file(job.id, role)
            if data is None:
                raise DataError(f"the {role} file of job {job.id} is gone from the queue")
            files[role] = (name, data)
        splits = job_splits(files, kind=config.kind, seed=config.seed)
        return splits.train, splits.dev, splits.test

    def _gate(self, gate: Gate, task: str, score: float, primary: str) -> str | None:
        if gate.min_dev is not None and score < gate.min_dev:
            return f"dev {primary} {score:.4f} is below the gate's minimum {gate.min_dev}; the patch was not registered"
        if gate.not_worse:
            try:
                _, current = self.registry.get(task)
            except TaskNotFoundError:
                return None
            previous = current.meta.metrics.get(f"dev_{primary}")
            if previous is not None and score < previous:
                return (
                    f"dev {primary} {score:.4f} is worse than the current version's {previous:.4f}; "
                    "the patch was not registered"
                )
        return None

    def _register_once(self, patch: Patch) -> dict[str, Any]:
        try:
            for v in self.registry.versions(patch.meta.task):
                if v.patch_id == patch.patch_id:
                    return {"version": v.version, "patch_id": v.patch_id}
        except TaskNotFoundError:
            pass
        info = self.registry.put(patch)
        return {"version": info.version, "patch_id": info.patch_id}
