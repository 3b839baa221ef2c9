"""The batcher: one asyncio actor owns the queue and turns rows of any tasks into batches for the runner.

Request lifecycle: ``submit(rows)`` -> queue -> the actor collects a batch (bounded by max rows, max tokens -- real
ones on the packed engine, padded ones on the slotted engine --, and max distinct patches; rows of similar length
together, to cut padding on the slotted engine) -> launches it on the runner's single worker thread (the event
loop never blocks) -> resolves each row's future. An idle device starts on whatever is queued at once: rows that
arrive while a batch runs form the next one (continuous batching), so a lone request never waits for company.
With ``overlap_batches`` the next batch is launched while the device still runs the previous one, and it may wait
up to max wait for more rows first. Rows whose request was cancelled (client gone, timeout) are dropped before
they reach the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from patchserve.server.engine.backend import Pending
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import Runner
from patchserve.server.engine.slots import SlotsExhaustedError

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class OverloadedError(RuntimeError):
    """The queue is full; the client should retry later (HTTP 503 + Retry-After)."""


@dataclass
class _Item:
    row: Row
    future: asyncio.Future[torch.Tensor]
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """What the batcher reports per batch (the server turns these into metrics)."""

    rows: int
    tasks: int
    tokens: int
    seconds: float


class Batcher:
    def __init__(
        self,
        runner: Runner,
        *,
        max_rows: int = 32,
        max_tokens: int = 8192,
        max_wait_ms: float = 5.0,
        max_queue_rows: int = 1024,
        on_batch: Callable[[BatchStats], None] | None = None,
        inline: bool = False,
    ) -> None:
        """``inline``: run the runner on the event loop's own thread (a process that does nothing else, the engine
        process: no thread hand-off, no GIL contention between the loop and the forward; messages that arrive
        meanwhile wait in their socket). Otherwise on a worker thread, so the loop keeps answering HTTP."""
        self.runner = runner
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.max_patches = runner.slots.capacity
        self.on_batch = on_batch
        self._queue: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._executor = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="patchserve-runner")
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_rows(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="patchserve-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(OverloadedError("server is shutting down"))
        self._queue.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def submit(self, rows: Sequence[Row]) -> list[asyncio.Future[torch.Tensor]]:
        """Enqueue rows; returns one future per row. Raises OverloadedError when the queue is full."""
        if len(self._queue) + len(rows) > self.max_queue_rows:
            raise OverloadedError(f"{len(self._queue)} rows are queued (limit {self.max_queue_rows}); retry shortly")
        loop = asyncio.get_running_loop()
        items = [_Item(r, loop.create_future()) for r in rows]
        self._queue.extend(items)
        self._wakeup.set()
        return [i.future for i in items]

    # --- the actor ---------------------------------------------------------------------------------------------
    def _tokens(self, rows: Sequence[Row]) -> int:
        """What a batch costs against the token budget: its real tokens on the packed engine (no padding), its
        padded ones on the slotted engine."""
        if self.runner.padding_free:
            return sum(len(r.input_ids) for r in rows)
        return len(rows) * max(len(r.input_ids) for r in rows)

    def _select(self) -> list[_Item]:
        """The oldest live row anchors the batch (nothing starves); the others are chosen from a window of the
        oldest rows by closeness in length, which is what cuts padding.

        Costs O(window), whatever the queue's depth: the window is taken off the queue's head and what was not
        chosen goes back in front, in order (rebuilding the whole queue per batch cost a sizeable share of a GPU
        forward at thousands of queued rows). Rows of cancelled requests are dropped as the window meets them."""
        queue = self._queue
        window: list[_Item] = []
        limit = 4 * self.max_rows
        while queue and len(window) < limit:
            item = queue.popleft()
            if not item.future.done():
                window.append(item)
        if not window:
            return []
        anchor = window[0]
        size = len(anchor.row.input_ids)
        packed = self.runner.padding_free
        batch, patches = [anchor], {anchor.row.key}
        tokens, longest = size, size  # what _tokens() would say of the batch, kept as it grows (not O(batch²))
        for item in sorted(window[1:], key=lambda i: abs(len(i.row.input_ids) - size)):
            if len(batch) >= self.max_rows:
                break
            n = len(item.row.input_ids)
            key = item.row.key
            cost = tokens + n if packed else (len(batch) + 1) * max(longest, n)
            new_patch = item.row.patch is not None and key not in patches  # base rows take no slot
            if cost <= self.max_tokens and (not new_patch or len(patches) < self.max_patches):
                batch.append(item)
                patches.add(key)
                tokens, longest = tokens + n, max(longest, n)
        if len(batch) < len(window):  # the rest back in front, in their order
            chosen = {id(i) for i in batch}
            queue.extendleft(reversed([i for i in window if id(i) not in chosen]))
        return batch

    async def _wait(self, timeout: float | None) -> None:
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout)

    async def _collect(self) -> list[_Item]:
        """The device is idle: wait for a row, then take what is queued at once (no waiting for company: rows that
        arrive while this batch runs join the next one)."""
        while True:
            while not self._queue:
                await self._wait(None)
            batch = self._select()
            if batch:
                return batch

    async def _collect_behind(self) -> list[_Item]:
        """A batch is still running on the device: the next one may wait up to max_wait for more rows, since it
        cannot start before the device is free anyway. Empty when nothing is queued."""
        if not self._queue:
            return []
        deadline = time.perf_counter() + self.max_wait
        while len(self._queue) < self.max_rows and (remaining := deadline - time.perf_counter()) > 0:
            await self._wait(remaining)
        return self._select()

    async def _loop(self) -> None:
        """Launch a batch; while the device runs it, launch the next one if rows are already waiting (its host work
        overlaps the device's); then finish the older one. At most two batches are in flight."""
        inflight: deque[tuple[list[_Item], Pending, float]] = deque()
        while True:
            batch = await self._collect() if not inflight else await self._collect_behind()
            if batch:
                t0 = time.perf_counter()
                try:
                    pending = await self._call(self.runner.launch, [i.row for i in batch])
                except SlotsExhaustedError as exc:
                    if inflight:  # its slots are pinned by the batch in flight: finish that one, then retry
                        self._queue.extendleft(reversed(batch))
                    else:
                        self._fail(batch, exc)
                        continue
                except Exception as exc:  # a failed batch fails its requests, never the actor
                    log.exception("batch of %d rows failed", len(batch))
                    self._fail(batch, exc)
                    continue
                else:
                    inflight.append((batch, pending, t0))
                    if len(inflight) < 2 and self.runner.asynchronous:
                        continue
            if inflight:
                await self._finish(*inflight.popleft())

    async def _call(self, fn: Callable[[T], R], arg: T) -> R:
        if self._executor is None:
            result = fn(arg)
            await asyncio.sleep(0)  # let the loop take in what arrived meanwhile
            return result
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)

    def _fail(self, batch: list[_Item], exc: BaseException) -> None:
        for item in batch:
            if not item.future.done():
                item.future.set_exception(exc)

    async def _finish(self, batch: list[_Item], pending: Pending, t0: float) -> None:
        rows = [i.row for i in batch]
        try:
            outputs = await self._call(self.runner.finish, pending)
        except Exception as exc:
            log.exception("batch of %d rows failed", len(rows))
            self._fail(batch, exc)
            return
        for item, out in zip(batch, outputs, strict=True):
            if not item.future.done():
                item.future.set_result(out)
        if self.on_batch is not None:
            self.on_batch(
                BatchStats(
                    rows=len(rows),
                    tasks=len({r.key for r in rows}),
                    tokens=self._tokens(rows),
                    seconds=time.perf_counter() - t0,
                )
            )
