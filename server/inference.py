"""One request's way through the engine, shared by every route that runs the encoder (predict, the Open Inference
Protocol's infer, embeddings): check the inputs against the limits, tokenise off the event loop, queue the rows
for the batcher, and wait for them -- up to the request timeout, and only while the client is still there.

Which task a request ran for is left on ``request.state.task`` for ``server.metrics.RequestMetrics``: routes that
depend on ``Counted`` are counted, under ``_unknown`` until their task resolved (so the label set stays bounded).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import torch
from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from patches.format import Patch
from server.deps import Service
from server.predict import Encoded, InputError, encode

UNKNOWN_TASK = "_unknown"
BASE_TASK = "_base"  # the label of requests for the base encoder's embeddings


class ClientGoneError(Exception):
    """The client disconnected before its answer was ready (answered 499, which nobody receives)."""


def _count(request: Request) -> None:
    request.state.task = UNKNOWN_TASK


Counted = Annotated[None, Depends(_count)]


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
) -> tuple[list[Encoded], list[torch.Tensor]]:
    """Encode ``texts`` (and ``pairs``) for ``patch`` (None: the base encoder) and run them; one output per input."""
    s = svc.settings
    if len(texts) > s.max_inputs_per_request:
        raise InputError(
            f"{len(texts)} inputs in one request; the limit is {s.max_inputs_per_request} "
            "(PATCHSERVE_MAX_INPUTS_PER_REQUEST) -- split the request"
        )
    task_limit = s.max_seq_length if patch is None else patch.meta.max_seq_length
    max_len = min(task_limit, s.max_seq_length, svc.encoder.max_positions)
    tokenizer = svc.encoder.tokenizer
    encoded = await run_in_threadpool(encode, tokenizer, patch, texts, pairs, max_len, s.max_input_chars, output)
    outputs = await _wait_rows(svc.batcher.submit([e.row for e in encoded]), request, s.request_timeout_s)
    return encoded, outputs


async def _wait_rows(futures: list[asyncio.Future[Any]], request: Request, timeout: float) -> list[Any]:
    """Wait for every row; give up on timeout (504) or when the client hangs up (its rows are dropped)."""
    gathered = asyncio.gather(*futures)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HTTPException(
                    504, f"the request took longer than {timeout:g}s; retry, or raise PATCHSERVE_REQUEST_TIMEOUT_S"
                )
            done, _ = await asyncio.wait({gathered}, timeout=min(0.25, remaining))
            if done:
                return list(gathered.result())
            if await request.is_disconnected():
                raise ClientGoneError
    finally:
        if not gathered.done():
            gathered.cancel()  # cancels the rows' futures: the batcher drops them before the device
