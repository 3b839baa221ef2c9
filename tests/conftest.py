"""Shared fixtures: a tiny seeded BERT folder, a real redis-server on a free port, registries of both kinds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from patchserve.patches.encoder import Encoder, load_encoder
from patchserve.patches.format import Patch
from patchserve.patches.store import Registry
from patchserve.patches.store.disk import DiskRegistry
from patchserve.patches.store.redis import RedisRegistry
from tests.helpers import make_patch, make_tiny_bert_folder, start_redis


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert_folder(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_encoder(tiny_bert_dir: Path) -> Encoder:
    """Loaded once per session; tests must not modify its weights (use ``fresh_encoder`` for that)."""
    return load_encoder(str(tiny_bert_dir))


@pytest.fixture(scope="module")
def task_patches(tiny_encoder: Encoder) -> list[Patch]:
    """One patch of each kind and pooling, and one that trains only the query and intermediate biases."""
    return [
        make_patch(tiny_encoder, "sent", seed=1, pooling="mean"),
        make_patch(tiny_encoder, "topic", seed=2, pooling="cls", labels=["a", "b", "c", "d", "e"]),
        make_patch(tiny_encoder, "score", seed=3, kind="regression", pooling="pooler"),
        make_patch(tiny_encoder, "pos", seed=4, kind="token-classification"),
        make_patch(tiny_encoder, "small", seed=5, subset="query-intermediate"),
    ]


@pytest.fixture
def fresh_encoder(tiny_bert_dir: Path) -> Encoder:
    return load_encoder(str(tiny_bert_dir))


@pytest.fixture(scope="session")
def minilm() -> Encoder:
    """The real packaged default encoder (all-MiniLM-L6-v2)."""
    return load_encoder("default")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, throwaway redis-server on a free port (never fakeredis)."""
    try:
        proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    except RuntimeError as exc:
        pytest.fail(str(exc))
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
