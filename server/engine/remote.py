"""A front end's handle on the engine process: ``run(rows)`` as ``LocalEngine`` has it, over a ZeroMQ DEALER socket.

Each request is one ``Infer`` message and one answer. The patches a request runs with travel by id; their bytes go
along the first time this front end names them to the engine it is connected to, and again whenever the engine says
it lacks them (it restarted, or its patch cache evicted them). A socket monitor follows the connection: when the
engine process goes away, every request waiting on it fails at once with ``EngineUnavailableError`` (503), and new
ones are refused (503, Retry-After) until it is back -- nothing waits for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from patchserve.server.engine.batcher import OverloadedError
from patchserve.server.engine.channel import Channel
from patchserve.server.engine.protocol import (
    Cancel,
    EngineError,
    EngineUnavailableError,
    Failed,
    Hello,
    Infer,
    Info,
    Missing,
    Outputs,
    Row,
    RowIn,
    encode,
    from_engine,
)

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class RemoteEngine:
    def __init__(self, address: str) -> None:
        self.address = address
        self.info: Info | None = None
        self._ctx = zmq.Context()
        self._pending: dict[int, asyncio.Future[Outputs | Missing | Failed]] = {}
        self._ids = itertools.count()
        self._known: set[str] = set()  # patch ids the connected engine was sent (it may have evicted some since)
        self._connected = False
        self._got_info = asyncio.Event()
        self._channel: Channel | None = None
        self._monitor: Channel | None = None
        self._hello: asyncio.Task[None] | None = None

    @property
    def device(self) -> str:
        return "unknown" if self.info is None else self.info.device

    def problem(self) -> str | None:
        """Why requests cannot run now (None: they can)."""
        if not self._connected:
            return "the engine process is not running (it is being restarted); retry shortly"
        return None

    async def connect(self, timeout: float) -> Info:
        """Connect and wait for the engine's ``Info`` (up to ``timeout`` seconds)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for an engine that is not there: refuse at once
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self._monitor = Channel(sock.get_monitor_socket(_EVENTS), self._on_event)
        sock.connect(self.address)
        self._channel = Channel(sock, self._on_message)
        self._hello = asyncio.ensure_future(self._greet())
        async with asyncio.timeout(timeout):
            await self._got_info.wait()
        assert self.info is not None
        return self.info

    async def _greet(self) -> None:
        """While no engine has said who it is, say Hello twice a second (a reconnect also says it at once)."""
        while True:
            if not self._connected:
                self._send(Hello())
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._hello is not None:
            self._hello.cancel()
        self._fail_pending(EngineUnavailableError("the server is shutting down"))
        for channel in (self._monitor, self._channel):
            if channel is not None:
                channel.close(linger=0)
        self._ctx.term()

    async def run(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Each row's output, computed by the engine process. Cancelling the call cancels its rows there."""
        rid = next(self._ids)
        wire = [RowIn(r.input_ids, r.token_type_ids, r.key, r.output) for r in rows]
        patches = {r.patch.patch_id: r.patch for r in rows if r.patch is not None}
        try:
            reply = await self._ask(rid, wire, {pid: p.data for pid, p in patches.items() if pid not in self._known})
            if isinstance(reply, Missing):  # the engine lacks them: send them along this time
                self._known.difference_update(reply.patch_ids)
                reply = await self._ask(rid, wire, {pid: patches[pid].data for pid in reply.patch_ids})
        except asyncio.CancelledError:
            self._send(Cancel(rid))
            raise
        if isinstance(reply, Outputs):
            flat = np.frombuffer(reply.data, dtype="<f4")
            bounds = [0, *itertools.accumulate(math.prod(s) for s in reply.shapes)]
            return [flat[a:b].reshape(s) for a, b, s in zip(bounds, bounds[1:], reply.shapes, strict=False)]
        if isinstance(reply, Failed):
            if reply.status == 503:
                raise OverloadedError(reply.message)
            raise EngineError(reply.status, reply.message)
        raise EngineError(500, f"the engine still lacks patches {reply.patch_ids} after they were sent")

    async def _ask(self, rid: int, rows: list[RowIn], patches: dict[str, bytes]) -> Outputs | Missing | Failed:
        if not self._connected:
            raise EngineUnavailableError(self.problem() or "")
        future: asyncio.Future[Outputs | Missing | Failed] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            if not self._send(Infer(rid, rows, patches)):
                raise EngineUnavailableError(self.problem() or "the engine process is not reachable; retry")
            self._known.update(patches)
            return await future
        finally:
            self._pending.pop(rid, None)

    def _send(self, msg: Hello | Infer | Cancel) -> bool:
        """Send now; False when no engine is connected to take it."""
        assert self._channel is not None
        try:
            self._channel.send([encode(msg)])
        except zmq.Again:
            return False
        return True

    def _on_message(self, frames: list[bytes]) -> None:
        msg = from_engine.decode(frames[-1])
        if isinstance(msg, Info):
            if self.info is None or msg.engine_id != self.info.engine_id:
                self._known.clear()  # a new engine process holds no patches yet
                log.info("connected to engine %s (pid %d) on %s", msg.engine_id[:8], msg.pid, msg.device)
            self.info = msg
            self._connected = True
            self._got_info.set()
            return
        future = self._pending.get(msg.id)
        if future is not None and not future.done():
            future.set_result(msg)

    def _on_event(self, frames: list[bytes]) -> None:
        """Follow the connection: on a disconnect, fail what waits; on a (re)connect, ask who the engine is."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self._connected = False
            self._got_info.clear()
            self._known.clear()
            self._fail_pending(
                EngineUnavailableError(
                    "the engine process stopped while this request was in flight (it is being restarted); retry"
                )
            )
            log.warning("the engine process disconnected; waiting for it to come back")
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._send(Hello())

    def _fail_pending(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
