"""HTTP routes. They only translate HTTP to catalog / batcher calls; errors become 4xx/5xx in
``patchserve.server.app``."""

from __future__ import annotations

import base64
import contextlib
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, File, Form, HTTPException, Query, Request, Response, UploadFile
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from patchserve.patches.api import (
    BaseInfo,
    PredictRequest,
    PredictResponse,
    RollbackRequest,
    TaskDeleted,
    TaskDetail,
    TaskRegistered,
    TaskSummary,
    VersionPublic,
)
from patchserve.patches.cli import patch_summary
from patchserve.patches.errors import InvalidTaskNameError, PatchError, PatchServeError, PatchTooLargeError
from patchserve.patches.format import Patch
from patchserve.patches.peft_archive import AdapterTooLargeError, adapter_files, is_archive
from patchserve.patches.peft_io import import_peft_bytes
from patchserve.patches.validation import validate_task_name
from patchserve.server.deps import AdminAuth, ReadAuth, ServiceDep
from patchserve.server.inference import InferenceService, name_task, run_rows
from patchserve.server.openapi import TaskName, errors
from patchserve.server.predict import check_request, decode, normalise_inputs

router = APIRouter()

DEFAULT_PAGE = 100  # tasks in a page of GET /tasks unless asked
MAX_PAGE = 1000
NEXT_PAGE_LINK = '`<URL>; rel="next"`: the next page, where more tasks follow (none on the last page)'


@router.post(
    "/tasks/{name}/predict",
    response_model=PredictResponse,
    response_model_exclude_none=True,
    responses=errors(401, 403, 404, 409, 413, 422, 503, 504),
    tags=["predict"],
)
async def predict(name: TaskName, body: PredictRequest, request: Request, svc: InferenceService) -> Any:
    """Predict with the current version of task ``name``. Inputs of any tasks share batches on the device."""
    texts, pairs = normalise_inputs(body.inputs)
    info, patch = await svc.catalog.resolve_async(name)
    name_task(request, name)
    check_request(patch, pairs, body.top_k, body.all_scores)
    encoded, outputs = await run_rows(svc, request, patch, texts, pairs)
    preds = [decode(o, e, body.top_k, body.all_scores) for o, e in zip(outputs, encoded, strict=True)]
    return PredictResponse(task=name, version=info.version, patch_id=info.patch_id, predictions=preds)


@router.post(
    "/tasks", status_code=201, response_model=TaskRegistered, responses=errors(401, 403, 413, 422, 503), tags=["tasks"]
)
async def register(
    svc: ServiceDep,
    _: AdminAuth,
    patch: UploadFile = File(  # noqa: B008
        description="A patch file (.safetensors) made by `patchserve train`, or a PEFT LoRA or IA3 adapter folder "
        "packed as .zip or .tar(.gz) (adapter_config.json + adapter_model.safetensors, its classifier in "
        "modules_to_save), as `patchserve import-peft` reads it."
    ),
    task: str | None = Form(None, description="A PEFT adapter's task name (required for an adapter archive)."),
    labels: str | None = Form(
        None, description="A PEFT adapter's labels in head order, comma-separated (default LABEL_0, LABEL_1, ...)."
    ),
) -> Any:
    """Register a patch as the new current version of its task (the task name comes from the patch), or a PEFT
    adapter archive as task ``task``. A refused upload changes nothing."""
    limit = svc.settings.max_patch_bytes
    data = await patch.read(limit + 1)

    def parse() -> Patch:
        if not is_archive(data):
            parsed = Patch.from_bytes(data, max_bytes=limit)
            if task and task != parsed.meta.task:
                raise PatchError(
                    f"the patch is task {parsed.meta.task!r}, not {task!r}: a patch file carries its own task name "
                    "(the form field task names a PEFT adapter archive's task)"
                )
            return parsed
        if len(data) > limit:
            raise PatchTooLargeError(f"the adapter archive is over the {limit}-byte limit")
        if not task:
            raise PatchError("a PEFT adapter archive needs the form field 'task': the name to serve it under")
        config, weights = adapter_files(data, limit=limit)
        names = [x.strip() for x in labels.split(",")] if labels else None
        return import_peft_bytes(config, weights, svc.encoder, task, labels=names, local=False)

    try:
        parsed = await run_in_threadpool(parse)  # CPU work, off the event loop
        info = await run_in_threadpool(svc.catalog.register, parsed)
    except (PatchTooLargeError, AdapterTooLargeError) as exc:
        raise HTTPException(413, str(exc)) from exc
    except PatchError as exc:
        raise HTTPException(422, f"invalid patch: {exc}") from exc
    m = parsed.meta
    return TaskRegistered(
        name=info.task,
        version=info.version,
        patch_id=info.patch_id,
        kind=m.kind,
        labels=m.labels,
        n_params=parsed.n_params,
        patch_type=m.patch_type,
        base=BaseInfo(name=m.base.name, fingerprint=m.base.fingerprint),
    )


@router.get(
    "/tasks",
    response_model=list[TaskSummary],
    responses=errors(401, 403, 422, 503)
    | {200: {"headers": {"Link": {"description": NEXT_PAGE_LINK, "schema": {"type": "string"}}}}},
    tags=["tasks"],
)
async def list_tasks(
    request: Request,
    response: Response,
    svc: ServiceDep,
    _: ReadAuth,
    limit: int = Query(DEFAULT_PAGE, ge=1, le=MAX_PAGE, description="How many tasks, at most, in this page."),
    cursor: str | None = Query(None, max_length=128, description="Where to go on: from the previous page's Link."),
    prefix: str = Query("", max_length=64, pattern=r"^[A-Za-z0-9_.\-]*$", description="Only tasks named so."),
) -> Any:
    """Registered tasks with their current versions, by name, a page at a time. Where more follow, the ``Link``
    header names the next page (``rel="next"``): a cursor that stays valid while tasks are added or deleted."""
    after = decode_cursor(cursor) if cursor is not None else None
    page = await run_in_threadpool(svc.registry.page, limit, after=after, prefix=prefix)
    if page.next_after is not None:
        params = {"limit": limit, "cursor": encode_cursor(page.next_after)} | ({"prefix": prefix} if prefix else {})
        response.headers["Link"] = f'<{request.url.path}?{urlencode(params)}>; rel="next"'
    return [
        TaskSummary(name=v.task, version=v.version, patch_id=v.patch_id, registered_at=v.registered_at)
        for v in page.items
    ]


def encode_cursor(after: str) -> str:
    return base64.urlsafe_b64encode(after.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """The task name a cursor stands for; a 422 for one this server did not write."""
    try:
        after = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        return validate_task_name(after)
    except (ValueError, InvalidTaskNameError):
        raise HTTPException(
            422, f"cursor {cursor[:40]!r} is not one this server wrote: pass the one a page's Link header gave"
        ) from None


@router.get("/tasks/{name}", response_model=TaskDetail, responses=errors(401, 403, 404, 422, 503), tags=["tasks"])
async def get_task(name: TaskName, svc: ServiceDep, _: ReadAuth) -> Any:
    """A task's versions, which one is current, and the current patch's metadata."""

    def read() -> TaskDetail:
        versions = svc.registry.versions(name)
        info, patch = svc.registry.get(name)
        return TaskDetail(
            name=name,
            current=info.version,
            versions=[
                VersionPublic(version=v.version, patch_id=v.patch_id, size=v.size, registered_at=v.registered_at)
                for v in versions
            ],
            metadata=patch_summary(patch),
        )

    return await run_in_threadpool(read)


@router.delete("/tasks/{name}", response_model=TaskDeleted, responses=errors(401, 403, 404, 422, 503), tags=["tasks"])
async def delete_task(name: TaskName, svc: ServiceDep, _: AdminAuth) -> Any:
    """Delete a task and all its versions. Requests already in flight still complete."""
    await run_in_threadpool(svc.catalog.delete, name)
    return TaskDeleted(name=name)


@router.post(
    "/tasks/{name}/rollback", response_model=TaskSummary, responses=errors(401, 403, 404, 422, 503), tags=["tasks"]
)
async def rollback(name: TaskName, body: RollbackRequest, svc: ServiceDep, _: AdminAuth) -> Any:
    """Make an earlier (or later) stored version current."""
    info = await run_in_threadpool(svc.catalog.rollback, name, body.version)
    return TaskSummary(name=name, version=info.version, patch_id=info.patch_id, registered_at=info.registered_at)


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", responses=errors(503), tags=["ops"])
async def readyz(svc: ServiceDep) -> dict[str, Any]:
    """The encoder is loaded (in this process or the engine process) and the registry answers."""
    problem = svc.engine.problem()
    if problem is not None:
        raise HTTPException(503, problem)
    try:
        await run_in_threadpool(svc.registry.ping)
    except PatchServeError as exc:
        raise HTTPException(503, f"registry not reachable: {exc}") from exc
    return {
        "status": "ready",
        "model": svc.encoder.name,
        "fingerprint": svc.encoder.fingerprint,
        "registry": svc.registry.url,
        "device": svc.engine.device,
        **svc.encoder.describe(svc.settings.max_seq_length),
    }


@router.get("/metrics", tags=["ops"], response_class=Response)
async def metrics(svc: ServiceDep) -> Response:
    """Prometheus metrics (of every process of the server)."""
    m = svc.metrics
    with contextlib.suppress(PatchServeError):  # the registry is unreachable: the gauge keeps its last count
        m.tasks.set(await run_in_threadpool(svc.registry.count))
    if svc.queue is not None:
        try:
            jobs = await run_in_threadpool(svc.queue.list, 500)
            m.set_jobs([j.status for j in jobs])
        except PatchServeError:
            pass  # the queue being down must not break scraping the rest
    return Response(generate_latest(m.exposed()), media_type=CONTENT_TYPE_LATEST)
