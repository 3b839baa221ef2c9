"""``create_app(settings)``: the FastAPI app. Nothing heavy happens at import; the lifespan handler loads the
encoder, opens the registry, installs the slotted engine and starts the batcher and the registry watcher.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY, RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from patches import __version__
from patches.data import DataError
from patches.encoder import Encoder, load_encoder
from patches.errors import (
    InvalidTaskNameError,
    PatchError,
    RegistryUnavailableError,
    TaskNotFoundError,
    VersionNotFoundError,
    describe_validation_errors,
)
from patches.jobs import JobError, JobNotFoundError, JobQueue, JobStateError
from patches.store import Registry, open_registry
from server import ui
from server.catalog import Catalog
from server.deps import Service
from server.embeddings import router as embeddings_router
from server.engine.batcher import Batcher, OverloadedError
from server.engine.runner import Runner
from server.engine.slots import PatchCache
from server.inference import ClientGoneError
from server.metrics import Metrics, RequestMetrics
from server.oip import openapi_components
from server.oip import router as oip_router
from server.openapi import add_schemas
from server.predict import InputError
from server.routes import router
from server.routes_jobs import router as jobs_router
from server.settings import ServerSettings

log = logging.getLogger("patchserve")


INFERENCE_SUFFIXES = ("/predict", "/infer", "/embed", "/embeddings")  # routes whose bodies are parsed on the loop
_OPENAI_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def error_response(path: str, status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """Every error is ``{"detail": "..."}``; routes of a protocol also get that protocol's error field, so its own
    clients show the message: ``"error"`` for the Open Inference Protocol (/v2), ``{"error": {"message", "type",
    "code"}}`` for the OpenAI-compatible routes (/v1)."""
    body: dict[str, Any] = {"detail": detail}
    if path.startswith("/v2"):
        body["error"] = detail
    elif path.startswith("/v1/"):
        kind = _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        body["error"] = {"message": detail, "type": kind, "code": status}
    return JSONResponse(body, status_code=status, headers=headers)


def body_too_large(limit: int, path: str) -> JSONResponse:
    setting = "MAX_PREDICT_BODY_BYTES" if path.endswith(INFERENCE_SUFFIXES) else "MAX_BODY_BYTES"
    return error_response(path, 413, f"request body is over this route's limit of {limit} bytes (PATCHSERVE_{setting})")


class BodyLimits:
    """Request body limits. A Content-Length over the limit is answered at once, unread; a body without one
    (chunked) is counted as it is read (Starlette's ``RequestBodyLimitMiddleware``), so it is bounded too. Predict
    bodies (predict, infer, embed) get their own, smaller limit: they are parsed on the event loop, and this bounds
    how long one can hold up every other request."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_predict_bytes: int) -> None:
        self.limits = {False: max_bytes, True: max_predict_bytes}
        self.counted = {p: RequestBodyLimitMiddleware(app, max_body_size=n) for p, n in self.limits.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        predict = scope["type"] == "http" and scope["path"].endswith(INFERENCE_SUFFIXES)
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.limits[predict]:
                await body_too_large(self.limits[predict], scope["path"])(scope, receive, send)
                return
        await self.counted[predict](scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    table: list[tuple[type[Exception], int]] = [
        (TaskNotFoundError, 404),
        (JobNotFoundError, 404),
        (JobStateError, 409),
        (JobError, 422),  # an invalid job config, gate or data file name, or a job over the deployment's limits
        (DataError, 422),
        (VersionNotFoundError, 404),
        (InvalidTaskNameError, 422),
        (InputError, 422),
        (PatchError, 409),  # a registered patch that does not fit this server's encoder
        (RegistryUnavailableError, 503),
    ]
    for exc_type, status in table:

        def handler(request: Request, exc: Exception, status: int = status) -> JSONResponse:
            return error_response(request.url.path, status, str(exc))

        app.add_exception_handler(exc_type, handler)

    def overloaded(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request.url.path, 503, str(exc), {"Retry-After": "1"})

    def client_gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody receives it, metrics count it

    def invalid_request(request: Request, exc: Exception) -> JSONResponse:
        # one shape for every error; FastAPI's default list echoes the input, which fails to render (a 500) when
        # it holds NaN or a lone surrogate
        assert isinstance(exc, RequestValidationError)
        return error_response(request.url.path, 422, describe_validation_errors(exc.errors()))

    def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        limit = request.scope.get(MAX_BODY_SIZE_SCOPE_KEY)
        if exc.status_code == 413 and limit is not None:  # a chunked body ran over while BodyLimits counted it
            return body_too_large(limit, request.url.path)
        return error_response(request.url.path, exc.status_code, str(exc.detail), exc.headers)

    app.add_exception_handler(OverloadedError, overloaded)
    app.add_exception_handler(ClientGoneError, client_gone)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)


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
            engine=settings.engine,
            drop_key_bias=settings.drop_key_bias,
            fold_value_bias=settings.fold_value_bias,
            fold_ln_bias=settings.fold_ln_bias,
            cuda_graphs=settings.cuda_graphs,
            overlap_batches=settings.overlap_batches,
            max_rows=settings.max_batch_rows,
            max_tokens=settings.max_batch_tokens,
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
        if settings.preload:
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(runner.preload, catalog.recent_patches())
            log.info("preloaded %d of %d tasks in %.1f s", loaded, len(catalog.current), time.perf_counter() - t0)
        batcher.start()
        queue_url = settings.queue or (settings.registry if settings.registry.startswith("redis") else None)
        queue = JobQueue(queue_url) if queue_url else None
        app.state.service = Service(settings, enc, reg, runner, batcher, catalog, metrics, queue)
        # Everything built so far (torch, transformers, the app, the encoder) lives as long as the process. A full
        # collection would walk its ~400k objects (~190 ms on 2 CPU cores) and stall every request meanwhile: the
        # p99 outliers of bench/swap.py and bench/memory.py. Frozen, collections only walk what serving allocates.
        gc.collect()
        gc.freeze()
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
            gc.unfreeze()  # what start-up froze is collectable again (an app in a longer-lived process: tests)

    app = FastAPIOffline(  # /docs and /redoc with their assets served by the app (no CDN): they work offline
        title="patchserve",
        version=__version__,
        description="Multi-task inference for BitFit bias patches on one frozen shared encoder. Requests of "
        "different tasks share one forward pass; each row gets its own task's biases.",
        lifespan=lifespan,
    )
    app.state.service = None
    app.include_router(router)
    app.include_router(jobs_router)
    app.include_router(oip_router)
    add_schemas(app, openapi_components())
    app.include_router(embeddings_router)
    app.include_router(ui.router)
    app.mount("/ui/static", ui.static, name="ui-static")
    _install_error_handlers(app)
    app.add_middleware(RequestMetrics)
    app.add_middleware(BodyLimits, max_bytes=settings.max_body_bytes, max_predict_bytes=settings.max_predict_body_bytes)
    return app


def app_factory() -> Any:
    """For ``uvicorn --factory server.app:app_factory``: settings from PATCHSERVE_* env vars."""
    return create_app(ServerSettings())
