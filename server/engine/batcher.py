"""The batcher: one asyncio actor owns the queue and turns rows of any tasks into batches for the runner.

Lifecycle: ``submit(block)`` (a ``RowBlock``: one request in this process, or everything a front end sent in one
message) -> a ``Job`` in the queue -> the actor cuts batches off the queue's head in arrival order (bounded by max
rows, max tokens -- real ones on the packed engine, padded ones on the slotted engine --, and max distinct patches; a
job's rows may span batches, a batch may span jobs) -> launches each on the runner (on its single worker thread, or
inline in the engine process) -> the job's future resolves with all its rows' outputs once its last batch has
finished. An idle device starts on whatever is queued at once: rows that arrive while a batch runs form the next one
(continuous batching), so a lone request never waits for company. With ``overlap_batches`` the next batch is launched
while the device still runs the previous one; until the device is free (and at most max wait) it takes in more rows.
Rows whose request was cancelled (client gone, timeout) are dropped before they reach the device. All of it works on
arrays: Python work grows with jobs and batches, not with rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from patchserve.server.engine.backend import Pending
from patchserve.server.engine.rows import RowBlock, RowOutputs
from patchserve.server.engine.runner import Runner
from patchserve.server.engine.slots import SlotsExhaustedError

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
READY_POLL_S = 0.00025  # how often a batch waiting behind a running one asks whether the device is free
# Inline (the engine process on a CPU), while a full batch is still queued: batches run back to back, and the loop is
# let in (messages, cancellations, signals) once this long has passed since it last was. Rows that arrive meanwhile
# could not have run sooner (batches take the oldest rows first), and taking in several messages at once keeps the
# host's caches warm for the forward (bench/engine_process.py; docs/experiments.md).
INLINE_TURN_S = 0.05


class OverloadedError(RuntimeError):
    """The queue is full; the client should retry later (HTTP 503 + Retry-After)."""


class Job:
    """One submission's rows (a front end's message, or one request in this process) on their way through the
    batcher. ``future`` resolves to their ``RowOutputs`` (a dropped row's size is 0; rows already ``collect``-ed are
    not in it); cancelling it drops every row that has not reached the device yet, ``drop`` only some. After each
    batch that held some of its rows, ``on_progress`` (if set) is called: rows ``[0, done)`` then have outputs; once
    every job of the batch was, the batcher's ``on_answered``."""

    def __init__(self, block: RowBlock, future: asyncio.Future[RowOutputs]) -> None:
        self.block = block
        self.future = future
        self.live = np.ones(len(block), dtype=bool)
        self.next = 0  # rows before it have been taken into batches (or skipped, dropped)
        self.running = 0  # launched batches that hold some of its rows
        self.done = 0  # rows before it have their outputs (or were dropped)
        self.sizes = np.zeros(len(block), dtype=np.int64)
        self.on_progress: Callable[[Job], None] | None = None
        self._collected = 0  # rows before it were handed out by collect()
        self._chunks: list[np.ndarray] = []  # outputs of rows [_collected, done), batch by batch (in row order)

    def drop(self, rows: slice) -> None:
        """Rows that must not run (their request was cancelled); those already launched still finish."""
        self.live[rows] = False

    def collect(self, upto: int) -> RowOutputs:
        """The outputs of the rows from the last ``collect`` up to row ``upto`` (at most ``done``), handed out once."""
        a = self._collected
        sizes = self.sizes[a:upto]
        if not self._chunks:  # nothing was computed since (dropped rows, or all handed out already)
            self._collected = upto
            return RowOutputs(np.zeros(0, dtype=np.float32), sizes)
        data = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        n = int(sizes.sum())
        self._chunks = [data[n:]] if n < len(data) else []
        self._collected = upto
        return RowOutputs(data[:n], sizes)

    def _add(self, take: np.ndarray, sizes: np.ndarray, data: np.ndarray) -> None:
        """A batch finished: the outputs of its rows ``take`` of this job."""
        self.running -= 1
        self.sizes[take] = sizes
        self._chunks.append(data)
        self.done = self.next if self.running == 0 else int(take[-1]) + 1


Part = tuple[Job, np.ndarray]  # a job and the rows of it (increasing indices) that a batch takes


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
        self.on_answered: Callable[[], None] | None = None  # after a batch's jobs were told of their progress
        self._queue: deque[Job] = deque()
        self._queued = 0  # rows of the queued jobs not yet taken
        self._wakeup = asyncio.Event()
        self._executor = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="patchserve-runner")
        self._task: asyncio.Task[None] | None = None
        self._turn_start = 0.0  # inline: when the loop was last let in

    @property
    def queued_rows(self) -> int:
        return self._queued

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="patchserve-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(OverloadedError("server is shutting down"))
        self._queue.clear()
        self._queued = 0
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def submit(self, block: RowBlock) -> Job:
        """Enqueue the rows of ``block``; their outputs arrive on the job's future. Raises OverloadedError when the
        queue has no room for all of them."""
        if self._queued + len(block) > self.max_queue_rows:
            raise OverloadedError(f"{self._queued} rows are queued (limit {self.max_queue_rows}); retry shortly")
        job = Job(block, asyncio.get_running_loop().create_future())
        if len(block) == 0:
            job.future.set_result(RowOutputs(np.zeros(0, dtype=np.float32), job.sizes))
            return job
        self._queue.append(job)
        self._queued += len(block)
        self._wakeup.set()
        return job

    def wake(self) -> None:
        """Look at the queue again (rows were dropped: a job with nothing left to run is answered)."""
        self._wakeup.set()

    # --- the actor ---------------------------------------------------------------------------------------------
    def _advance(self, job: Job, to: int) -> None:
        self._queued -= to - job.next
        job.next = to

    def _settle(self, job: Job) -> None:
        """Answer a job once every row of it was taken (or dropped) and its batches have finished."""
        if job.next == len(job.block) and job.running == 0 and not job.future.done():
            job.done = job.next
            job.future.set_result(job.collect(len(job.block)))

    def _fit(self, block: RowBlock, idx: np.ndarray, rows: int, tokens: int, longest: int, patches: set[str]) -> int:
        """How many of the rows ``idx`` of ``block`` the batch (so far ``rows`` rows, ``tokens`` tokens against
        the budget, its longest row ``longest``, using ``patches``) takes: its real tokens on the packed engine (no
        padding), its padded ones on the slotted engine, and no more distinct patches than slots. An empty batch
        always takes its first row, whatever it costs."""
        lens = block.lengths[idx]
        if self.runner.padding_free:
            cost = tokens + np.cumsum(lens)
        else:
            cost = (rows + np.arange(1, len(idx) + 1)) * np.maximum(longest, np.maximum.accumulate(lens))
        k = int(np.searchsorted(cost, self.max_tokens, side="right"))
        if self.max_patches >= self.max_rows:  # a batch cannot name more patches than there are slots
            return max(k, 1) if rows == 0 else k
        keys = block.keys[idx[:k]]
        firsts = [
            (int(at), block.patches[int(key)].patch_id)
            for key, at in zip(*np.unique(keys, return_index=True), strict=True)
            if key >= 0 and block.patches[int(key)].patch_id not in patches
        ]
        free = self.max_patches - len(patches)
        if len(firsts) > free:
            k = sorted(firsts)[free][0]
        return max(k, 1) if rows == 0 else k

    def _select(self) -> list[Part]:
        """The next batch: rows in the order they came (the oldest live row anchors every batch, nothing starves),
        up to the bounds; rows of cancelled requests are skipped as the selection meets them. Costs array
        operations per job it touches, not Python per row."""
        parts: list[Part] = []
        rows = tokens = longest = 0
        patches: set[str] = set()
        queue = self._queue
        while queue and rows < self.max_rows:
            job = queue[0]
            n = len(job.block)
            if job.future.done():  # cancelled (or failed): nothing more of it runs
                self._advance(job, n)
                queue.popleft()
                continue
            end = min(n, job.next + self.max_rows - rows)
            idx = np.flatnonzero(job.live[job.next : end]) + job.next
            k = self._fit(job.block, idx, rows, tokens, longest, patches) if len(idx) else 0
            if k:
                take = idx[:k]
                lens = job.block.lengths[take]
                rows, tokens, longest = rows + k, tokens + int(lens.sum()), max(longest, int(lens.max()))
                if self.max_patches < self.max_rows:  # else the slots cannot run out (see _fit)
                    keys = np.unique(job.block.keys[take])
                    patches.update(job.block.patches[int(i)].patch_id for i in keys if i >= 0)
                parts.append((job, take))
                job.running += 1
            self._advance(job, end if k == len(idx) else int(idx[k]))
            if job.next == n:
                queue.popleft()
                self._settle(job)  # all of it dropped, or what is left runs in this batch
            if k < len(idx):
                break  # the batch is full
        return parts

    def _unselect(self, parts: list[Part]) -> None:
        """Put a batch that could not be launched back at the head of the queue, as it was."""
        for job, take in reversed(parts):
            job.running -= 1
            if not self._queue or self._queue[0] is not job:
                self._queue.appendleft(job)
            self._advance(job, int(take[0]))

    async def _wait(self, timeout: float | None) -> None:
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout)

    async def _collect(self) -> list[Part]:
        """The device is idle: wait for a row, then take what is queued at once (no waiting for company: rows that
        arrive while this batch runs join the next one)."""
        while True:
            while not self._queue:
                await self._wait(None)
            batch = self._select()
            if batch:
                return batch

    async def _collect_behind(self, running: Pending) -> list[Part]:
        """A batch is still running on the device: the next one takes in more rows while it runs, since it cannot
        start before the device is free anyway -- until the device is free, the batch is full or max_wait has
        passed. Empty when nothing is queued."""
        if not self._queue:
            return []
        deadline = time.perf_counter() + self.max_wait
        while self._queued < self.max_rows and not running.ready():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            await self._wait(min(remaining, READY_POLL_S))  # new rows wake it; the device's end is polled
        return self._select()

    async def _loop(self) -> None:
        """Launch a batch; while the device runs it, launch the next one if rows are already waiting (its host work
        overlaps the device's); then finish the older one. At most two batches are in flight."""
        inflight: deque[tuple[list[Part], Pending, float]] = deque()
        while True:
            batch = await self._collect() if not inflight else await self._collect_behind(inflight[-1][1])
            if batch:
                t0 = time.perf_counter()
                block = RowBlock.concat([job.block.take(take) for job, take in batch])
                try:
                    pending = await self._call(self.runner.launch, block)
                except SlotsExhaustedError as exc:
                    if inflight:  # its slots are pinned by the batch in flight: finish that one, then retry
                        self._unselect(batch)
                    else:
                        self._fail(batch, exc)
                        continue
                except Exception as exc:  # a failed batch fails its requests, never the actor
                    log.exception("batch of %d rows failed", len(block))
                    self._fail(batch, exc)
                    continue
                else:
                    inflight.append((batch, pending, t0))
                    if len(inflight) < 2 and self.runner.asynchronous:
                        continue
            if inflight:
                await self._finish(*inflight.popleft())
                await self._let_in()

    async def _call(self, fn: Callable[[T], R], arg: T) -> R:
        if self._executor is None:
            return fn(arg)  # the loop is let in once the batch is answered (_let_in)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)

    async def _let_in(self) -> None:
        """Inline, after a batch was answered: let the loop take in what arrived meanwhile -- at once when less than
        a full batch is left queued, else once INLINE_TURN_S has passed since it was last let in."""
        if self._executor is not None:
            return  # the runner's thread was awaited: the loop was free all along
        if self._queued < self.max_rows or time.perf_counter() - self._turn_start >= INLINE_TURN_S:
            await asyncio.sleep(0)
            self._turn_start = time.perf_counter()

    def _fail(self, batch: list[Part], exc: BaseException) -> None:
        for job, _ in batch:
            job.running -= 1
            if not job.future.done():
                job.future.set_exception(exc)

    async def _finish(self, batch: list[Part], pending: Pending, t0: float) -> None:
        block = pending.block
        try:
            outputs = await self._call(self.runner.finish, pending)
        except Exception as exc:
            log.exception("batch of %d rows failed", sum(len(take) for _, take in batch))
            self._fail(batch, exc)
            return
        offsets = outputs.offsets
        at = 0
        for job, take in batch:
            b = at + len(take)
            job._add(take, outputs.sizes[at:b], outputs.data[offsets[at] : offsets[b]])
            at = b
            if job.on_progress is not None and not job.future.done():
                job.on_progress(job)
            self._settle(job)
        if self.on_answered is not None:
            self.on_answered()
        if self.on_batch is not None and block is not None:
            lengths = block.lengths
            self.on_batch(
                BatchStats(
                    rows=len(block),
                    tasks=len(block.patches) + int(bool((block.keys < 0).any())),
                    tokens=block.n_tokens if self.runner.padding_free else len(block) * int(lengths.max()),
                    seconds=time.perf_counter() - t0,
                )
            )
