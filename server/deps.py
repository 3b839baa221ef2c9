"""FastAPI dependencies: the running service and the bearer-token checks, as ``Annotated`` aliases."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, Protocol

import numpy as np
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from patchserve.patches.encoder import Encoder
from patchserve.patches.format import BaseSpec
from patchserve.patches.jobs import JobQueue
from patchserve.patches.store import Registry
from patchserve.server.catalog import Catalog
from patchserve.server.engine.protocol import Info, Row
from patchserve.server.metrics import Metrics
from patchserve.server.settings import ServerSettings


class Engine(Protocol):
    """Where rows run: ``LocalEngine`` (this process) or ``RemoteEngine`` (the engine process)."""

    @property
    def device(self) -> str: ...

    def problem(self) -> str | None:
        """Why rows cannot run now (None: they can)."""

    async def run(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Each row's float32 output; cancelling the call drops the rows not yet run."""


@dataclass(frozen=True)
class EncoderInfo:
    """What the routes know of the base encoder: its identity and spec, its tokenizer and limits (not the model,
    which the engine holds)."""

    name: str
    fingerprint: str
    spec: BaseSpec
    tokenizer: Any
    max_positions: int
    default_pooling: str
    family: str = ""  # Encoder.family
    path: str = ""  # the engine that serves: 'packed' or 'slotted'
    dtype: str = ""

    @classmethod
    def of(cls, encoder: Encoder) -> EncoderInfo:
        return cls(
            encoder.name,
            encoder.fingerprint,
            encoder.spec,
            encoder.tokenizer,
            encoder.max_positions,
            encoder.default_pooling,
            encoder.family,
        )

    def served_by(self, path: str, dtype: str) -> EncoderInfo:
        """This encoder as an engine serves it: its path ('packed' or 'slotted') and compute dtype."""
        return replace(self, path=path, dtype=dtype)

    def describe(self, max_seq_length: int) -> dict[str, Any]:
        """What /readyz, /metrics and the start-up line say of it: family, engine path, dtype, the longest input in
        tokens (the setting, within the encoder's positions) and the patch types it serves."""
        return {
            "family": self.family,
            "engine": self.path,
            "dtype": self.dtype,
            "max_seq_length": min(max_seq_length, self.max_positions),
            "patch_types": self.spec.patch_types,
        }

    @classmethod
    def from_engine(cls, info: Info, tokenizer: Any) -> EncoderInfo:
        shapes = {name: tuple(shape) for name, shape in info.bias_shapes.items()}
        scales = {name: tuple(shape) for name, shape in info.scale_shapes.items()}
        lora = {name: (int(shape[0]), int(shape[1])) for name, shape in info.lora_shapes.items()}
        spec = BaseSpec(info.name, info.fingerprint, info.hidden_size, shapes, scales, lora)
        return cls(
            info.name,
            info.fingerprint,
            spec,
            tokenizer,
            info.max_positions,
            info.default_pooling,
            info.family,
            info.path,
            info.dtype,
        )


@dataclass
class Service:
    """Everything the routes use, built once by the lifespan handler."""

    settings: ServerSettings
    encoder: EncoderInfo
    registry: Registry
    engine: Engine
    catalog: Catalog
    metrics: Metrics
    queue: JobQueue | None = None


async def get_service(request: Request) -> Service:
    svc: Service | None = getattr(request.app.state, "service", None)
    if svc is None:
        raise HTTPException(503, "the server is still starting (loading the encoder); retry shortly")
    return svc


# Every dependency is ``async def``: FastAPI runs a plain ``def`` one in a worker thread, a hop that costs far more
# than these checks (they do no I/O).
ServiceDep = Annotated[Service, Depends(get_service)]


bearer = HTTPBearer(
    auto_error=False,
    description="PATCHSERVE_ADMIN_TOKEN for registering, deleting, rolling back and jobs; PATCHSERVE_PREDICT_TOKEN "
    "(or the admin token) for predict, infer and embeddings. Reads of tasks and jobs take either. A route needs no "
    "token when the server has none set.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _matches(given: str, *tokens: object) -> bool:
    ok = False
    for t in tokens:
        if t is not None:  # compare against every configured token: time does not reveal which matched
            ok |= hmac.compare_digest(given.encode(), t.get_secret_value().encode())  # type: ignore[attr-defined]
    return ok


def _require(
    credentials: HTTPAuthorizationCredentials | None, accepted: tuple[object, ...], what: str, forbidden: str
) -> None:
    """401 without a bearer token, 403 when it matches none of ``accepted``; no check when none is set."""
    if all(t is None for t in accepted):
        return
    if credentials is None or not credentials.credentials.strip():
        raise HTTPException(
            401, f"this route needs 'Authorization: Bearer <{what}>'", headers={"WWW-Authenticate": "Bearer"}
        )
    if not _matches(credentials.credentials.strip(), *accepted):
        raise HTTPException(403, forbidden)


async def require_admin(credentials: Credentials, svc: ServiceDep) -> None:
    _require(
        credentials,
        (svc.settings.admin_token,),
        "admin token",
        "the bearer token is not the admin token; registering, deleting, rolling back and jobs need "
        "PATCHSERVE_ADMIN_TOKEN",
    )


async def require_predict(credentials: Credentials, svc: ServiceDep) -> None:
    check_predict(credentials, svc)


def check_predict(credentials: HTTPAuthorizationCredentials | None, svc: Service) -> None:
    """With a predict token set, predict needs it (or the admin token); with only an admin token, predict is open."""
    if svc.settings.predict_token is None:
        return
    _require(
        credentials,
        (svc.settings.predict_token, svc.settings.admin_token),
        "predict token",
        "the bearer token is neither the predict token nor the admin token",
    )


async def require_reader(credentials: Credentials, svc: ServiceDep) -> None:
    """Reads of tasks and jobs (metadata, configs, errors, tracebacks) need the predict or the admin token whenever
    either is set; probes and metrics stay open."""
    _require(
        credentials,
        (svc.settings.predict_token, svc.settings.admin_token),
        "predict or admin token",
        "the bearer token is neither the predict token nor the admin token",
    )


AdminAuth = Annotated[None, Depends(require_admin)]
PredictAuth = Annotated[None, Depends(require_predict)]
ReadAuth = Annotated[None, Depends(require_reader)]
