"""The server's one ASGI middleware: request body limits and the inference routes' request metrics, in one layer
(each layer is a coroutine call and a closure per request on the front end's hot path).

Body limits: a Content-Length over the route's limit is answered 413 at once, unread; a body without one (chunked)
is counted as it is read, and a 413 is raised as soon as it runs over. Inference bodies (predict, infer, embed) get
their own, smaller limit: they are parsed on the event loop, and this bounds how long one can hold up every other
request (probes included).

Metrics: every request of a route that depends on ``patchserve.server.inference.InferenceService`` is counted by
task and the status that went out, whichever handler produced it, and the successful ones are timed. The route names
its task once it resolved (``request.state.task``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class RequestGuard:
    def __init__(self, app: ASGIApp, max_bytes: int, max_predict_bytes: int) -> None:
        self.app = app
        self.limits = {False: max_bytes, True: max_predict_bytes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        limit = self.limits[path.endswith(INFERENCE_SUFFIXES)]
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            await body_too_large(limit, path)(scope, receive, send)
            return
        scope[MAX_BODY_SIZE_SCOPE_KEY] = limit  # the 413 handler names the limit (server.app)
        if length is None:  # chunked: count it as it is read (with a length, the HTTP server reads only that much)
            receive = _counted(receive, limit)
        status, t0 = 500, time.perf_counter()
        state = scope.setdefault("state", {})  # request.state: shared even where a layer copies the scope

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            task = state.get("task")
            svc = getattr(scope["app"].state, "service", None)
            if task is not None and svc is not None:
                svc.metrics.observe_request(task, status, time.perf_counter() - t0)


def _counted(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413)
        return message

    return counted
