"""The operator page, ``/ui``: server-rendered HTML with a little JavaScript, no build step, every asset served by
the app itself (nothing from a CDN).

The page itself needs no token and shows only what /readyz shows. Its tables are HTML fragments rendered here
(Jinja2, escaped) that the page's script fetches with the bearer token typed into the page (kept in the tab's
sessionStorage), so they follow the API's auth: the fragments are reads (the predict or admin token whenever one
is set), and rollback, delete and cancel go to the JSON API with the admin token. Jobs and request rates refresh
every few seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from patchserve import __version__
from patchserve.patches.errors import PatchServeError
from patchserve.server.deps import ReadAuth, ServiceDep
from patchserve.server.openapi import TaskName

HERE = Path(__file__).parent
router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "templates")
static = StaticFiles(directory=HERE / "static")
MAX_ROWS = 500  # tasks or jobs shown at once; the JSON API pages through them all


@router.get("/ui", response_class=HTMLResponse)
async def page(request: Request, svc: ServiceDep) -> Any:
    """The page: what /readyz shows, and places for the tables its script fills in."""
    context = {
        "model": svc.encoder.name,
        "fingerprint": svc.encoder.fingerprint,
        "device": svc.engine.device,
        "registry": svc.registry.url,
        "version": __version__,
        "jobs": svc.queue is not None,
    }
    return templates.TemplateResponse(request, "page.html", context)


@router.get("/ui/fragments/tasks", response_class=HTMLResponse)
async def tasks(request: Request, svc: ServiceDep, _: ReadAuth) -> Any:
    """Every task: its current version, kind, patch type, labels, dev score and request rate (from the server's
    metrics)."""

    def read() -> tuple[list[dict[str, Any]], bool]:
        rows = []
        page = svc.registry.page(MAX_ROWS)  # the first tasks by name: the rest through GET /tasks' pages
        for info in page.items:
            name = info.task
            row: dict[str, Any] = {"name": name, "version": info.version, "registered_at": info.registered_at}
            try:
                _, patch = svc.catalog.resolve(name)
                meta = patch.meta
                row |= {"kind": meta.kind, "type": meta.patch_type, "labels": meta.labels, "metrics": meta.metrics}
            except PatchServeError as exc:  # e.g. trained on another base: say so in the row
                row["problem"] = str(exc)
            rows.append(row)
        return rows, page.next_after is not None

    rows, capped = await run_in_threadpool(read)
    rates = svc.metrics.request_rates()
    context = {"rows": rows, "rates": rates, "capped": capped}
    return templates.TemplateResponse(request, "tasks.html", context)


@router.get("/ui/fragments/tasks/{name}", response_class=HTMLResponse)
async def versions(name: TaskName, request: Request, svc: ServiceDep, _: ReadAuth) -> Any:
    """One task's stored versions with each version's recorded metrics."""

    def read() -> tuple[int, list[dict[str, Any]]]:
        current = svc.registry.info(name).version
        rows = []
        for v in svc.registry.versions(name):
            _, patch = svc.registry.get(name, v.version)
            rows.append(
                {
                    "version": v.version,
                    "registered_at": v.registered_at,
                    "size": v.size,
                    "patch_id": v.patch_id,
                    "metrics": patch.meta.metrics,
                }
            )
        return current, rows

    current, rows = await run_in_threadpool(read)
    return templates.TemplateResponse(request, "versions.html", {"name": name, "current": current, "rows": rows})


@router.get("/ui/fragments/jobs", response_class=HTMLResponse)
async def jobs(request: Request, svc: ServiceDep, _: ReadAuth) -> Any:
    """Recent training jobs with their progress and errors."""
    rows = [] if svc.queue is None else [j.to_dict() for j in await run_in_threadpool(svc.queue.list, 50)]
    return templates.TemplateResponse(request, "jobs.html", {"rows": rows, "queue": svc.queue is not None})
