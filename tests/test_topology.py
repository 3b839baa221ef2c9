"""The docker-compose topology as processes on loopback: one redis-server, two server replicas sharing it, one
trainer worker. Runs the compose session of docs/deploy.md over HTTP: train job -> registered on both replicas ->
predict -> new version -> rollback, asserting every response."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import free_port, patchserve_process, synthetic_rows, wait_ready

TOKEN = "topology-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB = {
    "task": "sentiment",
    "min_steps": 300,
    "epochs": 1,
    "lr": 1e-2,
    "pooling": "mean",
    "eval_every": 50,
    "patience": 100,
}


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
        except httpx.TransportError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def topology(redis_url, tiny_bert_dir, tmp_path) -> Iterator[tuple[list[str], str]]:
    url = f"{redis_url}?prefix=topo-{uuid.uuid4().hex[:6]}:"
    env = {"PATCHSERVE_REGISTRY": url, "PATCHSERVE_MODEL": str(tiny_bert_dir), "PATCHSERVE_DEVICE": "cpu"}
    with contextlib.ExitStack() as stack:
        bases = []
        for i in range(2):
            port = free_port()
            args = ["serve", "--port", str(port), "--admin-token", TOKEN, "--slots", "4", "--workers", "2"]
            stack.enter_context(patchserve_process(args, env, tmp_path / f"server{i}.log"))
            bases.append(f"http://127.0.0.1:{port}")
        stack.enter_context(patchserve_process(["worker", "--name", "topology-worker"], env, tmp_path / "worker.log"))
        for base in bases:
            wait_ready(base)
        yield bases, url


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _train(base: str, seed: int) -> dict:
    files = {
        "train": ("sentiment-train.jsonl", _jsonl(synthetic_rows("classification", 200, seed=1))),
        "dev": ("sentiment-dev.jsonl", _jsonl(synthetic_rows("classification", 50, seed=2))),
    }
    r = httpx.post(
        f"{base}/jobs", files=files, data={"config": json.dumps(JOB | {"seed": seed})}, headers=AUTH, timeout=30
    )
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["task"] == "sentiment"
    done = _wait(
        lambda: (
            (j := httpx.get(f"{base}/jobs/{job['id']}", headers=AUTH, timeout=5).json())["status"]
            in ("succeeded", "failed", "rejected")
            and j
        ),
        240,
        f"job {job['id']}",
    )
    assert done["status"] == "succeeded", done
    assert done["worker"] == "topology-worker" and done["progress"]["step"] == done["progress"]["total_steps"]
    return done


def _predict(base: str) -> dict:
    r = httpx.post(f"{base}/tasks/sentiment/predict", json={"inputs": ["the good movie", "a bad film"]}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_compose_session_on_two_replicas_and_a_worker(topology):
    (a, b), _ = topology
    # 1. a training job, submitted to replica a, trained by the worker, registered in the shared registry
    first = _train(a, seed=0)
    assert first["result"]["version"] == 1 and first["result"]["dev"]["accuracy"] >= 0.9
    # 2. both replicas list and serve it, with identical answers
    for base in (a, b):
        assert httpx.get(f"{base}/tasks", timeout=5).status_code == 401  # with a token set, reads need one
        tasks = httpx.get(f"{base}/tasks", headers=AUTH, timeout=5).json()
        assert [(t["name"], t["version"]) for t in tasks] == [("sentiment", 1)]
    pa, pb = _predict(a), _predict(b)
    assert pa == pb and pa["version"] == 1 and pa["patch_id"] == first["result"]["patch_id"]
    assert [p["label"] for p in pa["predictions"]] == ["positive", "negative"]
    # 3. a new version, submitted to replica b, is served by both
    second = _train(b, seed=1)
    assert second["result"]["version"] == 2 and second["result"]["patch_id"] != first["result"]["patch_id"]
    for base in (a, b):
        _wait(lambda base=base: _predict(base)["version"] == 2, 10, f"v2 on {base}")
    # 4. roll back on replica a; both serve v1 again
    r = httpx.post(f"{a}/tasks/sentiment/rollback", json={"version": 1}, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["version"] == 1
    for base in (a, b):
        _wait(lambda base=base: _predict(base)["patch_id"] == first["result"]["patch_id"], 10, f"v1 on {base}")
    # 5. mutating routes need the admin token on every replica
    for base in (a, b):
        assert httpx.post(f"{base}/tasks/sentiment/rollback", json={"version": 2}, timeout=10).status_code == 401
    detail = httpx.get(f"{b}/tasks/sentiment", headers=AUTH, timeout=5).json()
    assert detail["current"] == 1 and [v["version"] for v in detail["versions"]] == [1, 2]
    metrics = httpx.get(f"{a}/metrics", timeout=5).text
    assert 'patchserve_jobs{status="succeeded"} 2.0' in metrics
