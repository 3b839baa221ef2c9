"""One request's way through the engine, shared by every route that runs the encoder (predict, the Open Inference
Protocol's infer, embeddings): check the inputs against the limits, tokenise (small requests inline, large ones off
the event loop), hand the rows to the engine (in this process or the engine process), and wait for them -- up to
the request timeout, and only while the client is still there.

Which task a request ran for is left on ``request.state.task`` for ``patchserve.server.middleware.RequestGuard``:
routes that depend on ``InferenceService`` are counted, under ``_unknown`` until their task resolved (so the label
set stays bounded).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from patchserve.patches.format import Patch
from patchserve.server.deps import Credentials, Service, check_predict, get_service
from patchserve.server.engine.protocol import EngineUnavailableError
from patchserve.server.predict import Encoded, InputError, encode

UNKNOWN_TASK = "_unknown"
BASE_TASK = "_base"  # the label of requests for the base encoder's embeddings
# Requests with at most this many characters of text are tokenised on the event loop, which holds it briefly and
# saves a thread hop; longer ones go to the thread pool, so that one large request cannot hold up the others (where
# the line falls: docs/benchmarks/front_end.md).
INLINE_TOKENIZE_CHARS = 2048


class ClientGoneError(Exception):
    """The client disconnected before its answer was ready (answered 499, which nobody receives)."""


async def _inference_service(request: Request, credentials: Credentials) -> Service:
    """The service, for a route that runs the encoder: 503 while the server starts, the predict token's check
    (401/403), then the request is counted. One dependency for all three: FastAPI's resolving costs a front end
    per dependency, on every request (docs/experiments.md)."""
    svc = await get_service(request)
    check_predict(credentials, svc)
    request.state.task = UNKNOWN_TASK
    return svc


InferenceService = Annotated[Service, Depends(_inference_service)]


def name_task(request: Request, task: str) -> None:
    """The request's task resolved: count it under its name."""
    request.state.task = task


async def run_rows(
    svc: Service,
    request: Request,
    patch: Patch | None,
    texts: list[str],
    pairs: list[str] | None,
    output: str = "logits",
) -> tuple[list[Encoded], list[np.ndarray]]:
    """Encode ``texts`` (and ``pairs``) for ``patch`` (None: the base encoder) and run them; one output per input."""
    s = svc.settings
    if len(texts) > s.max_inputs_per_request:
        raise InputError(
            f"{len(texts)} inputs in one request; the limit is {s.max_inputs_per_request} "
            "(PATCHSERVE_MAX_INPUTS_PER_REQUEST) -- split the request"
        )
    problem = svc.engine.problem()
    if problem is not None:
        raise EngineUnavailableError(problem)
    task_limit = s.max_seq_length if patch is None else patch.meta.max_seq_length
    max_len = min(task_limit, s.max_seq_length, svc.encoder.max_positions)
    work = (svc.encoder.tokenizer, patch, texts, pairs, max_len, s.max_input_chars, output)
    if sum(map(len, texts)) + (0 if pairs is None else sum(map(len, pairs))) <= INLINE_TOKENIZE_CHARS:
        encoded = encode(*work)
    else:
        encoded = await run_in_threadpool(encode, *work)
    run = asyncio.ensure_future(svc.engine.run([e.row for e in encoded]))
    return encoded, await _wait(run, request, s.request_timeout_s)


async def _wait(run: asyncio.Future[list[np.ndarray]], request: Request, timeout: float) -> list[np.ndarray]:
    """Wait for a run; give up on timeout (504) or when the client hangs up (its rows are dropped)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HTTPException(
                    504, f"the request took longer than {timeout:g}s; retry, or raise PATCHSERVE_REQUEST_TIMEOUT_S"
                )
            done, _ = await asyncio.wait({run}, timeout=min(0.25, remaining))
            if done:
                return run.result()
            if await request.is_disconnected():
                raise ClientGoneError
    finally:
        if not run.done():
            run.cancel()  # the engine drops the rows before they reach the device
