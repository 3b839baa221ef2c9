"""Shared fixtures: a tiny seeded BERT folder, a real redis-server on a free port, registries of both kinds."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from patches.encoder import Encoder, load_encoder
from patches.store import Registry
from patches.store.disk import DiskRegistry
from patches.store.redis import RedisRegistry
from tests.helpers import make_tiny_bert_folder


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert_folder(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_encoder(tiny_bert_dir: Path) -> Encoder:
    """Loaded once per session; tests must not modify its weights (use ``fresh_encoder`` for that)."""
    return load_encoder(str(tiny_bert_dir))


@pytest.fixture
def fresh_encoder(tiny_bert_dir: Path) -> Encoder:
    return load_encoder(str(tiny_bert_dir))


@pytest.fixture(scope="session")
def minilm() -> Encoder:
    """The real packaged default encoder (all-MiniLM-L6-v2)."""
    return load_encoder("default")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, throwaway redis-server on a free port (never fakeredis)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does this)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(params=["disk", "redis"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Registry]:
    """Each backend in turn, empty. Redis registries get a unique key prefix on the shared server."""
    reg: Registry
    if request.param == "disk":
        reg = DiskRegistry(tmp_path / "registry", poll_interval=0.02)
    else:
        url = request.getfixturevalue("redis_url")
        reg = RedisRegistry(url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    yield reg
    reg.close()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
