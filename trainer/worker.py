"""The trainer worker: claims jobs from the queue, trains, gates, registers, acks.

The encoder is loaded once at start-up and handed to every job. Several workers (on several machines) share one
queue; each job goes to one of them. A worker killed mid-job leaves its job pending; another worker claims it once
the lease has run out and retries it. A worker told to stop (SIGTERM) stops training within a second or so and
hands its job back to the queue at once. A job is registered at most once (see ``patchserve.patches.jobs``), and stops
early when it is cancelled or runs past the operator's time limit (``JobLimits``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchserve.patches.data import DataError, Dataset, job_splits
from patchserve.patches.encoder import Encoder, resolve_device
from patchserve.patches.errors import PatchServeError, RegistryUnavailableError, TaskNotFoundError
from patchserve.patches.format import Patch
from patchserve.patches.jobs import TERMINAL, Gate, Job, JobError, JobLimits, JobQueue
from patchserve.patches.packed import PackedBert, packed_unsupported
from patchserve.patches.packed_model import training_bert
from patchserve.patches.store import Registry
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer.joint import JointTrainer
from patchserve.trainer.progress import TrainingStopped, progress_line
from patchserve.trainer.train import PatchTraining, TrainResult

log = logging.getLogger(__name__)
LOG_EVERY_S = 30.0  # seconds between progress lines in the log
POLL_CANCEL_S = 1.0  # how often a training job looks for a cancel request
HEARTBEAT_S = 1.0  # how often the leases of the jobs in training are renewed
CLAIM_EVERY_S = 1.0  # how often a worker with jobs in training (and room for more) looks for another


class LeaseLostError(RuntimeError):
    """Another worker took over this job (this one was presumed dead)."""


class JobStop:
    """Asked by the training loop before every update: should this job stop now, and why.

    ``shutdown`` (the worker was told to stop: it hands the job back), ``cancelled`` (POST /jobs/{id}/cancel, seen
    by polling the job at most once a second), ``time limit`` (the job ran past ``JobLimits.max_seconds``) or
    ``lease lost`` (another worker took the job over). Each call first lets the worker's heartbeat run
    (``pulse``): it is asked often, between evaluation batches too."""

    def __init__(
        self,
        queue: JobQueue,
        job_id: str,
        shutdown: threading.Event,
        max_seconds: float,
        pulse: Callable[[], None] = lambda: None,
    ) -> None:
        self.queue, self.job_id, self.shutdown, self.pulse = queue, job_id, shutdown, pulse
        self.deadline = time.monotonic() + max_seconds
        self.reason: str | None = None
        self.lease_lost = False
        self._polled = time.monotonic()

    def __call__(self) -> bool:
        self.pulse()
        now = time.monotonic()
        if self.lease_lost:
            self.reason = "lease lost"
        elif self.shutdown.is_set():
            self.reason = "shutdown"
        elif now > self.deadline:
            self.reason = "time limit"
        elif now - self._polled >= POLL_CANCEL_S:
            self._polled = now
            if self.queue.cancel_requested(self.job_id):
                self.reason = "cancelled"
        return self.reason is not None


@dataclass
class _Running:
    """A job in training on this worker."""

    msg_id: str
    job: Job
    stop: JobStop
    training: PatchTraining | None = None


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
        concurrent_jobs: int = 1,
    ) -> None:
        if concurrent_jobs < 1:
            raise ValueError(f"concurrent_jobs must be at least 1, not {concurrent_jobs}")
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
        self.concurrent_jobs = concurrent_jobs
        self.shutdown = threading.Event()
        # touched while the worker's loop turns: between claims (every block_s) and at each heartbeat of a job, so a
        # container healthcheck can tell a live worker from a hung one by the file's age (docker-compose.yml)
        self.alive_file = alive_file
        self._running: dict[str, _Running] = {}  # by job id
        self._last_pulse = 0.0
        self._packed_bert: PackedBert | None = None

    def _alive(self) -> None:
        if self.alive_file is not None:
            self.alive_file.touch()

    def _pulse(self) -> None:
        """At most once a second: touch the alive file and renew the lease of every job in training; a job whose
        lease another worker took over is marked, and its JobStop ends it."""
        now = time.monotonic()
        if now - self._last_pulse < HEARTBEAT_S:
            return
        self._last_pulse = now
        self._alive()
        for running in list(self._running.values()):
            if not running.stop.lease_lost and not self.queue.heartbeat(self.name, running.msg_id):
                running.stop.lease_lost = True

    def _shared_bert(self) -> PackedBert | None:
        """The frozen encoder as the packed training model reads it, built once and shared by every job trained
        here, so that concurrent jobs encode their rows together. The encoder moves to the worker's device once
        (a job that asks for another device trains on a copy of its own)."""
        if self._packed_bert is None and packed_unsupported(self.encoder.model) is None:
            model = self.encoder.model.to(resolve_device(self.device))
            self._packed_bert = training_bert(model)
        return self._packed_bert

    def run(self, stop: threading.Event | None = None, max_jobs: int | None = None) -> int:
        """Process jobs until ``stop`` is set or ``max_jobs`` were handled; returns how many were handled.

        Up to ``concurrent_jobs`` jobs train at once, in one batch (``patchserve.trainer.joint.JointTrainer``): a job
        claimed while others train joins at their next update, and one that ends leaves without stopping the others.
        Setting ``stop`` (SIGTERM in ``patchserve worker``) also stops every job in training within a second or so
        and hands it back to the queue, where the next free worker takes it at once."""
        self.shutdown = stop = stop or threading.Event()
        self.queue.ensure_group()
        trainer = JointTrainer()
        done = 0
        last_claim = 0.0
        log.info(
            "worker %s: waiting for jobs on %s (up to %d at once)", self.name, self.queue.url, self.concurrent_jobs
        )
        while len(trainer) or not (stop.is_set() or (max_jobs is not None and done >= max_jobs)):
            self._alive()
            room = self.concurrent_jobs - len(trainer)
            if max_jobs is not None:
                room = min(room, max_jobs - done - len(trainer))
            # while jobs train, look for more at most once a second (a claim costs two round trips to Redis)
            if room > 0 and not stop.is_set() and (not len(trainer) or time.monotonic() - last_claim >= CLAIM_EVERY_S):
                last_claim = time.monotonic()
                try:
                    claimed = self.queue.claim(
                        self.name, lease_s=self.lease_s, block_s=0.0 if len(trainer) else self.block_s
                    )
                except RegistryUnavailableError as exc:
                    log.warning("queue unreachable (%s); retrying", exc)
                    if not len(trainer):
                        stop.wait(2.0)
                    claimed = None
                if claimed is not None:
                    training = self._begin(*claimed)
                    if training is None:  # ended before training (or needs none)
                        done += 1
                    else:
                        trainer.add(training)
                    last_claim = 0.0  # a queue that had one may have more: look again at once
                    continue
            if not len(trainer):
                continue
            for training, error in trainer.step():
                self._end(training, error)
                done += 1
        return done

    # --- one job -------------------------------------------------------------------------------------------
    def process(self, msg_id: str, job_id: str) -> None:
        """Take one claimed job from start to end (alone)."""
        training = self._begin(msg_id, job_id)
        if training is None:
            return
        trainer = JointTrainer([training])
        while len(trainer):
            for ended, error in trainer.step():
                self._end(ended, error)

    def _begin(self, msg_id: str, job_id: str) -> PatchTraining | None:
        """Start a claimed job: its training, ready to join the batch; None when the job ended without one."""
        try:
            job = self.queue.get(job_id)
        except PatchServeError:
            self.queue.ack(msg_id)  # its record expired: nothing to retry
            return None
        if job.status in TERMINAL:
            self.queue.ack(msg_id)
            return None
        attempts = job.attempts + 1
        if attempts > self.max_attempts:
            self.queue.finish(
                job_id,
                "failed",
                error=f"gave up after {self.max_attempts} attempts: the worker "
                f"stopped during each (last error: {job.error or 'none recorded'})",
            )
            self.queue.ack(msg_id)
            return None
        if not self.queue.start(job_id, self.name, attempts):  # cancelled before it started
            if self.queue.get(job_id).status not in TERMINAL:
                self.queue.finish(job_id, "cancelled", error="cancelled before it started")
            self.queue.ack(msg_id)
            return None
        log.info("job %s (%s): attempt %d on %s", job_id, job.task, attempts, self.name)
        stop = JobStop(self.queue, job_id, self.shutdown, self.limits.max_seconds, pulse=self._pulse)
        running = _Running(msg_id, job, stop)
        self._running[job_id] = running
        outcome = self._settle(running, lambda: self._prepare(running))
        if isinstance(outcome, PatchTraining):
            running.training = outcome
            return outcome
        return None

    def _end(self, training: PatchTraining, error: Exception | None) -> None:
        """A job left the batch: trained (``error`` None: gate, register, ack) or ended by ``error``."""
        running = next(r for r in self._running.values() if r.training is training)

        def outcome() -> tuple[str, dict[str, Any]]:
            if error is not None:
                raise error
            return self._complete(running, training.finish())

        self._settle(running, outcome)

    def _settle(
        self, running: _Running, outcome: Callable[[], tuple[str, dict[str, Any]] | PatchTraining]
    ) -> PatchTraining | None:
        """Run a step of a job's life and record how it ended: a PatchTraining (training goes on) is returned; an
        end (status and values) is written and the job acked; a stop, a lost lease or an unreachable Redis leave
        the job to the queue as ever. A job that ended is no longer this worker's (nor its lease to renew)."""
        result = self._record(running, outcome)
        if result is None:
            self._running.pop(running.job.id, None)
        return result

    def _record(
        self, running: _Running, outcome: Callable[[], tuple[str, dict[str, Any]] | PatchTraining]
    ) -> PatchTraining | None:
        job, msg_id, stop = running.job, running.msg_id, running.stop
        try:
            result = outcome()
            if isinstance(result, PatchTraining):
                return result
            status, values = result
        except TrainingStopped as exc:
            if stop.reason == "lease lost":
                log.warning("job %s was taken over by another worker; dropping it here", job.id)
                return None
            if stop.reason == "shutdown":
                self.queue.hand_back(job.id, msg_id, job.attempts)
                log.info("job %s: stopped at update %d of %d and handed back to the queue", job.id, exc.step, exc.total)
                return None
            status, values = self._stopped(stop.reason, exc)
        except LeaseLostError:
            log.warning("job %s was taken over by another worker; dropping it here", job.id)
            return None
        except (RegistryUnavailableError, ConnectionError) as exc:
            # transient: leave the message pending, so this or another worker retries after the lease
            log.warning("job %s: %s; it will be retried", job.id, exc)
            self.queue.update(job.id, status="queued", error=str(exc))
            return None
        except Exception as exc:  # a bug or bad input: fail the job with the reason, never the worker
            log.exception("job %s failed", job.id)
            status, values = (
                "failed",
                {"error": f"{type(exc).__name__}: {exc}", "result": {"traceback": traceback.format_exc(limit=5)}},
            )
        self.queue.finish(job.id, status, **values)
        self.queue.ack(msg_id)
        log.info("job %s: %s%s", job.id, status, f" ({values['error']})" if values.get("error") else "")
        return None

    def _stopped(self, reason: str | None, exc: TrainingStopped) -> tuple[str, dict[str, Any]]:
        where = f"at update {exc.step} of {exc.total}" if exc.total else "before training"
        if reason == "cancelled":
            return "cancelled", {"error": f"cancelled {where}"}
        return "failed", {
            "error": f"stopped {where}: the job ran past this worker's limit of {self.limits.max_seconds:g} s "
            "(PATCHSERVE_MAX_JOB_SECONDS)"
        }

    def _prepare(self, running: _Running) -> tuple[str, dict[str, Any]] | PatchTraining:
        """A job's training, ready to run; or its end, when it needs no training (an earlier attempt's stashed
        patch) or cannot have one (bad data, a config over the limits)."""
        job, stop = running.job, running.stop
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
            config.check_task(train.kind, train.labels)
        except DataError as exc:
            return "failed", {"error": f"bad data: {exc}"}
        except JobError as exc:
            return "failed", {"error": str(exc)}
        last_update, last_log = [0.0], [0.0]

        def progress(p: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last_update[0] >= 1.0 or p["step"] == p["total_steps"]:
                last_update[0] = now
                self.queue.update(job.id, progress=p)
            if now - last_log[0] >= LOG_EVERY_S:  # a line in the worker's log too (docker compose logs worker)
                last_log[0] = now
                log.info("job %s: %s", job.id, progress_line(p))

        return PatchTraining(
            self.encoder,
            train,
            dev,
            config,
            test=test,
            on_progress=progress,
            should_stop=stop,
            packed_bert=self._shared_bert(),
        )

    def _complete(self, running: _Running, result: TrainResult) -> tuple[str, dict[str, Any]]:
        """A trained job's end: its gate, then its registration (exactly once)."""
        job, msg_id = running.job, running.msg_id
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
        if warning := splits.untrained_warning():
            log.warning("job %s: %s", job.id, warning.removeprefix("warning: "))
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
