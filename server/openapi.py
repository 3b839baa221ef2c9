"""What the OpenAPI document says beyond the code: path parameters with descriptions and examples, the exact
error answers of each route, and schemas of bodies a route reads itself."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Path

from patchserve.patches.api import ErrorBody

TaskName = Annotated[
    str,
    Path(
        description="A task name: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit.",
        examples=["sentiment"],
    ),
]
JobId = Annotated[
    str, Path(pattern="^[0-9a-f]{32}$", description="A job id (32 hex characters), as POST /jobs returned it.")
]

_MEANING = {
    401: "No bearer token, and this route needs one (Authorize with the admin or predict token).",
    403: "The bearer token is not one this route accepts.",
    404: "No such task, version or job (the message says how to list them).",
    409: "A stored patch does not fit this server's encoder, or the job has already ended.",
    413: "The body is over this route's limit (the message names the setting).",
    422: "Invalid input: the message names each field and its problem.",
    501: "This server has no job queue (start it with PATCHSERVE_QUEUE or a Redis registry).",
    503: "The server is overloaded, starting, or cannot reach its registry or job queue (with Retry-After).",
    504: "The request took longer than the request timeout.",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, each ``{"detail": "..."}`` (``ErrorBody``), for its ``responses=``."""
    return {code: {"model": ErrorBody, "description": _MEANING[code]} for code in codes}


def add_schemas(app: FastAPI, schemas: dict[str, Any]) -> None:
    """Add ``schemas`` to the OpenAPI document's components (for routes that read their bodies themselves)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generate()["components"]["schemas"].update(schemas)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
