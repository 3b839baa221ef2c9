"""``patchserve serve --workers N``: one engine process that owns the device, N HTTP front ends sharing one listening
socket, and this process watching over both (the way vLLM splits its API servers from its engine core).

* The engine process (``server/engine/process.py``) starts first; the front ends start once it is ready. If it
  cannot start, ``serve`` exits with status 3 and the engine's reason.
* The front ends are uvicorn worker processes, each on its own SO_REUSEPORT socket (the kernel spreads connections
  over them); one that dies or stops answering its health check is replaced.
* An engine that dies is restarted; its front ends answer 503 (Retry-After) meanwhile, and the requests it held get
  a 503 at once. An engine that dies more than ``MAX_ENGINE_DEATHS`` times in ``ENGINE_DEATH_WINDOW_S`` seconds,
  or whose restart fails, stops the server with status 1, so an orchestrator can act.
* SIGTERM or SIGINT drains: the front ends stop taking connections and finish their requests (up to 30 s), then the
  engine stops, told through a pipe (it ignores both signals, which reach it too when the whole process group is
  signalled, as Ctrl-C, ``kill -TERM -PGID`` and systemd do).

Every process writes its metrics to a shared folder (prometheus_client's multiprocess mode), so /metrics on any
front end covers them all.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec
from uvicorn import Config
from uvicorn.config import STARTUP_FAILURE as FRONT_END_STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Process as FrontEnd  # a uvicorn worker process with a health check

from patchserve.patches.encoder import resolve_device
from patchserve.server.app import ENGINE_ADDRESS_ENV, SETTINGS_ENV, SUPERVISOR_PID_ENV
from patchserve.server.engine.process import STARTUP_FAILURE, STOP, Startup, run_engine_process
from patchserve.server.settings import ServerSettings

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
        self._stop: Connection | None = None  # the engine stops when this says STOP or closes (this process died)
        self.ready = False

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        stop_receive, stop_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_process,
            args=(self.settings_json, self.address, send, stop_receive),
            name="patchserve-engine",
        )
        self.process.start()
        send.close()
        stop_receive.close()
        if self._stop is not None:  # the pipe of an engine that died
            self._stop.close()
        self._startup, self._stop, self.ready = receive, stop_send, False

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
        """STOP on its pipe (it answers what it holds, then exits; it ignores SIGTERM, which a process group's stop
        would send it before its front ends have drained), SIGKILL if it lingers."""
        if self.process is None or not self.process.is_alive():
            return
        assert self._stop is not None
        with contextlib.suppress(OSError):  # BrokenPipeError: it is exiting already
            self._stop.send_bytes(STOP)
        self.process.join(ENGINE_STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.error("the engine process did not stop in %g s; killing it", ENGINE_STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join(10)


def listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` sockets bound to ``host:port`` with SO_REUSEPORT, one per front end: the kernel spreads new connections
    over them, where one shared socket lets whichever process wakes first take a burst of them (wrk's 64 connections
    all landed on one of two front ends). Where SO_REUSEPORT is missing, one socket shared by all. Raises OSError
    when the port is taken (checked without SO_REUSEPORT first: another server with it would otherwise share it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    sockets = []
    for _ in range(n if reuse_port is not None else 1):
        sock = socket.socket(family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port is not None:
            sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets * n if len(sockets) == 1 else sockets


class Supervisor:
    """Watches the front ends (uvicorn worker processes, each on its own socket) and the engine process until
    SIGTERM or SIGINT, then stops them in order: front ends first (they drain), the engine last."""

    def __init__(self, config: Config, sockets: list[socket.socket], engine: EngineProcess, metrics_dir: Path) -> None:
        self.config = config
        self.sockets = sockets
        self.engine = engine
        self.metrics_dir = metrics_dir
        self.front_ends: list[FrontEnd] = []
        self.deaths: deque[float] = deque()
        self.exit_code = 0
        self.should_exit = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig: int, _: object) -> None:
        log.info("received %s: stopping (in-flight requests finish first)", signal.Signals(sig).name)
        self.should_exit.set()

    def run(self) -> None:
        self.front_ends = [self._start_front_end(sock) for sock in self.sockets]
        while not self.should_exit.wait(0.5):
            self._watch_front_ends()
            self._watch_engine()
        for front_end in self.front_ends:
            front_end.terminate()
        for front_end in self.front_ends:
            front_end.join()

    def _start_front_end(self, sock: socket.socket) -> FrontEnd:
        front_end = FrontEnd(self.config, [sock])
        front_end.start()
        return front_end

    def _watch_front_ends(self) -> None:
        """Replace a front end that died or stopped answering its health check (uvicorn's own rule)."""
        for i, front_end in enumerate(self.front_ends):
            if self.should_exit.is_set() or front_end.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            front_end.kill()
            front_end.join()
            if front_end.pid is not None:
                self._forget_metrics(front_end.pid)
            if front_end.exitcode == FRONT_END_STARTUP_FAILURE:  # its app cannot start: a replacement would too
                self._fail(f"front end {front_end.pid} failed to start")
                return
            log.warning("front end %s died (exit status %s); starting another", front_end.pid, front_end.exitcode)
            self.front_ends[i] = self._start_front_end(self.sockets[i])

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
    """Run the engine process and its front ends until SIGTERM/SIGINT; the exit status."""
    gpu = resolve_device(settings.device).type != "cpu"  # no CUDA context here: the engine process is spawned
    front_ends = settings.front_ends(gpu)
    settings = settings.model_copy(update={"workers": front_ends})  # what the engine and the front ends read
    workdir = Path(tempfile.mkdtemp(prefix="patchserve-"))
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    address = f"ipc://{workdir / 'engine'}"
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # read by every child when it imports prometheus_client
    os.environ[ENGINE_ADDRESS_ENV] = address
    os.environ[SETTINGS_ENV] = settings.to_json()
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())
    config = Config(
        "patchserve.server.app:front_end_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        http="auto",  # httptools and uvloop (dependencies of patchserve) where they import
        loop="auto",
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    try:  # first: a port in use fails before a model is loaded
        sockets = listening_sockets(settings.host, settings.port, front_ends)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return 1
    engine = EngineProcess(settings, address)
    try:
        log.info("starting the engine process (%s on %s)", settings.model, settings.device)
        engine.start()
        try:
            engine.wait_ready()
        except EngineStartError as exc:
            log.error("the engine process could not start: %s", exc)
            return STARTUP_FAILURE
        supervisor = Supervisor(config, sockets, engine, metrics_dir)
        log.info("starting %d front-end processes on http://%s:%d", front_ends, settings.host, settings.port)
        supervisor.run()
        return supervisor.exit_code
    finally:
        engine.stop()
        for sock in sockets:
            sock.close()
        shutil.rmtree(workdir, ignore_errors=True)
