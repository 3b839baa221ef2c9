"""``patchserve serve --workers N``: one engine process that owns the device, N HTTP front ends sharing one listening
socket, and this process watching over both (the way vLLM splits its API servers from its engine core).

* The engine process (``server/engine/process.py``) starts first; the front ends start once it is ready. If it
  cannot start, ``serve`` exits with status 3 and the engine's reason.
* The front ends are uvicorn worker processes under uvicorn's own supervisor, which replaces one that dies.
* An engine that dies is restarted; its front ends answer 503 (Retry-After) meanwhile, and the requests it held get
  a 503 at once. An engine that dies more than ``MAX_ENGINE_DEATHS`` times in ``ENGINE_DEATH_WINDOW_S`` seconds,
  or whose restart fails, stops the server with status 1, so an orchestrator can act.
* SIGTERM or SIGINT drains: the front ends stop taking connections and finish their requests (up to 30 s), then the
  engine stops.

Every process writes its metrics to a shared folder (prometheus_client's multiprocess mode), so /metrics on any
front end covers them all.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from socket import socket

import msgspec
from uvicorn import Config
from uvicorn.supervisors.multiprocess import Multiprocess

from server.app import ENGINE_ADDRESS_ENV, SETTINGS_ENV
from server.engine.process import STARTUP_FAILURE, Startup, run_engine_process
from server.settings import ServerSettings

log = logging.getLogger("patchserve.supervisor")

MAX_ENGINE_DEATHS = 5
ENGINE_DEATH_WINDOW_S = 60.0
ENGINE_STOP_TIMEOUT_S = 60.0
GRACEFUL_SHUTDOWN_S = 30


class EngineStartError(RuntimeError):
    """The engine process could not start (the message says why)."""


class EngineProcess:
    """The engine process: started, watched, restarted and stopped from the supervisor."""

    def __init__(self, settings: ServerSettings, address: str) -> None:
        self.settings_json = settings.to_json()
        self.address = address
        self.process: BaseProcess | None = None
        self._startup: Connection | None = None
        self.ready = False

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_process, args=(self.settings_json, self.address, send), name="patchserve-engine"
        )
        self.process.start()
        send.close()
        self._startup, self.ready = receive, False

    def poll(self, timeout: float = 0.0) -> bool:
        """True once the engine said it is ready; raises EngineStartError if it failed or died starting."""
        if self.ready:
            return True
        assert self._startup is not None and self.process is not None
        try:
            if not self._startup.poll(timeout):
                if not self.process.is_alive():
                    raise EngineStartError(f"the engine process exited with status {self.process.exitcode}")
                return False
            startup = msgspec.msgpack.decode(self._startup.recv_bytes(), type=Startup)
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineStartError(f"the engine process exited with status {self.process.exitcode}") from None
        if startup.error is not None:
            raise EngineStartError(startup.error)
        self.ready = True
        self._startup.close()
        return True

    def wait_ready(self) -> None:
        while not self.poll(1.0):
            pass

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self) -> None:
        """SIGTERM (it answers what it holds, then exits), SIGKILL if it lingers."""
        if self.process is None or not self.process.is_alive():
            return
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGTERM)
        self.process.join(ENGINE_STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.error("the engine process did not stop in %g s; killing it", ENGINE_STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join(10)


class Supervisor(Multiprocess):
    """uvicorn's supervisor of the front ends, watching the engine process too."""

    def __init__(self, config: Config, sockets: list[socket], engine: EngineProcess, metrics_dir: Path) -> None:
        super().__init__(config, sockets)
        self.engine = engine
        self.metrics_dir = metrics_dir
        self.deaths: deque[float] = deque()
        self.exit_code = 0

    def keep_subprocess_alive(self) -> None:
        before = {p.pid for p in self.processes}
        super().keep_subprocess_alive()
        for pid in before - {p.pid for p in self.processes}:
            if pid is not None:
                self._forget_metrics(pid)
        self._watch_engine()

    def _watch_engine(self) -> None:
        if self.should_exit.is_set():
            return
        if not self.engine.ready:
            try:
                if self.engine.poll():
                    log.info("engine process %s is back", self.engine.pid)
            except EngineStartError as exc:
                self._fail(f"the engine process could not restart: {exc}")
            return
        if self.engine.alive:
            return
        assert self.engine.process is not None
        log.error("the engine process %s died (exit status %s)", self.engine.pid, self.engine.process.exitcode)
        if self.engine.pid is not None:
            self._forget_metrics(self.engine.pid)
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > ENGINE_DEATH_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > MAX_ENGINE_DEATHS:
            self._fail(f"the engine process died {len(self.deaths)} times in {ENGINE_DEATH_WINDOW_S:g} s")
            return
        log.info("restarting the engine process")
        self.engine.start()

    def _fail(self, why: str) -> None:
        log.error("%s; stopping the server", why)
        self.exit_code = 1
        self.should_exit.set()

    def _forget_metrics(self, pid: int) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))


def serve(settings: ServerSettings) -> int:
    """Run the engine process and ``settings.front_ends`` front ends until SIGTERM/SIGINT; the exit status."""
    workdir = Path(tempfile.mkdtemp(prefix="patchserve-"))
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    address = f"ipc://{workdir / 'engine'}"
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # read by every child when it imports prometheus_client
    os.environ[ENGINE_ADDRESS_ENV] = address
    os.environ[SETTINGS_ENV] = settings.to_json()
    engine = EngineProcess(settings, address)
    try:
        log.info("starting the engine process (%s on %s)", settings.model, settings.device)
        engine.start()
        try:
            engine.wait_ready()
        except EngineStartError as exc:
            log.error("the engine process could not start: %s", exc)
            return STARTUP_FAILURE
        config = Config(
            "server.app:front_end_factory",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.front_ends,
            http="auto",  # httptools and uvloop (dependencies of patchserve) where they import
            loop="auto",
            log_level=settings.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        supervisor = Supervisor(config, [config.bind_socket()], engine, metrics_dir)
        log.info("starting %d front-end processes on %s:%d", settings.front_ends, settings.host, settings.port)
        supervisor.run()
        return supervisor.exit_code
    finally:
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)
