"""A front end's handle on the engine process: ``run(rows)`` as ``LocalEngine`` has it, over a ZeroMQ DEALER socket.

The requests made in one turn of the event loop go out together, as one ``Requests`` message of arrays, and come
back as one ``Results`` message. The patches a request runs with travel by id; their bytes go along the first time
this front end names them to the engine it is connected to, and again whenever the engine says it lacks them (it
restarted, or its patch cache evicted them). A socket monitor follows the connection: when the
engine process goes away, every request waiting on it fails at once with ``EngineUnavailableError`` (503), and new
ones are refused (503, Retry-After) until it is back -- nothing waits for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from patchserve.patches.format import Patch
from patchserve.server.engine.batcher import OverloadedError
from patchserve.server.engine.channel import Channel, each
from patchserve.server.engine.protocol import (
    Answers,
    Cancel,
    EngineError,
    EngineUnavailableError,
    Failed,
    Hello,
    Info,
    Missing,
    Requests,
    Results,
    Row,
    encode,
    from_engine,
)
from patchserve.server.engine.rows import RowOutputs, pack_requests, unpack_results

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


MAX_MESSAGE_ROWS = 1024  # a front end's pending requests go out in messages of at most this many rows


@dataclass
class _Request:
    rows: Sequence[Row]
    future: asyncio.Future[list[np.ndarray]]
    id: int = -1  # given when its message is sent


@dataclass
class _Message:
    requests: list[_Request]
    msg: Requests  # as sent (without patch bytes after the first send: kept to send again on Missing)
    patches: dict[str, Patch]
    answered: int = 0  # requests answered so far (a message is answered as its requests finish)


class RemoteEngine:
    def __init__(self, address: str) -> None:
        self.address = address
        self.info: Info | None = None
        self._ctx = zmq.Context()
        self._outbox: list[_Request] = []  # requests of this turn of the event loop, sent together at its end
        self._sent: dict[int, _Message] = {}  # message id -> what waits for its answer
        self._next_id = 0
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
        self._monitor = Channel(sock.get_monitor_socket(_EVENTS), each(self._on_event))
        sock.connect(self.address)
        self._channel = Channel(sock, each(self._on_message))
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
        """Each row's output, computed by the engine process. The request goes out at the end of this turn of the
        event loop, in one message with every other request made in it. Cancelling the call drops its rows
        there."""
        if not self._connected:
            raise EngineUnavailableError(self.problem() or "")
        request = _Request(rows, asyncio.get_running_loop().create_future())
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            if request.id >= 0 and self._connected:
                self._send(Cancel(request.id))
            raise

    def _flush(self) -> None:
        """Send the requests made in this turn of the event loop: one message per MAX_MESSAGE_ROWS rows."""
        waiting = [r for r in self._outbox if not r.future.done()]
        self._outbox = []
        chunk: list[_Request] = []
        rows = 0
        for request in waiting:
            if chunk and rows + len(request.rows) > MAX_MESSAGE_ROWS:
                self._post(chunk)
                chunk, rows = [], 0
            chunk.append(request)
            rows += len(request.rows)
        if chunk:
            self._post(chunk)

    def _post(self, requests: list[_Request]) -> None:
        first = self._next_id
        self._next_id += len(requests)
        for i, request in enumerate(requests):
            request.id = first + i
        patches = {r.key: r.patch for q in requests for r in q.rows if r.patch is not None}
        fresh = {pid: p.data for pid, p in patches.items() if pid not in self._known}
        msg = pack_requests(first, [q.rows for q in requests], fresh)
        self._sent[first] = _Message(requests, msgspec.structs.replace(msg, patches={}), patches)
        self._transmit(first, msg)

    def _transmit(self, mid: int, msg: Requests) -> None:
        if not self._connected or not self._send(msg):
            gone = EngineUnavailableError(self.problem() or "the engine is not reachable")
            self._settle(self._sent.pop(mid).requests, gone)
            return
        self._known.update(msg.patches)

    def _send(self, msg: Hello | Requests | Cancel) -> bool:
        """Send now; False when no engine is connected to take it."""
        assert self._channel is not None
        try:
            self._channel.send([encode(msg)])
        except zmq.Again:
            return False
        return True

    def _on_message(self, frames: list[bytes]) -> None:
        msg = from_engine.decode(frames[-1])
        if not isinstance(msg, Answers):
            self._on_answer(msg)
            return
        for results in msg.items:  # a batch's answers for this front end
            try:
                self._on_answer(results)
            except Exception:  # one bad answer must not strand the others
                log.exception("an answer from the engine could not be handled")

    def _on_answer(self, msg: Info | Results | Missing | Failed) -> None:
        if isinstance(msg, Info):
            if self.info is None or msg.engine_id != self.info.engine_id:
                self._known.clear()  # a new engine process holds no patches yet
                log.info("connected to engine %s (pid %d) on %s", msg.engine_id[:8], msg.pid, msg.device)
            self.info = msg
            self._connected = True
            self._got_info.set()
            return
        sent = self._sent.get(msg.id)
        if sent is None:
            return
        if isinstance(msg, Missing):  # the engine lacks them: send the message again, with them this time
            if not set(msg.patch_ids) <= self._known:
                lacking = EngineError(500, f"the engine lacks patches {msg.patch_ids}")
                self._settle(self._sent.pop(msg.id).requests, lacking)
                return
            self._known.difference_update(msg.patch_ids)
            again = {pid: sent.patches[pid].data for pid in msg.patch_ids if pid in sent.patches}
            self._transmit(msg.id, msgspec.structs.replace(sent.msg, patches=again))
            return
        if isinstance(msg, Results):
            answered = sent.requests[msg.first : msg.first + msg.count]
            self._settle(answered, unpack_results(msg))
            if msg.refused:
                full = OverloadedError("the engine's queue is full; retry shortly")
                self._settle(sent.requests[-msg.refused :], full)
            sent.answered += msg.count
            if sent.answered + msg.refused < len(sent.requests):
                return  # more answers to come
        del self._sent[msg.id]
        if isinstance(msg, Failed):
            failure = OverloadedError(msg.message) if msg.status == 503 else EngineError(msg.status, msg.message)
            self._settle(sent.requests, failure)

    @staticmethod
    def _settle(requests: list[_Request], outcome: RowOutputs | Exception) -> None:
        """Answer requests: their rows' outputs, one after the other, or the failure."""
        if isinstance(outcome, Exception):
            for request in requests:
                if not request.future.done():
                    request.future.set_exception(outcome)
            return
        offsets, at = outcome.offsets, 0
        for request in requests:
            n = len(request.rows)
            if not request.future.done():
                mine = RowOutputs(outcome.data[offsets[at] : offsets[at + n]], outcome.sizes[at : at + n])
                lengths = [len(r.input_ids) for r in request.rows]
                request.future.set_result(mine.split(lengths, [r.tags for r in request.rows]))
            at += n

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
        sent, self._sent = self._sent, {}
        for message in sent.values():
            self._settle(message.requests, exc)
