"""``create_app(settings)``: the FastAPI app. Nothing heavy happens at import; the lifespan handler loads the
encoder and starts the engine in this process (or connects to the engine process, as a front end of
``patchserve serve --workers N``), opens the registry and starts the registry watcher.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

from patchserve import __version__
from patchserve.patches.data import DataError
from patchserve.patches.encoder import Encoder, load_encoder, load_tokenizer
from patchserve.patches.errors import (
    InvalidTaskNameError,
    PatchError,
    RegistryUnavailableError,
    TaskNotFoundError,
    VersionNotFoundError,
    describe_validation_errors,
)
from patchserve.patches.jobs import JobError, JobNotFoundError, JobQueue, JobStateError
from patchserve.patches.store import Registry, open_registry
from patchserve.server import ui
from patchserve.server.catalog import Catalog
from patchserve.server.deps import EncoderInfo, Service
from patchserve.server.embeddings import router as embeddings_router
from patchserve.server.engine.batcher import OverloadedError
from patchserve.server.engine.local import LocalEngine
from patchserve.server.engine.patch_cache import PatchCache
from patchserve.server.engine.protocol import EngineError, EngineUnavailableError
from patchserve.server.engine.remote import RemoteEngine
from patchserve.server.inference import ClientGoneError
from patchserve.server.metrics import Metrics
from patchserve.server.middleware import RequestGuard, body_too_large, error_response
from patchserve.server.oip import openapi_components
from patchserve.server.oip import router as oip_router
from patchserve.server.openapi import add_schemas
from patchserve.server.predict import InputError, serial_tokenizers
from patchserve.server.routes import router
from patchserve.server.routes_jobs import router as jobs_router
from patchserve.server.settings import ServerSettings

log = logging.getLogger("patchserve")

ENGINE_ADDRESS_ENV = "_PATCHSERVE_ENGINE"  # set by the supervisor for its front ends (server/supervisor.py)
SETTINGS_ENV = "_PATCHSERVE_SETTINGS"
SUPERVISOR_PID_ENV = "_PATCHSERVE_SUPERVISOR_PID"
ENGINE_CONNECT_TIMEOUT_S = 600.0  # a front end started while the engine (re)loads a large model waits this long


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
    ]
    for exc_type, status in table:

        def handler(request: Request, exc: Exception, status: int = status) -> JSONResponse:
            return error_response(request.url.path, status, str(exc))

        app.add_exception_handler(exc_type, handler)

    def retry_later(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request.url.path, 503, str(exc), {"Retry-After": "1"})

    def engine_failed(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return error_response(request.url.path, exc.status, str(exc))

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
        if exc.status_code == 413 and limit is not None:  # a chunked body ran over while RequestGuard counted it
            return body_too_large(limit, request.url.path)
        return error_response(request.url.path, exc.status_code, str(exc.detail), exc.headers)

    app.add_exception_handler(OverloadedError, retry_later)
    app.add_exception_handler(EngineUnavailableError, retry_later)
    app.add_exception_handler(RegistryUnavailableError, retry_later)  # Redis down or failing over: writes wait
    app.add_exception_handler(EngineError, engine_failed)
    app.add_exception_handler(ClientGoneError, client_gone)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)


async def _local_engine(
    settings: ServerSettings, encoder: Encoder | None, metrics: Metrics
) -> tuple[EncoderInfo, LocalEngine]:
    """The engine in this process (``--workers 0``): load the encoder, move it to the device."""
    enc = encoder if encoder is not None else await asyncio.to_thread(load_encoder, settings.model)
    info = EncoderInfo.of(enc)  # its spec comes from the plain model, before the runner rewrites its modules
    engine = LocalEngine(enc, settings, metrics)
    runner = engine.runner
    return info.served_by(runner.path, str(runner.dtype).removeprefix("torch.")), engine


async def _remote_engine(address: str) -> tuple[EncoderInfo, RemoteEngine]:
    """The engine process at ``address`` (a front end of ``--workers N``): who it is, and its tokenizer."""
    engine = RemoteEngine(address)
    info = await engine.connect(timeout=ENGINE_CONNECT_TIMEOUT_S)
    tokenizer = await asyncio.to_thread(load_tokenizer, info.source)
    return EncoderInfo.from_engine(info, tokenizer), engine


async def _stop_when_orphaned() -> None:
    """A front end whose supervisor was killed stops itself (gracefully, as on SIGTERM): no one else would. The
    supervisor's pid comes from its environment: one that died while this front end was starting is seen too."""
    parent = int(os.environ.get(SUPERVISOR_PID_ENV, os.getppid()))
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.error("the supervisor (pid %d) is gone; stopping this front end", parent)
    os.kill(os.getpid(), signal.SIGTERM)


def create_app(
    settings: ServerSettings | None = None,
    *,
    encoder: Encoder | None = None,
    registry: Registry | None = None,
    engine_address: str | None = None,
) -> FastAPI:
    """Build the app. Tests pass their own settings (and may pass a loaded encoder or an open registry).

    Without ``engine_address`` the app runs the engine itself; with one it is a front end of the engine process
    listening there (``patchserve serve --workers N`` starts both). A passed encoder is owned by the app from then
    on: the runner moves it to the device and rewrites its biased modules in place.
    """
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _service(settings, encoder, registry, engine_address) as service:
            app.state.service = service
            try:
                yield
            finally:
                app.state.service = None

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
    app.add_middleware(
        RequestGuard, max_bytes=settings.max_body_bytes, max_predict_bytes=settings.max_predict_body_bytes
    )
    return app


@asynccontextmanager
async def _service(
    settings: ServerSettings, encoder: Encoder | None, registry: Registry | None, engine_address: str | None
) -> AsyncIterator[Service]:
    """Everything a running app serves with -- the engine (its own, or the engine process at ``engine_address``),
    the registry and its catalog, the job queue, the metrics -- built at start-up and torn down at shutdown."""
    metrics = Metrics(settings.metrics_task_labels)
    engine: LocalEngine | RemoteEngine
    if engine_address is None:
        info, engine = await _local_engine(settings, encoder, metrics)
    else:
        info, engine = await _remote_engine(engine_address)
    reg = registry or open_registry(settings.registry, min_replicas=settings.redis_min_replicas)
    if settings.keep_versions is not None:  # retention after each registration through this server
        reg.keep_versions = settings.keep_versions
    reg.max_patch_bytes = settings.max_patch_bytes
    cache = PatchCache(settings.host_cache_mb * 1024 * 1024)
    metrics.add_host_cache(cache, "front_end")
    catalog = Catalog(
        reg,
        info.spec,
        cache,
        on_fetch=metrics.patch_load.labels(source="registry").observe,
        tensors=isinstance(engine, LocalEngine),  # the engine process parses what a front end sends it
    )
    await asyncio.to_thread(catalog.start)
    if isinstance(engine, LocalEngine):
        if settings.preload:  # the engine process preloads for itself
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(engine.preload, catalog.recent_patches())
            log.info("preloaded %d of %d tasks in %.1f s", loaded, len(catalog.current), time.perf_counter() - t0)
        engine.start()
    queue_url = settings.queue or (settings.registry if settings.registry.startswith("redis") else None)
    queue = JobQueue(queue_url, min_replicas=settings.redis_min_replicas) if queue_url else None
    # Everything built so far (torch, transformers, the app, the encoder) lives as long as the process. A full
    # collection would walk all of it and stall every request meanwhile (the p99 outliers of the swap and memory
    # benchmarks). Frozen, collections only walk what serving allocates.
    orphaned = None if engine_address is None else asyncio.ensure_future(_stop_when_orphaned())
    gc.collect()
    gc.freeze()
    described = info.describe(settings.max_seq_length)
    metrics.set_encoder(described | {"device": engine.device})
    log.info(
        "patchserve ready: %s (%s, %s) on %s in %s, %s engine, inputs up to %d tokens, serving %s; registry %s",
        info.name,
        described["family"],
        info.fingerprint[:19],
        engine.device,
        described["dtype"],
        described["engine"],
        described["max_seq_length"],
        ", ".join(described["patch_types"]) or "no patch type (the encoder has no bias, scale or LoRA site)",
        reg.url,
    )
    try:
        yield Service(settings, info, reg, engine, catalog, metrics, queue)
    finally:
        if orphaned is not None:
            orphaned.cancel()
        if isinstance(engine, LocalEngine):
            await engine.stop()
        else:
            await engine.close()
        await asyncio.to_thread(catalog.stop)
        if registry is None:
            reg.close()
        if queue is not None:
            queue.close()
        gc.unfreeze()  # what start-up froze is collectable again (an app in a longer-lived process: tests)


def app_factory() -> Any:
    """For ``uvicorn --factory server.app:app_factory``: settings from PATCHSERVE_* env vars, the engine in this
    process."""
    serial_tokenizers()
    return create_app(ServerSettings())


def front_end_factory() -> Any:
    """A front end of ``patchserve serve --workers N`` (its supervisor sets the settings and the engine's address)."""
    settings = ServerSettings.from_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(settings, engine_address=os.environ[ENGINE_ADDRESS_ENV])
