"""The job queue and trainer worker against a real redis-server: lifecycle, gates, bad data, a killed worker."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from patchserve.patches.jobs import JobError, JobLimits, JobQueue, JobStateError
from patchserve.patches.store.redis import RedisRegistry
from patchserve.server.app import create_app
from patchserve.server.settings import ServerSettings
from patchserve.trainer.worker import Worker
from tests.helpers import synthetic_rows

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "task": "sent",
    "min_steps": 300,
    "epochs": 1,
    "eval_every": 50,
    "lr": 1e-2,
    "pooling": "mean",
    "device": "cpu",
    "patience": 100,
    "restarts": 1,  # one seed: these tests are about the queue (small data would train 3)
}


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def redis_ns(redis_url):
    """A registry and a queue under a fresh key prefix on the shared throwaway Redis."""
    url = f"{redis_url}?prefix=w-{uuid.uuid4().hex[:8]}:"
    reg, queue = RedisRegistry(url), JobQueue(url)
    yield url, reg, queue
    reg.close()
    queue.close()


def _files(n_train=200, n_dev=50, bad=None):
    train = bad if bad is not None else _jsonl(synthetic_rows("classification", n_train, seed=1))
    return {"train": ("train.jsonl", train), "dev": ("dev.jsonl", _jsonl(synthetic_rows("classification", n_dev, 2)))}


def _wait(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_job_lifecycle_registers_a_patch(redis_ns, tiny_encoder, caplog):
    _url, reg, queue = redis_ns
    job = queue.submit(CONFIG, _files())
    assert queue.get(job.id).status == "queued" and queue.list()[0].id == job.id
    with caplog.at_level(logging.INFO, logger="patchserve.trainer.worker"):
        assert Worker(queue, reg, tiny_encoder, name="w1", block_s=0.2).run(max_jobs=1) == 1
    assert any(f"job {job.id}: step " in r.getMessage() for r in caplog.records), "progress also goes to the log"
    done = queue.get(job.id)
    assert done.status == "succeeded", done.error
    assert done.attempts == 1 and done.worker == "w1"
    assert done.result["version"] == 1 and done.result["dev"]["accuracy"] >= 0.9
    assert done.progress["step"] == done.progress["total_steps"] == 300
    info, patch = reg.get("sent")
    assert (
        info.patch_id == done.result["patch_id"]
        and patch.meta.metrics["dev_accuracy"] == done.result["dev"]["accuracy"]
    )
    assert queue.file(job.id, "train") is None  # data dropped once the job is finished


def test_gates_reject_without_registering(redis_ns, tiny_encoder):
    _url, reg, queue = redis_ns
    worker = Worker(queue, reg, tiny_encoder, block_s=0.2)
    job = queue.submit(CONFIG, _files(), gate={"min_dev": 1.01})
    worker.run(max_jobs=1)
    done = queue.get(job.id)
    assert done.status == "rejected" and "below the gate's minimum 1.01" in done.error
    assert reg.tasks() == []
    queue.submit(CONFIG, _files())
    worker.run(max_jobs=1)
    worse = queue.submit(CONFIG | {"min_steps": 2, "eval_every": 1}, _files(), gate={"not_worse": True})
    worker.run(max_jobs=1)
    done = queue.get(worse.id)
    assert done.status == "rejected" and "worse than the current version" in done.error
    assert [v.version for v in reg.versions("sent")] == [1]


def test_bad_data_fails_the_job_with_a_useful_message(redis_ns, tiny_encoder):
    _url, reg, queue = redis_ns
    bad = b'{"text": "good", "label": "positive"}\n{"text": "bad movie"}\n'
    job = queue.submit(CONFIG, _files(bad=bad))
    Worker(queue, reg, tiny_encoder, block_s=0.2).run(max_jobs=1)
    done = queue.get(job.id)
    assert done.status == "failed"
    assert "train file 'train.jsonl':2: missing \"label\"" in done.error, done.error
    assert reg.tasks() == []


def test_invalid_submissions_are_refused(redis_ns):
    _, _, queue = redis_ns
    with pytest.raises(JobError, match="unknown fields"):
        queue.submit({"task": "t", "epoch": 3}, _files())
    with pytest.raises(JobError, match="needs a 'train'"):
        queue.submit(CONFIG, {"dev": ("d.jsonl", b"{}")})
    with pytest.raises(JobError, match=r"\.jsonl, \.csv"):
        queue.submit(CONFIG, {"train": ("train.parquet", b"x")})
    assert queue.list() == []


def test_a_retry_never_registers_twice(redis_ns, tiny_encoder):
    """An attempt that registered and then died: the retry finds its patch and only records the result."""
    _url, reg, queue = redis_ns
    job = queue.submit(CONFIG, _files())
    worker = Worker(queue, reg, tiny_encoder, name="w", block_s=0.2)
    worker.run(max_jobs=1)
    first = queue.get(job.id)
    _, patch = reg.get("sent")
    # replay the crash: the job is not finished yet, its patch is stashed and already registered
    queue.update(job.id, status="running")
    queue.stash_patch(job.id, patch.data, patch.patch_id)
    msg = queue.r.xadd(queue.keys.job_stream, {"job": job.id})
    queue.r.xreadgroup("patchserve-workers", "w", {queue.keys.job_stream: ">"}, count=1)
    worker.process(msg.decode(), job.id)
    assert queue.get(job.id).status == "succeeded"
    assert [v.patch_id for v in reg.versions("sent")] == [first.result["patch_id"]]


def test_a_killed_workers_job_is_reclaimed_and_registered_once(redis_ns, tiny_bert_dir, tiny_encoder, tmp_path):
    url, reg, queue = redis_ns
    exe = shutil.which("patchserve")
    assert exe, "patchserve console script not installed"
    job = queue.submit(CONFIG | {"min_steps": 4000, "eval_every": 100}, _files())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [exe, "worker", "--registry", url, "--model", str(tiny_bert_dir), "--name", "doomed", "--lease-s", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        _wait(lambda: queue.get(job.id).progress.get("step", 0) >= 100, what="the doomed worker to train")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert queue.get(job.id).status == "running" and reg.tasks() == []
    queue.update(job.id, config=CONFIG)  # the rescuer may train a shorter run: what matters is who registers
    rescuer = Worker(queue, reg, tiny_encoder, name="rescuer", lease_s=1.0, block_s=0.3)
    stop = threading.Event()
    t = threading.Thread(target=rescuer.run, kwargs={"stop": stop, "max_jobs": 1})
    t.start()
    try:
        _wait(lambda: queue.get(job.id).status in ("succeeded", "failed"), what="the rescuer to finish")
    finally:
        stop.set()
        t.join(timeout=30)
    done = queue.get(job.id)
    assert done.status == "succeeded", done.error
    assert done.attempts == 2 and done.worker == "rescuer"
    assert [v.version for v in reg.versions("sent")] == [1]
    pending = queue.r.xpending(queue.keys.job_stream, "patchserve-workers")
    assert pending["pending"] == 0


def test_job_api_end_to_end(redis_ns, tiny_bert_dir, tiny_encoder):
    url, reg, queue = redis_ns
    settings = ServerSettings(
        registry=url, model=str(tiny_bert_dir), device="cpu", slots=4, max_wait_ms=1, admin_token="s3cret"
    )
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(create_app(settings)) as client:
        files = {
            "train": ("train.jsonl", _jsonl(synthetic_rows("classification", 200, 1))),
            "dev": ("dev.jsonl", _jsonl(synthetic_rows("classification", 50, 2))),
        }
        r = client.post("/jobs", files=files, data={"config": json.dumps(CONFIG | {"gate": {"min_dev": 0.8}})})
        assert r.status_code == 401
        r = client.post("/jobs", files=files, data={"config": json.dumps(CONFIG)}, headers=auth)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert client.get(f"/jobs/{job_id}").status_code == 401  # with a token set, reads need one too
        assert client.get(f"/jobs/{job_id}", headers=auth).json()["status"] == "queued"
        bad = client.post("/jobs", files=files, data={"config": json.dumps({"task": "x", "lr": "fast"})}, headers=auth)
        assert bad.status_code == 422
        assert client.post("/jobs", files=files, data={"config": "{not json"}, headers=auth).status_code == 422
        Worker(queue, reg, tiny_encoder, block_s=0.2).run(max_jobs=1)
        job = client.get(f"/jobs/{job_id}", headers=auth).json()
        assert job["status"] == "succeeded" and job["result"]["version"] == 1
        assert job["result"]["metric"] == "accuracy" and set(job["result"]["dev"]) == {"accuracy", "macro_f1"}
        assert job["result"]["selection"]["restarts"] == 1
        assert [j["id"] for j in client.get("/jobs", headers=auth).json()] == [job_id]
        pred = client.post("/tasks/sent/predict", json={"inputs": ["the good movie", "a bad film"]}).json()
        assert pred["patch_id"] == job["result"]["patch_id"]
        assert [p["label"] for p in pred["predictions"]] == ["positive", "negative"]
        assert client.get("/jobs/nope", headers=auth).status_code == 422  # not a job id at all
        assert client.get(f"/jobs/{'0' * 32}", headers=auth).status_code == 404
        assert client.get("/jobs?limit=0", headers=auth).status_code == 422  # limit 0 once listed every job


def test_job_api_refuses_bad_data_at_once_naming_file_and_line(redis_ns, tiny_bert_dir):
    url, _reg, queue = redis_ns
    settings = ServerSettings(registry=url, model=str(tiny_bert_dir), device="cpu", slots=2)
    good_train = ("train.jsonl", _jsonl(synthetic_rows("classification", 40, 1)))
    with TestClient(create_app(settings)) as client:
        r = client.post(
            "/jobs",
            files={"train": ("reviews.jsonl", b'{"text": "fine", "label": "positive"}\n{"text": "no label"}\n')},
            data={"config": json.dumps(CONFIG)},
        )
        assert r.status_code == 422 and "train file 'reviews.jsonl':2: missing \"label\"" in r.json()["detail"]
        r = client.post(
            "/jobs",
            files={"train": good_train, "dev": ("dev.csv", b"text,label\ngreat,positive\nawful,neutral\n")},
            data={"config": json.dumps(CONFIG)},
        )
        assert r.status_code == 422, r.text
        assert "dev file 'dev.csv': labels ['neutral'] are not among the task's labels" in r.json()["detail"]
        r = client.post(
            "/jobs", files={"train": good_train}, data={"config": json.dumps(CONFIG | {"kind": "regression"})}
        )
        assert r.status_code == 422 and "is not a number (this is a regression task)" in r.json()["detail"]
    assert queue.list() == [], "a refused job must not be queued"


def test_cli_submit_checks_the_data_before_queueing(redis_ns, tmp_path, tiny_encoder, capsys, monkeypatch):
    from patchserve.__main__ import main

    url, reg, queue = redis_ns
    monkeypatch.setenv("PATCHSERVE_QUEUE", url)
    train, dev, bad = tmp_path / "train.jsonl", tmp_path / "dev.jsonl", tmp_path / "bad.jsonl"
    train.write_bytes(_jsonl(synthetic_rows("classification", 200, 1)))
    dev.write_bytes(_jsonl(synthetic_rows("classification", 50, 2)))
    bad.write_text('{"text": "fine", "label": "positive"}\n{"text": 5, "label": "negative"}\n')
    argv = ["submit", "--task", "sent", "--min-steps", "300", "--epochs", "1", "--lr", "1e-2", "--pooling", "mean"]

    assert main([*argv, "--train", str(bad)]) == 1
    assert "train file 'bad.jsonl':2: missing or empty \"text\"" in capsys.readouterr().err
    assert main([*argv, "--train", str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl: cannot read" in capsys.readouterr().err
    assert main([*argv, "--train", str(train), "--kind", "regression"]) == 1  # --kind reaches the job's check
    assert "is not a number (this is a regression task)" in capsys.readouterr().err
    assert main([*argv, "--train", str(train), "--metric", "entity_f1"]) == 1  # the kind comes from the data
    assert "metric 'entity_f1' does not score a classification task" in capsys.readouterr().err
    assert queue.list() == []

    assert main([*argv, "--train", str(train), "--dev", str(dev), "--min-dev", "0.5"]) == 0
    job_id = json.loads(capsys.readouterr().out)["id"]
    assert main(["jobs"]) == 0
    assert f"{job_id}\tsent\tqueued" in capsys.readouterr().out
    Worker(queue, reg, tiny_encoder, block_s=0.2).run(max_jobs=1)
    assert main(["jobs", job_id]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "succeeded" and shown["gate"]["min_dev"] == 0.5 and shown["result"]["version"] == 1

    scores = tmp_path / "scores.jsonl"  # integer scores are read as classes unless --kind says regression
    scores.write_bytes(_jsonl({"text": f"row {i}", "label": i % 5} for i in range(40)))
    assert main([*argv, "--train", str(scores), "--kind", "regression"]) == 0
    assert queue.get(json.loads(capsys.readouterr().out)["id"]).config["kind"] == "regression"


def test_job_api_without_redis_says_what_to_set(tmp_path, tiny_bert_dir):
    settings = ServerSettings(registry=f"disk://{tmp_path}/reg", model=str(tiny_bert_dir), device="cpu", slots=2)
    with TestClient(create_app(settings)) as client:
        r = client.get("/jobs")  # 501, not 503: no retry will ever succeed on this server
        assert r.status_code == 501 and "PATCHSERVE_QUEUE" in r.json()["detail"]


def test_several_workers_share_one_queue(redis_ns, tiny_bert_dir):
    """Two workers, four jobs: every job runs exactly once, and both workers take part. The workers keep their
    default names: two in one process (as two containers on the host's network share a hostname and pid 1) must
    still be two consumers of the queue."""
    from patchserve.patches.encoder import load_encoder

    _url, reg, queue = redis_ns
    jobs = [
        queue.submit(CONFIG | {"task": f"task{i}", "min_steps": 40, "eval_every": 20}, _files(60, 20)) for i in range(4)
    ]
    stop = threading.Event()
    workers = [Worker(queue, reg, load_encoder(str(tiny_bert_dir)), block_s=0.2) for i in range(2)]
    threads = [threading.Thread(target=w.run, kwargs={"stop": stop}) for w in workers]
    for t in threads:
        t.start()
    try:
        _wait(lambda: all(queue.get(j.id).status in ("succeeded", "failed") for j in jobs), what="all four jobs")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    done = [queue.get(j.id) for j in jobs]
    assert [d.status for d in done] == ["succeeded"] * 4, [d.error for d in done]
    assert all(d.attempts == 1 for d in done)
    assert workers[0].name != workers[1].name
    assert {d.worker for d in done} == {w.name for w in workers}
    assert reg.tasks() == [f"task{i}" for i in range(4)]
    assert all([v.version for v in reg.versions(f"task{i}")] == [1] for i in range(4))


def test_the_alive_file_follows_the_workers_loop_and_the_compose_healthcheck_reads_it(redis_ns, tiny_encoder, tmp_path):
    """--alive-file is touched while the worker waits and while it trains; docker-compose.yml's worker healthcheck
    (run here as written) passes on a fresh file and fails on one older than 60 s or missing."""
    import yaml

    _url, reg, queue = redis_ns
    alive = tmp_path / "worker.alive"
    worker = Worker(queue, reg, tiny_encoder, block_s=0.2, alive_file=alive)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop})
    thread.start()
    try:
        _wait(alive.exists, timeout=10, what="the alive file")
        os.utime(alive, (time.time() - 100, time.time() - 100))
        _wait(lambda: time.time() - alive.stat().st_mtime < 5, timeout=10, what="a touch while idle")
        job = queue.submit(CONFIG | {"min_steps": 5000, "eval_every": 1000}, _files())  # stopped below
        _wait(lambda: queue.get(job.id).status == "running", what="the job to start")
        os.utime(alive, (time.time() - 100, time.time() - 100))
        _wait(lambda: time.time() - alive.stat().st_mtime < 5, timeout=10, what="a touch during the job")
        assert queue.get(job.id).status == "running"  # touched by the job's heartbeat, not between claims
    finally:
        stop.set()
        thread.join(timeout=30)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]
    test = compose["healthcheck"]["test"]
    path = compose["environment"]["PATCHSERVE_WORKER_ALIVE_FILE"]
    assert test[:2] == ["CMD", "python"] and path in test[-1]
    k8s = yaml.safe_load((ROOT / "deploy/k8s/worker.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    assert k8s["livenessProbe"]["exec"]["command"] == test[1:]  # the same check in both
    assert {"name": "PATCHSERVE_WORKER_ALIVE_FILE", "value": path} in k8s["env"]
    check = [sys.executable, *test[2:-1], test[-1].replace(path, str(alive))]
    alive.touch()
    assert subprocess.run(check).returncode == 0
    os.utime(alive, (time.time() - 61, time.time() - 61))
    assert subprocess.run(check).returncode != 0
    alive.unlink()
    assert subprocess.run(check, stderr=subprocess.DEVNULL).returncode != 0


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"max_seq_length": True}, "max_seq_length: Input should be a valid integer"),  # a bool is not an int
        ({"epochs": "5"}, "epochs: Input should be a valid number"),
        ({"min_steps": 1.5}, "min_steps: Input should be a valid integer"),
        ({"min_steps": 10**12}, "min_steps: Input should be less than or equal to 10000000"),
        ({"restarts": 10**6}, "restarts: Input should be less than or equal to 100"),
        ({"restarts": 50, "lr_search": [1e-3, 2e-3, 3e-3]}, "restarts x learning rates is 150"),
        ({"eval_every": 0}, "eval_every: Input should be greater than or equal to 1"),
        ({"task": "sent\n"}, "invalid task name 'sent\\n'"),
        ({"device": "cuda:0\n"}, "device: String should match pattern"),
        ({"gate": {"min_dev": "0.8"}}, "gate: min_dev: Input should be a valid number"),
        ({"gate": {"min_dev": 0.8, "minimum": 1}}, "gate has unknown fields ['minimum']"),
        ({"gate": [0.8]}, "gate must be a JSON object"),
        ({"metric": "f1"}, "metric: Input should be 'accuracy', 'macro_f1'"),
        ({"metric": "entity_f1"}, "metric 'entity_f1' does not score a classification task"),  # known from the data
        ({"contrastive": 2}, "contrastive was removed (it did not pay; docs/experiments.md); drop contrastive"),
        ({"distill": 0.5}, "distill was removed (it did not pay; docs/experiments.md); drop distill"),
        ({"scales": "lora"}, "scales: Input should be 'none' or 'ia3'"),
        ({"scales": "layernorm"}, "scales 'layernorm' (the bitfit-ln kind) was removed"),
        ({"scales": "ia3", "full": True}, "full fine-tuning trains every weight; drop scales or full"),
        ({"head_init": "names"}, "head_init: Input should be 'random' or 'labels'"),
        ({"head_init": "labels", "kind": "regression"}, "head_init 'labels' starts a sentence classifier"),
    ],
)
def test_job_configs_are_validated_strictly_at_the_door(redis_ns, tiny_bert_dir, change, problem):
    url, _reg, queue = redis_ns
    settings = ServerSettings(registry=url, model=str(tiny_bert_dir), device="cpu", slots=2)
    with TestClient(create_app(settings)) as client:
        r = client.post("/jobs", files={"train": _files()["train"]}, data={"config": json.dumps(CONFIG | change)})
        assert r.status_code == 422 and problem in r.json()["detail"], r.text
    assert queue.list() == []


def test_a_job_over_the_deployments_limits_is_refused_or_stopped(redis_ns, tiny_bert_dir, tiny_encoder):
    url, reg, queue = redis_ns
    settings = ServerSettings(registry=url, model=str(tiny_bert_dir), device="cpu", slots=2, max_job_updates=500)
    with TestClient(create_app(settings)) as client:
        r = client.post(
            "/jobs", files={"train": _files()["train"]}, data={"config": json.dumps(CONFIG | {"restarts": 2})}
        )
        assert r.status_code == 422, r.text
        assert "would make 600 updates (2 run(s) x 300), over this deployment's limit of 500" in r.json()["detail"]
        assert (
            client.post("/jobs", files={"train": _files()["train"]}, data={"config": json.dumps(CONFIG)}).status_code
            == 202
        )
    # the worker has its own caps: a job queued around the server (patchserve submit) meets them there
    big = queue.submit(CONFIG | {"restarts": 2}, _files())
    Worker(queue, reg, tiny_encoder, block_s=0.2, limits=JobLimits(max_updates=500)).run(max_jobs=2)
    assert "over this deployment's limit of 500" in queue.get(big.id).error
    slow = queue.submit(CONFIG | {"min_steps": 100_000, "max_steps": 100_000}, _files())
    Worker(queue, reg, tiny_encoder, block_s=0.2, limits=JobLimits(max_seconds=1.0)).run(max_jobs=1)
    done = queue.get(slow.id)
    assert done.status == "failed" and "ran past this worker's limit of 1 s" in done.error, done.error
    # it stopped part-way (how far depends on the machine's speed: the error says where, progress may not yet)
    stopped_at = re.search(r"stopped at update (\d+) of 100000", done.error)
    assert stopped_at and int(stopped_at.group(1)) < 100_000, done.error
    assert reg.versions("sent")[-1].version == 1  # only the first job registered


def test_cancel_a_queued_job(redis_ns, tiny_encoder):
    _url, reg, queue = redis_ns
    job = queue.submit(CONFIG, _files())
    assert queue.cancel(job.id).status == "cancelled"
    assert queue.file(job.id, "train") is None
    with pytest.raises(JobStateError, match="already ended as cancelled"):
        queue.cancel(job.id)
    assert Worker(queue, reg, tiny_encoder, block_s=0.2).run(max_jobs=1) == 1  # takes the message, trains nothing
    assert queue.get(job.id).status == "cancelled" and reg.tasks() == []
    assert queue.r.xpending(queue.keys.job_stream, "patchserve-workers")["pending"] == 0


def test_cancel_a_running_job_through_the_api_stops_it_at_its_next_update(redis_ns, tiny_bert_dir, tiny_encoder):
    url, reg, queue = redis_ns
    job = queue.submit(CONFIG | {"min_steps": 50_000, "eval_every": 1000}, _files())
    stop = threading.Event()
    worker = threading.Thread(target=Worker(queue, reg, tiny_encoder, block_s=0.2).run, kwargs={"stop": stop})
    worker.start()
    settings = ServerSettings(
        registry=url, model=str(tiny_bert_dir), device="cpu", slots=2, admin_token="adm1n", predict_token="pr3d"
    )
    try:
        with TestClient(create_app(settings)) as client:
            _wait(lambda: queue.get(job.id).progress.get("step", 0) >= 20, what="training to start")
            assert client.post(f"/jobs/{job.id}/cancel").status_code == 401
            assert client.post(f"/jobs/{job.id}/cancel", headers={"Authorization": "Bearer pr3d"}).status_code == 403
            r = client.post(f"/jobs/{job.id}/cancel", headers={"Authorization": "Bearer adm1n"})
            assert r.status_code == 200 and r.json()["status"] == "running" and r.json()["cancel_requested"]
            _wait(lambda: queue.get(job.id).status == "cancelled", what="the worker to stop the job")
            # reads of jobs need a token as well: configs, errors and tracebacks are not for everyone
            assert client.get(f"/jobs/{job.id}").status_code == 401
            done = client.get(f"/jobs/{job.id}", headers={"Authorization": "Bearer pr3d"}).json()
            assert client.get("/jobs", headers={"Authorization": "Bearer adm1n"}).status_code == 200
            r = client.post(f"/jobs/{job.id}/cancel", headers={"Authorization": "Bearer adm1n"})
            assert r.status_code == 409 and "already ended as cancelled" in r.json()["detail"]
            r = client.post(f"/jobs/{'0' * 32}/cancel", headers={"Authorization": "Bearer adm1n"})
            assert r.status_code == 404
    finally:
        stop.set()
        worker.join(timeout=30)
    assert done["error"].startswith("cancelled at update ") and done["progress"]["step"] < 50_000
    assert reg.tasks() == [] and queue.r.xpending(queue.keys.job_stream, "patchserve-workers")["pending"] == 0


def test_a_worker_given_sigterm_hands_its_job_back_at_once(redis_ns, tiny_bert_dir, tiny_encoder, capsys):
    from patchserve.__main__ import main

    url, reg, queue = redis_ns
    exe = shutil.which("patchserve")
    assert exe, "patchserve console script not installed"
    job = queue.submit(CONFIG | {"min_steps": 50_000, "eval_every": 1000}, _files())
    proc = subprocess.Popen(
        [exe, "worker", "--registry", url, "--model", str(tiny_bert_dir), "--name", "leaving", "--lease-s", "600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        _wait(lambda: queue.get(job.id).progress.get("step", 0) >= 20, what="the worker to train")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # the 50,000 updates would take many minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stderr.read().decode() if proc.stderr else ""
    assert "handed back to the queue" in log, log
    back = queue.get(job.id)
    assert back.status == "queued" and back.attempts == 0 and back.worker is None
    assert queue.r.xpending(queue.keys.job_stream, "patchserve-workers")["pending"] == 0
    # the next worker takes it at once, without waiting for the 600 s lease
    queue.update(job.id, config=CONFIG)
    Worker(queue, reg, tiny_encoder, name="next", lease_s=600, block_s=0.2).run(max_jobs=1)
    done = queue.get(job.id)
    assert done.status == "succeeded" and done.attempts == 1 and done.worker == "next", done.error
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PATCHSERVE_QUEUE", url)
    try:
        assert main(["jobs", "cancel", job.id]) == 1  # already ended: says so, exits 1
        assert "already ended as succeeded" in capsys.readouterr().err
        fresh = queue.submit(CONFIG, _files())
        assert main(["jobs", "cancel", fresh.id]) == 0 and "cancelled" in capsys.readouterr().out
        assert main(["jobs", "cancel"]) == 2
    finally:
        monkey.undo()


def _kind_files(kind: str, n_train: int = 120, n_dev: int = 40, seed: int = 1):
    return {
        "train": ("train.jsonl", _jsonl(synthetic_rows(kind, n_train, seed=seed))),
        "dev": ("dev.jsonl", _jsonl(synthetic_rows(kind, n_dev, seed=seed + 100))),
    }


def _pending(queue) -> int:
    return queue.r.xpending(queue.keys.job_stream, "patchserve-workers")["pending"]


def test_concurrent_jobs_train_in_one_batch_each_as_it_would_alone(redis_ns, tiny_encoder):
    """--concurrent-jobs 2: a long job and a short one of another kind train together; when the short one leaves,
    a job submitted later joins the long one. Each registers once, a patch equal to the same job trained alone."""
    from patchserve.patches.data import job_splits
    from patchserve.patches.train_config import TrainConfig
    from patchserve.trainer.train import train_patch

    _url, reg, queue = redis_ns
    # no dropout, and float32 (bfloat16's products round a job's rows differently beside another job's): reproducible
    plain = CONFIG | {"dropout": 0.0, "eval_every": 10, "min_steps": 30, "precision": "float32"}
    specs = {
        "long": (plain | {"task": "long", "min_steps": 900, "eval_every": 100}, _kind_files("classification")),
        "short": (plain | {"task": "short", "pooling": "cls"}, _kind_files("regression", seed=3)),
        "later": (plain | {"task": "later", "lr": 3e-3}, _kind_files("classification", seed=5)),
    }
    jobs = {name: queue.submit(*specs[name]) for name in ("long", "short")}
    stop = threading.Event()
    worker = Worker(queue, reg, tiny_encoder, name="pair", block_s=0.2, concurrent_jobs=2)
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop, "max_jobs": 3})
    thread.start()
    try:
        _wait(lambda: queue.get(jobs["short"].id).status == "succeeded", what="the short job")
        assert queue.get(jobs["long"].id).status == "running"
        jobs["later"] = queue.submit(*specs["later"])
        _wait(lambda: all(queue.get(j.id).status not in ("queued", "running") for j in jobs.values()), 120, "all")
    finally:
        stop.set()
        thread.join(timeout=60)
    done = {name: queue.get(j.id) for name, j in jobs.items()}
    assert all(d.status == "succeeded" for d in done.values()), {n: d.error for n, d in done.items()}
    assert all(d.worker == "pair" and d.attempts == 1 for d in done.values())
    # they overlapped: the short job and the later one each trained while the long one did
    for name in ("short", "later"):
        assert done[name].started_at < done["long"].finished_at and done["long"].started_at < done[name].finished_at
    assert done["long"].result["steps"] == 900
    assert sorted(reg.tasks()) == ["later", "long", "short"] and _pending(queue) == 0
    for name, (config, files) in specs.items():
        assert [v.version for v in reg.versions(name)] == [1]
        splits = job_splits(files, seed=config.get("seed", 0))
        alone = train_patch(tiny_encoder, splits.train, splits.dev, TrainConfig.from_dict(config)).patch
        _, patch = reg.get(name)
        assert alone is not None
        for bias, value in alone.biases.items():
            torch.testing.assert_close(patch.biases[bias], value, rtol=0, atol=1e-4, msg=f"{name} {bias}")
        torch.testing.assert_close(patch.head_weight, alone.head_weight, rtol=0, atol=1e-4, msg=name)


def test_concurrent_jobs_cancel_alone_and_hand_back_together(redis_ns, tiny_encoder):
    """Three jobs in one batch: cancelling one ends it and leaves the others training; a stop hands the others back
    (not counted as attempts), and a worker that takes them registers each once."""
    _url, reg, queue = redis_ns
    long = CONFIG | {"min_steps": 50_000, "eval_every": 1000}
    jobs = [queue.submit(long | {"task": f"t{i}"}, _files()) for i in range(3)]
    stop = threading.Event()
    worker = Worker(queue, reg, tiny_encoder, name="trio", block_s=0.2, concurrent_jobs=3)
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop})
    thread.start()
    try:
        _wait(lambda: all(queue.get(j.id).progress.get("step", 0) >= 20 for j in jobs), what="three jobs training")
        queue.cancel(jobs[1].id)
        _wait(lambda: queue.get(jobs[1].id).status == "cancelled", what="the cancelled job to end")
        steps = [queue.get(j.id).progress["step"] for j in (jobs[0], jobs[2])]
        _wait(
            lambda: all(queue.get(j.id).progress["step"] > s for j, s in zip((jobs[0], jobs[2]), steps, strict=True)),
            what="the other two to train on",
        )
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert queue.get(jobs[1].id).error.startswith("cancelled at update ")
    for job in (jobs[0], jobs[2]):
        back = queue.get(job.id)
        assert back.status == "queued" and back.attempts == 0 and back.worker is None
        queue.update(job.id, config=CONFIG | {"task": back.task})
    assert _pending(queue) == 0 and reg.tasks() == []
    assert Worker(queue, reg, tiny_encoder, name="next", block_s=0.2, concurrent_jobs=3).run(max_jobs=2) == 2
    assert sorted(reg.tasks()) == ["t0", "t2"]
    assert all(queue.get(j.id).status == "succeeded" and queue.get(j.id).attempts == 1 for j in (jobs[0], jobs[2]))
    assert [v.version for v in reg.versions("t0")] == [1] and _pending(queue) == 0


def test_a_killed_worker_with_concurrent_jobs_loses_none_and_registers_each_once(redis_ns, tiny_bert_dir, tiny_encoder):
    """kill -9 of `patchserve worker --concurrent-jobs 2` while two jobs train: both are retried by another worker
    once their lease runs out and registered exactly once."""
    url, reg, queue = redis_ns
    exe = shutil.which("patchserve")
    assert exe, "patchserve console script not installed"
    jobs = [queue.submit(CONFIG | {"task": f"k{i}", "min_steps": 50_000, "eval_every": 1000}, _files()) for i in (0, 1)]
    cmd = [exe, "worker", "--registry", url, "--model", str(tiny_bert_dir), "--name", "doomed", "--lease-s", "1"]
    proc = subprocess.Popen(
        [*cmd, "--concurrent-jobs", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    try:
        _wait(lambda: all(queue.get(j.id).progress.get("step", 0) >= 20 for j in jobs), what="both jobs to train")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert all(queue.get(j.id).status == "running" for j in jobs) and reg.tasks() == []
    for j in jobs:
        queue.update(j.id, config=CONFIG | {"task": queue.get(j.id).task})
    rescuer = Worker(queue, reg, tiny_encoder, name="rescuer", lease_s=1.0, block_s=0.3, concurrent_jobs=2)
    assert rescuer.run(max_jobs=2) == 2
    for j in jobs:
        done = queue.get(j.id)
        assert done.status == "succeeded" and done.attempts == 2 and done.worker == "rescuer", done.error
    assert sorted(reg.tasks()) == ["k0", "k1"] and [v.version for v in reg.versions("k1")] == [1]
    assert _pending(queue) == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
