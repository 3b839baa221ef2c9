"""A ZeroMQ socket on the asyncio event loop, without a future per message: sends go out at once (non-blocking),
and every message that arrives is handed to a callback as soon as the loop sees the socket readable.

pyzmq's ``zmq.asyncio`` wraps each send and receive in a future; at tens of thousands of messages a second that was
half of the engine's event-loop time. ZeroMQ exposes one edge-triggered file descriptor per socket, so the rule is
the usual one: after the loop says it is readable, and after every send (a send can consume the edge), drain what
``EVENTS`` says is there.

Messages are handed over in batches: every message the socket holds when the loop gets to it goes to ``on_messages``
in one call (a receiver that can treat them together, as the engine process does, saves its per-message work; the
readiness check runs once a batch, not once a message). ``each(fn)`` adapts a callback of one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)
MAX_BATCH = 256  # messages handed over at once at most (then the rest, in the next batch)
Frames = list[bytes]


def each(on_message: Callable[[Frames], None]) -> Callable[[list[Frames]], None]:
    """A batch callback that hands each message to ``on_message``; one that raises is logged, the rest still go."""

    def on_messages(batch: list[Frames]) -> None:
        for frames in batch:
            try:
                on_message(frames)
            except Exception:  # one bad message must not strand the ones behind it
                log.exception("a message could not be handled")

    return on_messages


class Channel:
    def __init__(self, sock: zmq.Socket[bytes], on_messages: Callable[[list[Frames]], None]) -> None:
        self.sock = sock
        self.on_messages = on_messages
        self._loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._scheduled = False
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # anything that arrived before the reader was added

    def send(self, frames: list[bytes]) -> None:
        """Send now or raise ``zmq.Again`` (no peer to take it: a DEALER with IMMEDIATE and no connection)."""
        self.sock.send_multipart(frames, zmq.NOBLOCK)
        if not self._scheduled and self._readable():
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        while not self.sock.closed and self._readable():
            batch: list[Frames] = []
            with contextlib.suppress(zmq.Again):
                while len(batch) < MAX_BATCH:
                    batch.append(self.sock.recv_multipart(zmq.NOBLOCK))
            try:
                self.on_messages(batch)
            except Exception:  # a bug must not strand the messages behind it (the edge will not come again)
                log.exception("messages on %s could not be handled", self.sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _readable(self) -> bool:
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def close(self, linger: int | None = None) -> None:
        self._loop.remove_reader(self._fd)
        self.sock.close(linger)
