"""The training-job API: enqueue a job (data files + JSON config) and follow it. Workers do the training."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, File, Form, HTTPException, Query, UploadFile
from fastapi.concurrency import run_in_threadpool

from patchserve.patches.api import JobPublic
from patchserve.patches.data import job_splits
from patchserve.patches.jobs import Gate, JobError, JobQueue
from patchserve.patches.train_config import TrainConfig, options
from patchserve.patches.validation import strict_json
from patchserve.server.deps import AdminAuth, ReadAuth, ServiceDep
from patchserve.server.openapi import JobId, errors

router = APIRouter(tags=["jobs"])
CONFIG_HELP = (
    'JSON training config, e.g. {"task": "trec", "epochs": 5}, with an optional "gate": {"min_dev": 0.8, '
    '"not_worse": true}. Its fields are the training options (the docs\' training page, or `patchserve train '
    "--help`): " + ", ".join(f"`{o.name}`" for o in options()) + "."
)


def _queue(svc: Any) -> JobQueue:
    if svc.queue is None:  # not a passing condition a retry could outwait: this server has no queue at all
        raise HTTPException(
            501,
            "training jobs need a Redis queue: start the server with PATCHSERVE_QUEUE="
            "redis://host:port/db (or a Redis registry, which is used for both)",
        )
    queue: JobQueue = svc.queue
    return queue


@router.post("/jobs", status_code=202, response_model=JobPublic, responses=errors(401, 403, 413, 422, 501, 503))
async def submit_job(
    svc: ServiceDep,
    _: AdminAuth,
    train: UploadFile = File(description="Training data (.jsonl or .csv)."),  # noqa: B008
    dev: UploadFile | None = File(None, description="Dev data (default: 10% of train)."),  # noqa: B008
    test: UploadFile | None = File(None, description="Test data, scored once at the end."),  # noqa: B008
    config: str = Form(description=CONFIG_HELP),
) -> dict[str, Any]:
    """Queue a training job; a worker trains it and registers the patch if it passes the gate."""
    queue = _queue(svc)
    raw = strict_json(config, "config", JobError)
    if not isinstance(raw, dict):
        raise JobError("config must be a JSON object")
    gate = raw.pop("gate", None)
    files = {}
    for role, upload in (("train", train), ("dev", dev), ("test", test)):
        if upload is not None:
            files[role] = (upload.filename or f"{role}.jsonl", await upload.read())
    checked = TrainConfig.from_dict(raw)
    Gate.from_dict(gate)
    # the data is checked here as the worker will read it: bad rows are a 422 now, not a failed job later
    splits = await run_in_threadpool(job_splits, files, checked.kind, checked.seed)
    svc.settings.job_limits.check(checked, len(splits.train))
    checked.check_task(splits.train.kind, splits.train.labels)  # e.g. entity_f1 on non-BIO tags
    job = await run_in_threadpool(queue.submit, raw, files, gate)
    return job.to_dict()


@router.get("/jobs", response_model=list[JobPublic], responses=errors(401, 403, 422, 501, 503))
async def list_jobs(
    svc: ServiceDep, _: ReadAuth, limit: int = Query(50, ge=1, le=1000, description="How many jobs, newest first.")
) -> list[dict[str, Any]]:
    """Recent jobs, newest first, with status, progress, metrics and errors."""
    jobs = await run_in_threadpool(_queue(svc).list, limit)
    return [j.to_dict() for j in jobs]


@router.get("/jobs/{job_id}", response_model=JobPublic, responses=errors(401, 403, 404, 422, 501, 503))
async def get_job(job_id: JobId, svc: ServiceDep, _: ReadAuth) -> dict[str, Any]:
    """One job: status (queued, running, succeeded, rejected, failed), progress, result, error."""
    return (await run_in_threadpool(_queue(svc).get, job_id)).to_dict()


@router.post("/jobs/{job_id}/cancel", response_model=JobPublic, responses=errors(401, 403, 404, 409, 422, 501, 503))
async def cancel_job(job_id: JobId, svc: ServiceDep, _: AdminAuth) -> dict[str, Any]:
    """Cancel a job. A queued job ends as ``cancelled`` at once; a running one is asked to stop, and its worker
    ends it as ``cancelled`` at its next update (within a few seconds): follow it with GET /jobs/{id}. A job that
    already ended is a 409."""
    return (await run_in_threadpool(_queue(svc).cancel, job_id)).to_dict()
