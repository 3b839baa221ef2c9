"""patchserve and Redis as local processes, for scripts, benchmarks and tests: a free port, a ``patchserve``
command (``serve``, ``worker``, ...) in its own process group that is stopped when the block ends, waiting until a
server is ready, and a throwaway ``redis-server``.

    from patchserve.local import served

    with served(Path("logs"), {"PATCHSERVE_REGISTRY": "disk://./registry"}, "--workers", "2") as base:
        httpx.get(f"{base}/readyz")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(
    workdir: Path, *options: str, password: str | None = None, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a free port, keeping nothing on disk, with extra ``options`` such as
    ``"--maxmemory", "1"`` and an optional ``password`` (requirepass, and in the URL); returns the process (the
    caller stops it) and its URL once it answers."""
    import redis

    port = port or free_port()
    args = [_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir)]
    if password is not None:
        args += ["--requirepass", password]
    proc = subprocess.Popen([*args, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{'' if password is None else f':{password}@'}127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                return proc, url
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def patchserve_process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``patchserve ARGS`` as a real process (its own process group, output to ``log``); stopped on exit with
    SIGTERM to the group, then SIGKILL if it lingers."""
    exe = shutil.which("patchserve")
    if exe is None:
        raise RuntimeError("the patchserve command is not installed: pip install -e .")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [exe, *args],
            env=dict(os.environ, PYTHONUNBUFFERED="1") | env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # children left behind by a killed supervisor
                os.killpg(proc.pid, signal.SIGKILL)


def wait_ready(base: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    """Until ``base``/readyz answers 200 (a server has loaded its encoder); fails early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {base} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} did not become ready in {timeout:g} s")
        time.sleep(0.1)


@contextlib.contextmanager
def served(folder: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    """A ``patchserve serve`` process on a free port with ``env`` and extra ``args``, ready; yields its URL. Its
    output goes to ``folder``/server-PORT.log."""
    port = free_port()
    with patchserve_process(["serve", "--port", str(port), *args], env, folder / f"server-{port}.log") as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc=proc)
        yield base


class SentinelRedis:
    """A Redis primary, ``replicas`` replicas and three Sentinels monitoring them (service ``patchserve``), as
    throwaway local processes on free ports: what a production Redis with failover looks like, for tests and
    benchmarks. ``url`` is the ``redis+sentinel://`` URL of the deployment; ``kill_primary()`` kills -9 whichever
    node is primary now and ``wait_for_failover()`` returns once the Sentinels name another."""

    SERVICE = "patchserve"

    def __init__(self, workdir: Path, *, replicas: int = 1, down_after_ms: int = 1000) -> None:
        self.workdir, self.down_after_ms = workdir, down_after_ms
        self.nodes: dict[int, subprocess.Popen] = {}
        self.sentinels: list[subprocess.Popen] = []
        self.sentinel_ports: list[int] = []
        try:
            first, _ = self._start_node(free_port())
            for _ in range(replicas):
                self._start_node(free_port(), replica_of=first)
            self.sentinel_ports = [free_port() for _ in range(3)]
            for port in self.sentinel_ports:
                self._start_sentinel(port, first)
        except BaseException:
            self.stop()
            raise
        ports = self.sentinel_ports
        self.url = f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in ports)}/{self.SERVICE}/0"
        self._wait(lambda: self.primary_port() == first and self.healthy(replicas), "the Sentinels", 60)

    def _start_node(self, port: int, replica_of: int | None = None) -> tuple[int, subprocess.Popen]:
        folder = self.workdir / f"redis-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]
        args += ["--logfile", str(folder / "redis.log")]  # appended to across restarts: what to read after a failure
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        proc = subprocess.Popen([_redis_server(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.nodes[port] = proc
        self._wait(lambda: _answers(port), f"redis-server on port {port}")
        return port, proc

    def _start_sentinel(self, port: int, primary: int) -> None:
        conf = self.workdir / f"sentinel-{port}.conf"  # Sentinel rewrites its configuration file: one each
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.SERVICE} 10000\n"
            f"sentinel parallel-syncs {self.SERVICE} 1\n"
            f"logfile {self.workdir / f'sentinel-{port}.log'}\n"
        )
        proc = subprocess.Popen(
            [_redis_server(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.sentinels.append(proc)
        self._wait(lambda: _answers(port), f"redis-sentinel on port {port}")

    def _ask(self, *command: str) -> object:
        import redis

        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError):
                client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
                try:
                    return client.execute_command(*command)
                finally:
                    client.close()
        return None

    def primary_port(self) -> int | None:
        """The port of the node the Sentinels name primary now (None while none answers)."""
        found = self._ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        return int(found[1]) if isinstance(found, list) and found else None

    def _ask_each(self, *command: str) -> list[Any]:
        """Every Sentinel's answer to ``command``: None from one that does not answer."""
        import redis

        answers: list[Any] = []
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            try:
                answers.append(client.execute_command(*command))
            except redis.RedisError:
                answers.append(None)
            finally:
                client.close()
        return answers

    def promotions(self) -> int:
        """How many replicas the Sentinels have promoted since the start (the highest config epoch any of them
        reports): one per failover, more when a Sentinel started another on a primary it wrongly saw as down."""
        masters = self._ask_each("SENTINEL", "MASTER", self.SERVICE)
        return max([0, *(int(m["config-epoch"]) for m in masters if m is not None)])

    def replica_ports(self) -> set[int]:
        """The ports of the replicas the Sentinels see up and in sync with the primary now."""
        found = self._ask("SENTINEL", "REPLICAS", self.SERVICE)
        replicas = found if isinstance(found, list) else []
        return {int(r["port"]) for r in replicas if isinstance(r, dict) and _in_sync(r)}

    def healthy(self, replicas: int) -> bool:
        """Every Sentinel names the same primary and sees ``replicas`` replicas up and in sync with it. A Sentinel
        learns of a replica from the primary's INFO, every 10 s: one that does not know a replica yet does not
        reconfigure it when it leads the next failover, and that replica stays behind the dead primary until the
        Sentinels find it (about 10 s). So a deployment is ready for its next failure only once all agree."""
        primaries = self._ask_each("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        listed = self._ask_each("SENTINEL", "REPLICAS", self.SERVICE)
        if not all(primaries) or None in listed:  # a Sentinel that did not answer, or knows no primary
            return False
        if any(sum(1 for r in each if _in_sync(r)) < replicas for each in listed):
            return False
        return len({int(p[1]) for p in primaries}) == 1

    def kill_primary(self) -> int:
        """kill -9 the primary; returns its port."""
        port = self.primary_port()
        if port is None or port not in self.nodes:
            raise RuntimeError("the Sentinels name no primary that this deployment started")
        self.nodes[port].kill()
        self.nodes[port].wait(timeout=10)
        return port

    def switchover(self) -> int:
        """A planned failover (SENTINEL FAILOVER, as before maintenance): the Sentinels promote a replica while the
        primary lives on, then make the old primary a replica. Returns its port."""
        port = self.primary_port()
        if port is None or self._ask("SENTINEL", "FAILOVER", self.SERVICE) is None:
            raise RuntimeError("no Sentinel took the switchover")
        return port

    def wait_for_failover(self, old: int, timeout: float = 30.0) -> int:
        """Until the Sentinels name a primary other than ``old``; returns its port."""
        self._wait(lambda: self.primary_port() not in (None, old), "a failover", timeout)
        port = self.primary_port()
        assert port is not None
        return port

    def restart_as_replica(self, port: int) -> None:
        """Bring a killed node back on its port as a replica of the primary now (what an operator does)."""
        primary = self.primary_port()
        if primary is None:
            raise RuntimeError("no primary to replicate")
        self._start_node(port, replica_of=primary)

    def _wait(self, check: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not get ready in {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.nodes.values()]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _in_sync(replica: dict[str, Any]) -> bool:
    """Whether a Sentinel sees this replica (an entry of SENTINEL REPLICAS) up and in sync with its primary."""
    flags = set(str(replica.get("flags", "")).split(","))
    return not {"s_down", "o_down", "disconnected"} & flags and replica.get("master-link-status") == "ok"


def _redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does this)")
    return binary


def _answers(port: int) -> bool:
    import redis

    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()
