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

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path, *options: str, password: str | None = None) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a free port, keeping nothing on disk, with extra ``options`` such as
    ``"--maxmemory", "1"`` and an optional ``password`` (requirepass, and in the URL); returns the process (the
    caller stops it) and its URL once it answers."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does this)")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
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
