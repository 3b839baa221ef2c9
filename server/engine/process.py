"""The engine process (``patchserve serve --workers N``): the one process that owns the device. It runs the runner
and the batcher (``LocalEngine``) and serves the front ends over ZeroMQ (``server/engine/protocol.py``): token rows
of any tasks come in as arrays, a message at a time, float32 outputs go back the same way, batched together whichever
front end sent them.

Patches arrive by id. The engine keeps the patches it was sent in a byte-bounded cache and answers ``Missing`` for
one it does not hold, so it never reads the registry to serve (a front end that resolved a task sends what it
resolved: hot swap keeps its semantics, and a task deleted meanwhile still finishes its in-flight requests). Only
``--preload`` reads the registry, once, at start-up.

It stops when its supervisor tells it to, through a pipe, once every front end has drained, after the requests it
holds are answered; it exits the same way when its supervisor is gone (the pipe's end closes). It ignores SIGINT and
SIGTERM: a Ctrl-C, ``kill -TERM -PGID`` or systemd's stop reaches the whole process group at once, and an engine that
stopped on it would fail the requests its front ends are still draining; the supervisor decides the order.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import gc
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from patchserve.patches.encoder import load_encoder, resolve_device
from patchserve.patches.errors import PatchError, PatchServeError
from patchserve.patches.format import BaseSpec, Patch
from patchserve.patches.patch_file import content_id
from patchserve.patches.store import open_registry
from patchserve.server.catalog import Catalog
from patchserve.server.engine.batcher import Job
from patchserve.server.engine.channel import Channel
from patchserve.server.engine.local import LocalEngine
from patchserve.server.engine.patch_cache import PatchCache
from patchserve.server.engine.protocol import (
    BASE_KEY,
    Answers,
    Cancel,
    Failed,
    Hello,
    Info,
    Missing,
    Requests,
    Results,
    encode,
    to_engine,
)
from patchserve.server.engine.rows import (
    RowBlock,
    RowOutputs,
    results_message,
    unpack_requests,
)
from patchserve.server.engine.slots import SlotsExhaustedError
from patchserve.server.metrics import Metrics
from patchserve.server.settings import ServerSettings

log = logging.getLogger("patchserve.engine")

STOP = b"stop"  # what the supervisor sends on the engine's stop pipe
STARTUP_FAILURE = 3  # the exit status of an engine that could not start: restarting it would fail the same way


class Startup(msgspec.Struct, frozen=True):
    """What the engine process tells its supervisor once, over a pipe: ready (with its ``Info``) or why not."""

    info: Info | None = None
    error: str | None = None


Ready = tuple[bytes, Requests, dict[str, Patch]]  # a front end's message whose patches are all at hand, and them


@dataclass
class _InFlight:
    """A ``Requests`` message the engine has taken: its requests' rows in the batcher (``job``, which may hold other
    messages' too; None while its patches are parsed) and where each request's rows start in it (``bounds`` from
    request ``base`` on, so one can be cancelled)."""

    future: asyncio.Future[Any]
    n_requests: int
    job: Job | None = None
    bounds: np.ndarray | None = None  # the job's request bounds (rows), shared by the messages it holds
    base: int = 0  # this message's first request among the job's
    dropped: list[int] = field(default_factory=list)  # requests cancelled while the patches were parsed
    answered: int = 0  # requests before it were answered
    refused: int = 0  # the message's last requests, not taken (the queue was full)

    def drop(self, i: int) -> None:
        """Drop request ``i``'s rows that have not run."""
        if self.job is None or self.bounds is None:
            self.dropped.append(i)
        else:
            j = self.base + i
            self.job.drop(slice(int(self.bounds[j]), int(self.bounds[j + 1])))


@dataclass
class _Group:
    """The messages one job holds, in request order, answered message by message as their requests finish."""

    members: list[tuple[bytes, int, _InFlight]]  # (front end, message id, its state)
    bounds: list[int]  # the job's request bounds (rows), as Python ints
    answered: int = 0  # the job's requests before it were answered
    cursor: int = 0  # members before it were answered in full

    def pieces(self, upto: int, outputs: RowOutputs) -> dict[bytes, list[Results]]:
        """The answers, by front end, for the job's requests up to ``upto`` (``outputs``: the rows from the last
        ones answered on)."""
        offsets = outputs.offsets
        row0 = self.bounds[self.answered]
        out: dict[bytes, list[Results]] = {}
        while self.cursor < len(self.members):
            ident, rid, m = self.members[self.cursor]
            lo, hi = m.base + m.answered, min(m.base + m.n_requests, upto)
            if hi <= lo:
                break
            a, b = self.bounds[lo] - row0, self.bounds[hi] - row0
            piece = RowOutputs(outputs.data[offsets[a] : offsets[b]], outputs.sizes[a:b])
            out.setdefault(ident, []).append(results_message(rid, m.answered, hi - lo, piece, m.refused))
            m.answered = hi - m.base
            if m.answered < m.n_requests:
                break
            self.cursor += 1
        self.answered = upto
        return out


class EngineServer:
    """Serves one ``LocalEngine`` to the front ends connected to a ROUTER socket.

    The messages whose patches are all at hand, of all those the socket held at once, go to the batcher straight
    from the receive callback as one job; their requests are answered from the batcher's callbacks as they finish,
    batch by batch, each front end's answers of a batch in one message: no task per message, and no Python per row.
    One that brings patch bytes waits for them to be parsed (off the loop) first."""

    def __init__(self, engine: LocalEngine, spec: BaseSpec, info: Info, cache: PatchCache, max_patch_bytes: int):
        self.engine = engine
        self.spec = spec
        self.info = info
        self.cache = cache
        self.max_patch_bytes = max_patch_bytes
        self._inflight: dict[tuple[bytes, int], _InFlight] = {}
        self._parsing: dict[str, asyncio.Task[Patch]] = {}
        self._channel: Channel | None = None
        self._outbox: dict[bytes, list[Results]] = {}  # a batch's answers by front end, sent once it is answered
        engine.batcher.on_answered = self._send_outbox

    async def serve(self, address: str, stop: asyncio.Event, on_bound: asyncio.Event | None = None) -> None:
        """Answer front ends at ``address`` until ``stop`` is set, then finish the requests already taken."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop an answer to a connected front end
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        self._channel = Channel(sock, self._on_messages)
        if on_bound is not None:
            on_bound.set()
        try:
            await stop.wait()
        finally:
            if self._inflight:
                log.info("engine: draining %d messages", len(self._inflight))
                await asyncio.wait([m.future for m in self._inflight.values()], timeout=60)
            self._channel.close()
            ctx.term()

    def _on_messages(self, batch: list[list[bytes]]) -> None:
        """Every message the socket held: the requests whose patches are all at hand go to the batcher together, as
        one job (a Cancel is taken after the requests before it)."""
        ready: list[Ready] = []
        for frames in batch:
            try:
                ident, payload = frames
                msg = to_engine.decode(payload)
            except (ValueError, msgspec.DecodeError) as exc:  # a bug or a stranger on the socket: say so, go on
                log.error("engine: undecodable message from a front end: %s", exc)
                continue
            if isinstance(msg, Requests):
                found = self._held(msg)
                if found is not None:
                    ready.append((ident, msg, found))
                    continue
                task = asyncio.ensure_future(self._infer_after_parsing(ident, msg))
                self._track(ident, msg.id, _InFlight(task, len(msg.counts) // 4))
            elif isinstance(msg, Cancel):
                self._submit(ready)
                ready = []
                self._cancel(ident, msg.id)
            elif isinstance(msg, Hello):
                self._send(ident, self.info)
        self._submit(ready)

    def _cancel(self, ident: bytes, rid: int) -> None:
        """Drop the rows of request ``rid`` that have not run (its message goes on: the others still wait)."""
        for (who, first), m in self._inflight.items():
            if who == ident and first <= rid < first + m.n_requests:
                m.drop(rid - first)
                self.engine.batcher.wake()
                return

    def _send(self, ident: bytes, msg: Info | Results | Answers | Missing | Failed) -> None:
        assert self._channel is not None
        self._channel.send([ident, encode(msg)])  # a ROUTER drops what it cannot deliver (a gone front end)

    def _send_answers(self, ident: bytes, answers: list[Results]) -> None:
        self._send(ident, answers[0] if len(answers) == 1 else Answers(answers))

    def _track(self, ident: bytes, rid: int, m: _InFlight) -> None:
        key = (ident, rid)
        self._inflight[key] = m
        m.future.add_done_callback(lambda _: self._inflight.pop(key, None) if self._inflight.get(key) is m else None)

    def _held(self, msg: Requests) -> dict[str, Patch] | None:
        """The message's patches when every one is in the cache and it brings no bytes; else None."""
        if msg.patches:
            return None
        return self.cache.get_all(pid for pid in msg.keys if pid != BASE_KEY)

    def _submit(self, ready: list[Ready]) -> None:
        """Queue the requests of ``ready`` (messages whose patches are all at hand) as one job: the batcher's work and
        this loop's grow with the turns that brought messages, not with each message. Requests past the queue's
        room are refused (503), the rest of their message is taken."""
        if not ready:
            return
        try:
            unpacked = self._unpack(ready)
            if unpacked is not None:
                self._queue(*unpacked)
        except Exception as exc:  # a bug: fail what was not answered, never leave it waiting
            log.exception("engine: %d messages could not be queued", len(ready))
            for ident, msg, _ in ready:
                if (ident, msg.id) not in self._inflight:
                    self._send(ident, Failed(msg.id, 500, f"the engine failed to queue the request: {exc}"))

    def _unpack(self, ready: list[Ready]) -> tuple[list[Ready], RowBlock, np.ndarray] | None:
        """The well-formed messages of ``ready``, their rows as one block and each request's row count. A malformed
        message is answered 400 and left out; None: nothing is left to queue."""
        found: dict[str, Patch] = {}
        for _, _, patches in ready:
            found.update(patches)
        unpacked = unpack_requests([msg for _, msg, _ in ready], found)
        if unpacked is not None:
            return ready, *unpacked
        if len(ready) > 1:  # one of them is malformed: each alone, so the bad ones get their 400
            good = [item for item in ready if self._unpack([item]) is not None]
            assert len(good) < len(ready), "the messages unpack alone but not together"
            return self._unpack(good) if good else None
        ident, msg, _ = ready[0]
        self._send(ident, Failed(msg.id, 400, "a malformed message: the message's arrays do not agree with each other"))
        return None

    def _queue(self, ready: list[Ready], block: RowBlock, counts: np.ndarray) -> None:
        """Queue ``block`` (the rows of ``ready``) as one job, as far as the queue has room."""
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        batcher = self.engine.batcher
        queued = batcher.queued_rows
        fit = int(np.searchsorted(bounds, batcher.max_queue_rows - queued, side="right")) - 1
        if fit < len(counts):  # the queue has room for the first `fit` requests only: refuse the others (503)
            block, bounds = block.take(np.arange(bounds[fit])), bounds[: fit + 1]
        job = batcher.submit(block) if fit > 0 else None
        members: list[tuple[bytes, int, _InFlight]] = []
        start = 0
        for ident, msg, _ in ready:
            n = len(msg.counts) // 4
            if n == 0:
                continue  # no request, nothing to answer
            taken = min(max(fit - start, 0), n)
            if job is None or taken == 0:
                self._send(ident, Failed(msg.id, 503, f"{queued} rows are queued; retry shortly"))
            else:
                m = _InFlight(job.future, taken, job, bounds, base=start, refused=n - taken)
                parsed = self._inflight.get((ident, msg.id))
                for i in [] if parsed is None else parsed.dropped:
                    if i < taken:
                        m.drop(i)
                self._inflight[ident, msg.id] = m
                members.append((ident, msg.id, m))
            start += n
        if job is None:
            return
        group = _Group(members, bounds.tolist())
        job.on_progress = functools.partial(self._progress, group)
        job.future.add_done_callback(functools.partial(self._answer, group))

    def _progress(self, group: _Group, job: Job) -> None:
        """A batch finished: answer the requests whose rows have all run (they finish in order). The answers wait
        in the outbox until every job of the batch was told: each front end gets one message a batch."""
        k = bisect.bisect_right(group.bounds, job.done) - 1
        if k > group.answered:
            for ident, answers in group.pieces(k, job.collect(group.bounds[k])).items():
                self._outbox.setdefault(ident, []).extend(answers)

    def _send_outbox(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for ident, answers in outbox.items():
            self._send_answers(ident, answers)

    def _answer(self, group: _Group, done: asyncio.Future[RowOutputs]) -> None:
        for ident, rid, m in group.members:  # the job's messages are no longer in flight
            if self._inflight.get((ident, rid)) is m:
                del self._inflight[ident, rid]
        if done.cancelled():
            return  # nobody waits for an answer
        exc = done.exception()
        if exc is None:  # what _progress did not answer yet (requests whose rows were all dropped)
            for ident, answers in group.pieces(len(group.bounds) - 1, done.result()).items():
                self._send_answers(ident, answers)
            return
        for ident, rid, _ in group.members[group.cursor :]:
            if isinstance(exc, SlotsExhaustedError):
                self._send(ident, Failed(rid, 503, f"{exc}; retry shortly"))
            else:  # a failed batch fails its requests, never the engine (the batcher has logged it)
                self._send(ident, Failed(rid, 500, f"the engine failed to run the request: {exc}"))

    async def _infer_after_parsing(self, ident: bytes, msg: Requests) -> None:
        try:
            patches = await self._patches(msg)
        except PatchError as exc:
            self._send(ident, Failed(msg.id, 409, str(exc)))
            return
        if isinstance(patches, Missing):
            self._send(ident, patches)
            return
        self._submit([(ident, msg, patches)])
        running = self._inflight.get((ident, msg.id))
        if running is not None:  # keep this task in flight until the answer is out
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(running.future)

    async def _patches(self, msg: Requests) -> dict[str, Patch] | Missing:
        """The patches ``msg`` names, from the cache or the bytes it carries; ``Missing`` for those it lacks."""
        for pid, data in msg.patches.items():
            if not self.cache.holds(pid) and pid not in self._parsing:
                self._parsing[pid] = asyncio.ensure_future(asyncio.to_thread(self._parse, pid, data))
                self._parsing[pid].add_done_callback(functools.partial(self._parsed, pid))
        found: dict[str, Patch] = {}
        missing: list[str] = []
        for pid in msg.keys:
            if pid == BASE_KEY:
                continue
            patch = self.cache.get(pid)
            if patch is None and pid in self._parsing:  # shielded: other requests may wait for the same parse
                patch = await asyncio.shield(self._parsing[pid])
            if patch is None:
                missing.append(pid)
            else:
                found[pid] = patch
        return Missing(msg.id, sorted(missing)) if missing else found  # counted as misses once parsed

    def _parsed(self, pid: str, _: object) -> None:
        self._parsing.pop(pid, None)

    def _parse(self, pid: str, data: bytes) -> Patch:
        read = content_id(data)
        if read != pid:
            raise PatchError(f"the bytes sent for patch {pid} hash to {read}")
        patch = Patch.from_bytes(data, max_bytes=self.max_patch_bytes, patch_id=pid)
        patch.check_compatible(self.spec)
        self.cache.missed()
        self.cache.put(patch)
        return patch


def engine_info(
    engine: LocalEngine, spec: BaseSpec, source: str, max_positions: int, pooling: str, family: str = ""
) -> Info:
    runner = engine.runner
    return Info(
        engine_id=uuid.uuid4().hex,
        pid=os.getpid(),
        name=spec.name,
        source=source,
        fingerprint=spec.fingerprint,
        hidden_size=spec.hidden_size,
        bias_shapes={name: list(shape) for name, shape in spec.bias_shapes.items()},
        max_positions=max_positions,
        default_pooling=pooling,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        slots=runner.slots.capacity,
        scale_shapes={name: list(shape) for name, shape in spec.scale_shapes.items()},
        lora_shapes={name: list(shape) for name, shape in spec.lora_shapes.items()},
        family=family,
        path=runner.path,
    )


def _build(settings: ServerSettings) -> EngineServer:
    device = resolve_device(settings.device)
    torch.set_num_threads(settings.forward_threads(device.type != "cpu"))
    encoder = load_encoder(settings.model)
    spec = encoder.spec  # computed from the plain model, before the runner rewrites its modules
    metrics = Metrics()
    # On the CPU the forward runs on the loop's own thread: a second thread would only contend for the GIL. On a
    # GPU a runner thread waits for the device while the loop takes in the next requests.
    inline = device.type == "cpu"
    engine = LocalEngine(encoder, settings, metrics, inline=inline)
    cache = PatchCache(settings.host_cache_mb * 1024 * 1024)
    metrics.add_host_cache(cache, "engine")
    if settings.preload:
        registry = open_registry(settings.registry)
        try:
            catalog = Catalog(registry, spec, cache)
            loaded = engine.preload(catalog.recent_patches())
            log.info("engine: preloaded %d of %d tasks", loaded, len(catalog.current))
        finally:
            registry.close()
    info = engine_info(engine, spec, encoder.source, encoder.max_positions, encoder.default_pooling, encoder.family)
    return EngineServer(engine, spec, info, cache, settings.max_patch_bytes)


async def _serve(server: EngineServer, address: str, startup: Connection, stop_pipe: Connection) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # the pipe turns readable when the supervisor asks (a message) or is gone (end of file): stop either way
    loop.add_reader(stop_pipe.fileno(), stop.set)
    loop.add_signal_handler(signal.SIGTERM, _sigterm_is_the_supervisors)
    server.engine.start()
    bound = asyncio.Event()
    serving = asyncio.ensure_future(server.serve(address, stop, bound))
    await bound.wait()
    gc.collect()
    gc.freeze()  # as in the one-process server: start-up objects out of the collector's way
    startup.send_bytes(msgspec.msgpack.encode(Startup(info=server.info)))
    log.info(
        "engine ready (pid %d): %s on %s, %d slots, %d CPU threads, at %s",
        os.getpid(),
        server.info.name,
        server.info.device,
        server.info.slots,
        torch.get_num_threads(),
        address,
    )
    try:
        await serving
    finally:
        loop.remove_reader(stop_pipe.fileno())
        if not _asked_to_stop(stop_pipe):
            log.error("engine: the supervisor is gone; stopped")
        await server.engine.stop()


def _sigterm_is_the_supervisors() -> None:
    log.info("engine: SIGTERM ignored: the supervisor stops the engine once its front ends have drained")


def _asked_to_stop(stop_pipe: Connection) -> bool:
    """Whether the supervisor sent the stop (rather than vanished)."""
    try:
        return stop_pipe.poll() and stop_pipe.recv_bytes() == STOP
    except (EOFError, OSError):
        return False


def run_engine_process(settings_json: str, address: str, startup: Connection, stop_pipe: Connection) -> None:
    """The engine process's entry point (spawned by the supervisor): build, tell the supervisor, serve until the
    supervisor sends ``STOP`` on ``stop_pipe`` or closes it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # while it loads; then _serve logs one that arrives
    settings = ServerSettings.from_json(settings_json)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = _build(settings)
    except (PatchServeError, OSError, ValueError, RuntimeError) as exc:
        log.error("engine: cannot start: %s", exc)
        startup.send_bytes(msgspec.msgpack.encode(Startup(error=str(exc))))
        sys.exit(STARTUP_FAILURE)
    asyncio.run(_serve(server, address, startup, stop_pipe))
