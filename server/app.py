"""``create_app(settings)``: the FastAPI app. Nothing heavy happens at import; the lifespan handler loads the
encoder, opens the registry, installs the slotted engine and starts the batcher and the registry watcher.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from patches import __version__
from patches.encoder import Encoder, load_encoder
from patches.errors import (
    InvalidTaskNameError,
    PatchError,
    RegistryUnavailableError,
    TaskNotFoundError,
    VersionNotFoundError,
)
from patches.jobs import JobNotFoundError, JobQueue
from patches.store import Registry, open_registry
from server.catalog import Catalog
from server.deps import Service
from server.engine.batcher import Batcher, OverloadedError
from server.engine.runner import Runner
from server.engine.slots import PatchCache
from server.metrics import Metrics
from server.predict import InputError
from server.routes import router
from server.routes_jobs import router as jobs_router
from server.settings import ServerSettings

log = logging.getLogger("patchserve")


class BodyLimitMiddleware:
    """Refuse request bodies whose Content-Length is over the limit with 413, before reading them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                resp = JSONResponse(
                    {
                        "detail": f"request body of {int(length)} bytes is over the {self.max_bytes}"
                        "-byte limit (PATCHSERVE_MAX_BODY_BYTES)"
                    },
                    status_code=413,
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, exc: Exception, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    table: list[tuple[type[Exception], int]] = [
        (TaskNotFoundError, 404),
        (JobNotFoundError, 404),
        (VersionNotFoundError, 404),
        (InvalidTaskNameError, 422),
        (InputError, 422),
        (PatchError, 409),  # a registered patch that does not fit this server's encoder
        (RegistryUnavailableError, 503),
    ]
    for exc_type, status in table:

        def handler(_: Request, exc: Exception, status: int = status) -> JSONResponse:
            return _error(status, exc)

        app.add_exception_handler(exc_type, handler)

    def overloaded(_: Request, exc: Exception) -> JSONResponse:
        return _error(503, exc, {"Retry-After": "1"})

    app.add_exception_handler(OverloadedError, overloaded)


def create_app(
    settings: ServerSettings | None = None, *, encoder: Encoder | None = None, registry: Registry | None = None
) -> FastAPI:
    """Build the app. Tests pass their own settings (and may pass a loaded encoder or an open registry).

    A passed encoder is owned by the app from then on: the runner moves it to the device and rewrites its biased
    modules in place.
    """
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        enc: Encoder = encoder if encoder is not None else await asyncio.to_thread(load_encoder, settings.model)
        reg = registry or open_registry(settings.registry)
        reg.max_patch_bytes = settings.max_patch_bytes
        metrics = Metrics()
        _ = enc.spec  # computed from the plain model, before the runner rewrites its modules
        runner = Runner(
            enc,
            device=settings.device,
            dtype=settings.dtype,
            slots=settings.slots,
            drop_key_bias=settings.drop_key_bias,
            fold_value_bias=settings.fold_value_bias,
            on_load=metrics.patch_load.labels(source="slot").observe,
        )
        batcher = Batcher(
            runner,
            max_rows=settings.max_batch_rows,
            max_tokens=settings.max_batch_tokens,
            max_wait_ms=settings.max_wait_ms,
            max_queue_rows=settings.max_queue_rows,
            on_batch=metrics.observe_batch,
        )
        catalog = Catalog(
            reg,
            enc.spec,
            PatchCache(settings.patch_cache_mb * 1024 * 1024),
            on_fetch=metrics.patch_load.labels(source="registry").observe,
        )
        await asyncio.to_thread(catalog.start)
        batcher.start()
        queue_url = settings.queue or (settings.registry if settings.registry.startswith("redis") else None)
        queue = JobQueue(queue_url) if queue_url else None
        app.state.service = Service(settings, enc, reg, runner, batcher, catalog, metrics, queue)
        log.info(
            "patchserve ready: %s (%s) on %s, registry %s, %d tasks",
            enc.name,
            enc.fingerprint[:19],
            runner.device,
            reg.url,
            len(catalog.current),
        )
        try:
            yield
        finally:
            app.state.service = None
            await batcher.stop()
            await asyncio.to_thread(catalog.stop)
            if registry is None:
                reg.close()
            if queue is not None:
                queue.close()

    app = FastAPI(
        title="patchserve",
        version=__version__,
        description="Multi-task inference for BitFit bias patches on one frozen shared encoder. Requests of "
        "different tasks share one forward pass; each row gets its own task's biases.",
        lifespan=lifespan,
    )
    app.state.service = None
    app.include_router(router)
    app.include_router(jobs_router)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


def app_factory() -> Any:
    """For ``uvicorn --factory server.app:app_factory``: settings from PATCHSERVE_* env vars."""
    return create_app(ServerSettings())
