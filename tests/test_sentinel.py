"""Redis with Sentinel, for real: a primary, a replica and three Sentinels (redis-server processes on free ports),
the primary killed with kill -9 while the registry, the job queue and a server process use a redis+sentinel:// URL.
They follow the failover without a restart; while there is no primary, writes fail with a clear 503 and predictions
of resident tasks go on."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from patchserve.local import SentinelRedis
from patchserve.patches.errors import RegistryError, RegistryUnavailableError, ReplicationError
from patchserve.patches.jobs import JobNotFoundError, JobQueue
from patchserve.patches.store import open_registry, redact_url
from patchserve.patches.store.redis_client import parse_sentinel_url
from tests.helpers import free_port, make_patch, patchserve_process, wait_ready, wait_until


@pytest.fixture
def sentinel_redis(tmp_path):
    deployment = SentinelRedis(tmp_path / "redis")
    yield deployment
    deployment.stop()


def _retry(fn, timeout: float = 30.0):
    """``fn()`` until it stops raising RegistryUnavailableError; returns (its value, seconds it took)."""
    start = time.monotonic()
    while True:
        try:
            return fn(), time.monotonic() - start
        except RegistryUnavailableError:
            assert time.monotonic() - start < timeout, "the registry did not come back"
            time.sleep(0.1)


def test_sentinel_urls_parse_and_keep_their_secrets():
    url = "redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-b:26380,[::1]:26381/mymaster/2?sentinel_password=pw2"
    sentinels, service, db, password, sentinel_password = parse_sentinel_url(url)
    assert sentinels == [("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381)]
    assert (service, db, password, sentinel_password) == ("mymaster", 2, "s3cret", "pw2")
    assert parse_sentinel_url("redis+sentinel://h:1/svc")[1:4] == ("svc", 0, None)
    shown = redact_url(url)
    assert "s3cret" not in shown and "pw2" not in shown and shown.startswith("redis+sentinel://:***@10.0.0.1:26379,")
    for bad, says in [
        ("redis+sentinel://h:1,h2/svc", "'h2' is not host:port"),
        ("redis+sentinel://h:1/", "/SERVICE_NAME or /SERVICE_NAME/DB"),
        ("redis+sentinel://h:1/svc/zero", "/SERVICE_NAME or /SERVICE_NAME/DB"),
    ]:
        with pytest.raises(RegistryError, match=says):
            parse_sentinel_url(bad)


def test_registry_and_queue_follow_a_failover(sentinel_redis, tiny_encoder):
    reg, queue = open_registry(sentinel_redis.url), JobQueue(sentinel_redis.url)
    assert reg.url == sentinel_redis.url and open_registry(sentinel_redis.url + "?prefix=x:").url.endswith("x:")
    v1 = reg.put(make_patch(tiny_encoder, seed=1))
    job = queue.submit({"task": "sentiment"}, {"train": ("t.jsonl", b'{"text": "a", "label": "x"}\n')})
    replica = next(p for p in sentinel_redis.nodes if p != sentinel_redis.primary_port())
    on_replica = open_registry(f"redis://127.0.0.1:{replica}/0")
    deadline = time.monotonic() + 10
    while not on_replica.tasks():  # asynchronous replication: wait until the replica holds v1
        assert time.monotonic() < deadline
        time.sleep(0.02)

    old = sentinel_redis.kill_primary()
    with pytest.raises(RegistryUnavailableError, match="unreachable"):
        reg.put(make_patch(tiny_encoder, seed=2))  # no primary yet: a clear error, not a hang
    new = sentinel_redis.wait_for_failover(old)
    assert new == replica
    v2, took = _retry(lambda: reg.put(make_patch(tiny_encoder, seed=2)))
    assert v2.version == 2 and took < 5
    assert [v.version for v in reg.versions("sentiment")] == [1, 2] and reg.get("sentiment", 1)[0] == v1
    assert queue.get(job.id).status == "queued"
    assert queue.submit({"task": "other"}, {"train": ("t.jsonl", b'{"text": "a", "label": "x"}\n')}).status == "queued"

    sentinel_redis.restart_as_replica(old)  # the old primary returns as a replica; the next failover goes back
    # Sentinel learns of replicas from the primary's INFO every 10 s, and of their link from theirs every 10 s too
    deadline = time.monotonic() + 90
    while old not in sentinel_redis.replica_ports():
        if time.monotonic() > deadline:
            seen = sentinel_redis._ask("SENTINEL", "REPLICAS", sentinel_redis.SERVICE) or []
            views = [{k: r.get(k) for k in ("port", "flags", "master-link-status")} for r in seen]  # type: ignore[union-attr]
            own = redis.Redis(port=old, socket_timeout=1, decode_responses=True).info("replication")
            raise AssertionError(f"the Sentinels see {views}; the node itself: {own}")
        time.sleep(0.1)
    sentinel_redis.kill_primary()
    assert sentinel_redis.wait_for_failover(new) == old
    v3, _ = _retry(lambda: reg.put(make_patch(tiny_encoder, seed=3)))
    assert v3.version == 3


def test_a_server_follows_a_failover_without_a_restart(tmp_path, sentinel_redis, tiny_bert_dir, tiny_encoder):
    """Predictions of a resident task never fail while the primary is gone; a registration then answers 503 with
    Retry-After (or 201), and once Sentinel has promoted the replica the same server registers and serves v2."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["serve", "--port", str(port), "--model", str(tiny_bert_dir), "--device", "cpu", "--slots", "8"]
    env = {"PATCHSERVE_REGISTRY": sentinel_redis.url}

    def upload(seed: int) -> httpx.Response:
        data = make_patch(tiny_encoder, seed=seed).data
        return httpx.post(f"{base}/tasks", files={"patch": ("p.safetensors", data)}, timeout=30)

    with patchserve_process(args, env, tmp_path / "server.log") as proc:
        wait_ready(base, proc=proc)
        assert upload(1).status_code == 201
        ask = {"inputs": ["a good film"]}
        assert httpx.post(f"{base}/tasks/sentiment/predict", json=ask, timeout=30).json()["version"] == 1
        time.sleep(0.5)  # replicated
        failed, answered, stop = [], [0], threading.Event()

        def predict_all_along() -> None:
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    r = client.post(f"{base}/tasks/sentiment/predict", json=ask)
                    if r.status_code != 200:
                        failed.append(r.status_code)
                    answered[0] += 1

        thread = threading.Thread(target=predict_all_along)
        thread.start()
        try:
            old = sentinel_redis.kill_primary()
            during = upload(2)
            assert during.status_code in (201, 503), during.text
            if during.status_code == 503:
                assert "Retry-After" in during.headers and "unreachable" in during.json()["detail"]
            sentinel_redis.wait_for_failover(old)
            deadline = time.monotonic() + 10
            while (after := upload(3)).status_code != 201:
                assert after.status_code == 503 and time.monotonic() < deadline, after.text
                time.sleep(0.2)
            version = after.json()["version"]
            deadline = time.monotonic() + 10
            while httpx.post(f"{base}/tasks/sentiment/predict", json=ask, timeout=30).json()["version"] != version:
                assert time.monotonic() < deadline, "the server did not hear of the version registered after"
                time.sleep(0.1)
        finally:
            stop.set()
            thread.join(timeout=30)
        assert failed == [] and answered[0] > 10


def _writes_survive(deployment: SentinelRedis, encoder, fail_over) -> None:
    """Registrations and job submissions at --redis-min-replicas 1 in a loop while ``fail_over()`` runs: every
    version answered and every job answered is there after, with the patch it was answered for, and some writes
    were refused (the failovers were felt, not silently taken)."""
    reg = open_registry(deployment.url, min_replicas=1)
    queue = JobQueue(deployment.url, min_replicas=1)
    patches = [make_patch(encoder, seed=s) for s in range(1, 8)]
    acked: list[tuple[int, str]] = []
    jobs: list[str] = []
    refused, stop = [0], threading.Event()
    data = {"train": ("t.jsonl", b'{"text": "a", "label": "x"}\n')}

    def write_all_along() -> None:
        i = 0
        while not stop.is_set():
            try:
                info = reg.put(patches[i % len(patches)])
                acked.append((info.version, info.patch_id))
                jobs.append(queue.submit({"task": "sentiment"}, data).id)
            except RegistryUnavailableError:
                refused[0] += 1
                time.sleep(0.02)
            i += 1

    thread = threading.Thread(target=write_all_along)
    thread.start()
    try:
        fail_over()
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(timeout=30)
    stored = {v.version: v.patch_id for v in reg.versions("sentiment")}
    lost = [(v, p) for v, p in acked if stored.get(v) != p]
    assert lost == [] and len(acked) > 10, (len(acked), len(lost), lost[:5])
    missing = []
    for job_id in jobs:
        try:
            queue.get(job_id)
        except JobNotFoundError:
            missing.append(job_id)
    assert missing == [] and len(jobs) > 10
    assert refused[0] > 0


def test_with_min_replicas_1_no_acknowledged_write_is_lost_over_failovers(tmp_path, tiny_encoder):
    """The primary killed -9 three times (two replicas, so one is left to confirm writes after each failover)."""
    deployment = SentinelRedis(tmp_path / "redis", replicas=2)

    def kill_three_times() -> None:
        for _ in range(3):
            time.sleep(0.5)
            old = deployment.kill_primary()
            deployment.wait_for_failover(old)
            deployment.restart_as_replica(old)
            wait_until(lambda: len(deployment.replica_ports()) >= 2, 60, "the replicas to come back", interval=0.1)

    try:
        _writes_survive(deployment, tiny_encoder, kill_three_times)
    finally:
        deployment.stop()


def test_a_write_is_not_acknowledged_while_a_replica_acts_as_a_second_primary(tmp_path, tiny_encoder):
    """The loss the failover benchmark found: Sentinel promotes a replica while the primary lives on with the other
    replica still attached, so WAIT 1 passes on the old side, whose writes are dropped when it is demoted. A write
    made then is refused (503, "may be lost"), not acknowledged; before and after, writes are acknowledged."""
    deployment = SentinelRedis(tmp_path / "redis", replicas=2)
    try:
        reg = open_registry(deployment.url, min_replicas=1)
        assert reg.put(make_patch(tiny_encoder, seed=1)).version == 1
        rogue = min(deployment.replica_ports())
        redis.Redis(port=rogue).execute_command("REPLICAOF", "NO", "ONE")  # what a Sentinel's promotion does first
        with pytest.raises(ReplicationError, match=rf"127\.0\.0\.1:{rogue} acts as a primary too.*may be lost"):
            reg.put(make_patch(tiny_encoder, seed=2))
        assert [v.version for v in reg.versions("sentiment")] == [1, 2]  # made on the old side, not acknowledged
        primary = deployment.primary_port()
        redis.Redis(port=rogue).execute_command("REPLICAOF", "127.0.0.1", str(primary))
        deadline = time.monotonic() + 30
        while rogue not in deployment.replica_ports() or redis.Redis(port=rogue).role()[0] != b"slave":
            assert time.monotonic() < deadline, "the replica did not rejoin"
            time.sleep(0.1)
        assert reg.put(make_patch(tiny_encoder, seed=3)).version == 3
        reg.close()
    finally:
        deployment.stop()


def test_with_min_replicas_1_a_planned_switchover_loses_no_acknowledged_write(tmp_path, tiny_encoder):
    """SENTINEL FAILOVER (what an operator runs before maintenance) promotes a replica while the old primary still
    takes writes, with the other replica attached until the Sentinels repoint it: writes made there in that window
    pass WAIT 1 and are dropped when the old primary is demoted (thousands a switchover without the check after
    WAIT). Two switchovers under registrations and job submissions."""
    deployment = SentinelRedis(tmp_path / "redis", replicas=2)

    def switch_over_twice() -> None:
        for _ in range(2):
            time.sleep(1.0)
            deployment.wait_for_failover(deployment.switchover())
            wait_until(lambda: deployment.healthy(2), 60, "the old primary to rejoin as a replica", interval=0.1)

    try:
        _writes_survive(deployment, tiny_encoder, switch_over_twice)
        assert deployment.promotions() == 2
    finally:
        deployment.stop()


def test_after_a_switchover_writes_resume_before_the_old_primary_is_demoted(tmp_path, tiny_encoder):
    """The check after WAIT tells the old primary (still answering as one for up to 10 s after a switchover, until
    the Sentinels demote it) from a new one: writes on its successor are acknowledged at once, not refused until
    then; and writes stop going to the old one as soon as the Sentinels name the new."""
    deployment = SentinelRedis(tmp_path / "redis", replicas=2)
    try:
        reg = open_registry(deployment.url, min_replicas=1)
        reg.put(make_patch(tiny_encoder, seed=1))
        old = deployment.switchover()
        new = deployment.wait_for_failover(old)
        deadline = time.monotonic() + 30
        while True:
            try:
                info = reg.put(make_patch(tiny_encoder, seed=2))
                break
            except ReplicationError:
                assert time.monotonic() < deadline, "writes did not resume"
                time.sleep(0.05)
        assert redis.Redis(port=old).role()[0] == b"master"  # not demoted yet: its successor took the write
        assert reg.durable._client.connection_pool.master_address[1] == new
        assert {v.version: v.patch_id for v in reg.versions("sentiment")}.get(info.version) == info.patch_id
        reg.close()
    finally:
        deployment.stop()


def test_a_write_no_replica_confirms_answers_503_saying_it_may_have_happened(redis_url, tiny_bert_dir, tiny_encoder):
    """--redis-min-replicas 1 on a Redis without replicas: the registration is made on the primary, but the server
    answers 503 (Retry-After) saying so, and the client can see it is there; a job submission likewise."""
    from fastapi.testclient import TestClient

    from patchserve.server.app import create_app
    from patchserve.server.settings import ServerSettings

    url = f"{redis_url}?prefix=minrep-{time.monotonic_ns()}:"
    reg = open_registry(url, min_replicas=1)
    with pytest.raises(ReplicationError, match=r"made on the primary, but 0 of the 1 replica\(s\)"):
        reg.put(make_patch(tiny_encoder, seed=1))
    assert [v.version for v in open_registry(url).versions("sentiment")] == [1]  # made, not confirmed
    settings = ServerSettings(registry=url, model=str(tiny_bert_dir), device="cpu", slots=8, redis_min_replicas=1)
    with TestClient(create_app(settings)) as client:
        r = client.post("/tasks", files={"patch": ("p.safetensors", make_patch(tiny_encoder, seed=2).data)})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "Check whether it is there before retrying" in r.json()["detail"]
        assert client.get("/tasks/sentiment").json()["current"] == 2
        r = client.post(
            "/jobs",
            files={"train": ("t.jsonl", b'{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')},
            data={"config": '{"task": "t"}'},
        )
        assert r.status_code == 503 and "0 of the 1 replica(s)" in r.json()["detail"], r.text
    with pytest.raises(RegistryError, match="needs a Redis registry"):
        open_registry(f"disk://{tiny_bert_dir}/reg", min_replicas=1)


def test_a_write_and_its_wait_never_straddle_two_connections(tmp_path):
    """Had the primary died between a write and its WAIT, a WAIT sent again on a new connection -- to whatever
    answers at that address now, with a replica of its own -- would find no write of its own to wait for and
    answer at once with that replica, acknowledging a write no replica holds. It must fail instead."""
    import subprocess

    from patchserve.patches.store.redis_client import DurableWrites
    from tests.helpers import start_redis

    primary, url = start_redis(tmp_path)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    replica, _ = start_redis(tmp_path, "--replicaof", "127.0.0.1", str(port))
    successor: list[subprocess.Popen] = []
    durable = DurableWrites(url, 1, "test registry")

    def write_then_lose_the_primary(client: redis.Redis) -> str:
        client.set("acknowledged?", "only if a replica has it")
        primary.kill()
        primary.wait()
        successor.append(start_redis(tmp_path, port=port)[0])  # an empty server on that port; the replica follows it
        probe = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                if probe.info("replication").get("slave0", {}).get("state") == "online":
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the replica did not follow the new server"
            time.sleep(0.1)
        return "written"

    try:
        with pytest.raises(ReplicationError, match="may or may not"):
            durable.run(redis.Redis.from_url(url), write_then_lose_the_primary)
    finally:
        durable.close()
        for proc in [primary, replica, *successor]:
            proc.kill()
            proc.wait()
