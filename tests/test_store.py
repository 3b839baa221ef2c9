"""One suite for both registry backends (disk and a real redis-server)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchserve.patches.errors import (
    InvalidTaskNameError,
    RegistryError,
    RegistryUnavailableError,
    TaskNotFoundError,
    VersionNotFoundError,
)
from patchserve.patches.format import Patch
from patchserve.patches.patch_file import content_id
from patchserve.patches.store import Change, DiskRegistry, open_registry
from patchserve.patches.store.base import page_names
from patchserve.patches.store.redis import RedisRegistry
from patchserve.patches.store.redis_client import parse_redis_url
from patchserve.patches.stored_patch import StoredPatch
from tests.helpers import make_patch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def patches_abc(tiny_encoder):
    return [make_patch(tiny_encoder, seed=s) for s in (1, 2, 3)]


def _state(reg):
    """Everything observable about a registry, for 'unchanged' assertions."""
    return reg.generation(), reg.snapshot(), {t: reg.versions(t) for t in reg.tasks()}


def test_put_get_versions_round_trip(registry, patches_abc):
    a, b, _ = patches_abc
    v1 = registry.put(a)
    assert (v1.task, v1.version, v1.patch_id, v1.size) == ("sentiment", 1, a.patch_id, len(a.data))
    info, got = registry.get("sentiment")
    assert info == v1 and got.data == a.data
    # read without its tensors: metadata and shapes from the header, the tensors parsed on first use
    assert isinstance(got, StoredPatch) and not got.loaded and got.shapes == a.shapes and got.meta == a.meta
    assert torch.equal(got.head_weight, a.head_weight) and got.loaded
    assert got.biases.keys() == a.biases.keys() and all(torch.equal(got.biases[k], a.biases[k]) for k in a.biases)
    v2 = registry.put(b)
    assert v2.version == 2 and registry.info("sentiment") == v2
    assert registry.get("sentiment")[1].patch_id == b.patch_id
    assert registry.get("sentiment", 1)[1].patch_id == a.patch_id
    assert [v.version for v in registry.versions("sentiment")] == [1, 2]
    assert registry.tasks() == ["sentiment"]
    assert registry.snapshot() == {"sentiment": v2}


def test_rollback_and_roll_forward(registry, patches_abc):
    a, b, _ = patches_abc
    registry.put(a)
    registry.put(b)
    back = registry.set_current("sentiment", 1)
    assert back.patch_id == a.patch_id and registry.info("sentiment").version == 1
    assert registry.get("sentiment")[1].patch_id == a.patch_id
    registry.set_current("sentiment", 2)
    assert registry.get("sentiment")[1].patch_id == b.patch_id
    # the next put continues numbering after the highest version, whatever is current
    registry.set_current("sentiment", 1)
    assert registry.put(a).version == 3


def test_delete(registry, patches_abc, tiny_encoder):
    registry.put(patches_abc[0])
    registry.put(make_patch(tiny_encoder, task="other"))
    registry.delete("sentiment")
    assert registry.tasks() == ["other"]
    for call in (
        lambda: registry.get("sentiment"),
        lambda: registry.info("sentiment"),
        lambda: registry.versions("sentiment"),
        lambda: registry.delete("sentiment"),
        lambda: registry.set_current("sentiment", 1),
    ):
        with pytest.raises(TaskNotFoundError, match="not registered"):
            call()
    assert registry.put(patches_abc[1]).version == 1  # a re-created task starts afresh


def test_bad_requests_leave_the_registry_unchanged(registry, patches_abc):
    registry.put(patches_abc[0])
    before = _state(registry)
    with pytest.raises(VersionNotFoundError, match=r"versions are \[1\]"):
        registry.set_current("sentiment", 7)
    with pytest.raises(VersionNotFoundError):
        registry.get("sentiment", 3)
    with pytest.raises(TaskNotFoundError):
        registry.get("nope", 1)
    with pytest.raises(TaskNotFoundError):
        registry.delete("nope")
    for bad in ("../../etc/passwd", "a/b", "", "x" * 100):
        for call in (registry.get, registry.info, registry.versions, registry.delete):
            with pytest.raises(InvalidTaskNameError):
                call(bad)
    assert _state(registry) == before


def test_concurrent_puts_get_distinct_versions(registry, tiny_encoder):
    patches = [make_patch(tiny_encoder, seed=10 + i) for i in range(12)]
    got: list[int] = []
    lock = threading.Lock()

    def worker(chunk):
        for p in chunk:
            v = registry.put(p).version
            with lock:
                got.append(v)

    threads = [threading.Thread(target=worker, args=(patches[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 13))
    assert registry.info("sentiment").version == 12
    stored = {v.patch_id for v in registry.versions("sentiment")}
    assert stored == {p.patch_id for p in patches}


def test_reader_during_writes_sees_old_or_new_never_a_mix(registry, patches_abc):
    a, b, _ = patches_abc
    registry.put(a)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: set[str] = set()

    def read():
        while not stop.is_set():
            try:
                info, patch = registry.get("sentiment")  # get() checks the bytes against the recorded id
                assert patch.patch_id == info.patch_id
                seen.add(patch.patch_id)
            except BaseException as exc:
                errors.append(exc)
                return

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for i in range(40):
        registry.put(b if i % 2 == 0 else a)
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    assert seen <= {a.patch_id, b.patch_id} and seen


def _watch_in_thread(registry, stop):
    """Run ``registry.watch`` in a thread; returns (flat list of changes seen, thread), once watching."""
    seen: list[Change] = []
    ready = threading.Event()

    def run():
        it = registry.watch(stop, timeout=0.05)
        ready.set()
        for batch in it:
            seen.extend(batch)

    t = threading.Thread(target=run)
    t.start()
    ready.wait()
    return seen, t


def _until(pred, stop):
    for _ in range(400):
        if pred():
            return
        stop.wait(0.01)
    raise AssertionError("not seen in time")


def test_watch_reports_put_rollback_and_delete(registry, patches_abc):
    a, b, _ = patches_abc
    registry.put(a)
    stop = threading.Event()
    seen, t = _watch_in_thread(registry, stop)
    v2 = registry.put(b)
    _until(lambda: Change("sentiment", v2) in seen, stop)
    v1 = registry.set_current("sentiment", 1)
    _until(lambda: Change("sentiment", v1) in seen, stop)
    registry.delete("sentiment")
    _until(lambda: Change("sentiment", None) in seen, stop)
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive()


def test_generation_moves_on_every_change(registry, patches_abc):
    g0 = registry.generation()
    registry.put(patches_abc[0])
    g1 = registry.generation()
    registry.set_current("sentiment", 1)
    g2 = registry.generation()
    registry.delete("sentiment")
    assert len({g0, g1, g2, registry.generation()}) == 4
    assert registry.wait_for_change(g0, timeout=0.01) != g0


def test_disk_crash_mid_write_keeps_previous_version(tmp_path, patches_abc, monkeypatch):
    reg = DiskRegistry(tmp_path / "reg")
    a, b, c = patches_abc
    reg.put(a)
    import patchserve.patches.store.disk as disk

    real = disk.atomic_write

    def crash_on_manifest(path, data):
        if path.name == "manifest.json":
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(disk, "atomic_write", crash_on_manifest)
    with pytest.raises(OSError):
        reg.put(b)  # the patch file was written, the manifest never named it
    monkeypatch.setattr(disk, "atomic_write", real)
    assert reg.get("sentiment")[1].patch_id == a.patch_id
    assert [v.version for v in reg.versions("sentiment")] == [1]
    assert not list((tmp_path / "reg" / "tasks" / "sentiment").glob(".*.tmp"))
    v = reg.put(c)  # the orphan v2 file is overwritten, not served
    assert v.version == 2 and reg.get("sentiment")[1].patch_id == c.patch_id


# A child process that makes one registry change and dies (os._exit: no finally, no cleanup, as under kill -9)
# right before its CRASH_AT-th rename. put renames the patch file, the manifest, then GENERATION; rollback the
# manifest, then GENERATION; delete the task folder (into trash), then GENERATION.
_CRASHING_CHILD = """
import os, sys
from patchserve.patches.format import Patch
from patchserve.patches.store.disk import DiskRegistry
root, op, crash_at, patch_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
reg = DiskRegistry(root)
renames, real = [0], os.replace
def replace(src, dst):
    renames[0] += 1
    if renames[0] == crash_at:
        os._exit(9)
    real(src, dst)
os.replace = replace
{"put": lambda: reg.put(Patch.read(patch_file)), "rollback": lambda: reg.set_current("sentiment", 1),
 "delete": lambda: reg.delete("sentiment")}[op]()
os._exit(0)
"""


@pytest.mark.parametrize(
    "op, crash_at, visible",
    [
        ("put", 1, False),  # the patch file half-written (a stray temporary file)
        ("put", 2, False),  # the patch file in place, no manifest names it (an orphan)
        ("put", 3, True),  # the manifest names v3, the generation never moved
        ("rollback", 1, False),
        ("rollback", 2, True),
        ("delete", 1, False),
        ("delete", 2, True),
    ],
)
def test_disk_registry_is_safe_at_every_crash_point_for_watchers_too(tmp_path, patches_abc, op, crash_at, visible):
    root = tmp_path / "reg"
    reg = DiskRegistry(root, poll_interval=0.02)
    a, b, c = patches_abc
    reg.put(a), reg.put(b)
    before = reg.snapshot()
    patch_file = tmp_path / "c.safetensors"
    patch_file.write_bytes(c.data)
    stop, seen = threading.Event(), []
    changes = reg.watch(stop, timeout=0.05)  # a running server's watcher, started before the crash
    watcher = threading.Thread(target=lambda: [seen.extend(batch) for batch in changes])
    watcher.start()
    try:
        args = [sys.executable, "-c", _CRASHING_CHILD, str(root), op, str(crash_at), str(patch_file)]
        child = subprocess.run(args, cwd=ROOT, capture_output=True, timeout=120)
        assert child.returncode == 9, child.stderr.decode()
        after = reg.snapshot()
        assert (after != before) == visible
        if visible:  # the watcher learns of it although its writer died before announcing it
            expected = [Change("sentiment", after.get("sentiment"))]
            deadline = time.monotonic() + 10
            while seen != expected:
                assert time.monotonic() < deadline, f"the watcher saw {seen}, not {expected}"
                time.sleep(0.02)
    finally:
        stop.set()
        watcher.join(timeout=10)
    # opening the registry (a restart) clears what the crash left: temporary files, orphan patch files, markers
    reopened = DiskRegistry(root)
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert not list((root / "pending").iterdir())
    if "sentiment" in reopened.tasks():
        files = sorted(p.name for p in (root / "tasks" / "sentiment").glob("*.safetensors"))
        assert files == [f"v{v.version:08d}.safetensors" for v in reopened.versions("sentiment")]
    assert reopened.snapshot() == after
    next_version = {("delete", True): 1, ("put", True): 4}.get((op, visible), 3)
    assert reopened.put(c).version == next_version and reopened.get("sentiment")[1].patch_id == c.patch_id


_PUTTING_CHILD = """
import sys
from patchserve.patches.format import Patch
from patchserve.patches.store.disk import DiskRegistry
reg, patch = DiskRegistry(sys.argv[1]), Patch.read(sys.argv[2])
while True:
    print(reg.put(patch).version, flush=True)
"""


def test_kill_9_during_registrations_loses_no_acknowledged_version(tmp_path, patches_abc):
    root, patch_file = tmp_path / "reg", tmp_path / "a.safetensors"
    patch_file.write_bytes(patches_abc[0].data)
    acknowledged: list[int] = []
    rng = random.Random(0)
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", _PUTTING_CHILD, str(root), str(patch_file)], cwd=ROOT, stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        for _ in range(rng.randint(1, 40)):  # killed somewhere inside a later put
            acknowledged.append(int(child.stdout.readline()))
        child.kill()
        child.wait(timeout=10)
    reg = DiskRegistry(root)
    stored = [v.version for v in reg.versions("sentiment")]
    assert set(acknowledged) <= set(stored) and stored == list(range(1, len(stored) + 1))
    for v in stored:
        assert reg.get("sentiment", v)[1].patch_id == patches_abc[0].patch_id
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")] and not list((root / "pending").iterdir())


def _encoded_otherwise(data: bytes) -> bytes:
    """``data`` (a patch's canonical bytes) as another writer could have encoded it: the same tensors and
    metadata, the safetensors header's keys in the opposite order."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(dict(reversed(header.items()))).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def test_a_patch_is_served_as_stored_under_its_recorded_id(registry, patches_abc):
    """What a registry holds is read as it is: bytes another writer encoded otherwise (an older safetensors, say)
    keep the id they were recorded under, and are neither refused as damaged nor encoded again."""
    other = _encoded_otherwise(patches_abc[0].data)
    assert other != patches_abc[0].data and Patch.from_bytes(other).patch_id == patches_abc[0].patch_id
    info = registry.put(Patch.from_bytes(other, patch_id=content_id(other)))
    assert info.patch_id == content_id(other) != patches_abc[0].patch_id
    got_info, got = registry.get(info.task)
    assert got_info == info and got.patch_id == info.patch_id and got.data == other
    assert torch.equal(got.head_weight, patches_abc[0].head_weight)


def test_disk_detects_a_damaged_patch_file(tmp_path, patches_abc):
    reg = DiskRegistry(tmp_path / "reg")
    reg.put(patches_abc[0])
    f = tmp_path / "reg" / "tasks" / "sentiment" / "v00000001.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="damaged"):
        reg.get("sentiment")


def test_redis_prefixes_isolate_deployments(redis_url, patches_abc):
    one = RedisRegistry(redis_url, prefix="iso-one:")
    two = RedisRegistry(redis_url + "?prefix=iso-two:")
    one.put(patches_abc[0])
    assert two.tasks() == [] and one.tasks() == ["sentiment"]
    one.delete("sentiment")


def test_redis_unreachable_is_a_clear_error():
    reg = RedisRegistry("redis://127.0.0.1:1/0")
    with pytest.raises(RegistryUnavailableError, match="unreachable"):
        reg.ping()
    with pytest.raises(RegistryUnavailableError):
        reg.tasks()


def test_open_registry_urls(tmp_path, redis_url):
    assert isinstance(open_registry(f"disk://{tmp_path}/a"), DiskRegistry)
    assert isinstance(open_registry(str(tmp_path / "b")), DiskRegistry)
    reg = open_registry(redis_url + "?prefix=x:")
    assert isinstance(reg, RedisRegistry) and reg.keys.prefix == "x:"
    with pytest.raises(RegistryError, match="unknown registry URL scheme"):
        open_registry("s3://bucket/x")
    assert parse_redis_url("redis://h:1/2?prefix=p:") == ("redis://h:1/2", "p:")


@pytest.fixture
def redis_registry(redis_url):
    reg = RedisRegistry(redis_url, prefix=f"log-{random.getrandbits(32):08x}:")
    yield reg
    reg.close()


def _count_snapshots(reg, monkeypatch) -> list[int]:
    """A spy on ``reg.snapshot``: each call appends to the list, then reads."""
    snapshots: list[int] = []
    real = reg.snapshot
    monkeypatch.setattr(reg, "snapshot", lambda: snapshots.append(1) or real())
    return snapshots


def test_watchers_read_only_the_tasks_the_change_log_names(registry, tiny_encoder, monkeypatch):
    reg = registry
    for i in range(20):
        reg.put(make_patch(tiny_encoder, f"t{i}", seed=i + 1))
    snapshots = _count_snapshots(reg, monkeypatch)
    stop = threading.Event()
    seen, t = _watch_in_thread(reg, stop)
    v2 = reg.put(make_patch(tiny_encoder, "t3", seed=99))
    _until(lambda: Change("t3", v2) in seen, stop)
    v1 = reg.set_current("t3", 1)  # (read in one batch with the put, t3 would be unchanged: nothing to report)
    _until(lambda: Change("t3", v1) in seen, stop)
    reg.delete("t7")
    new = reg.put(make_patch(tiny_encoder, "fresh", seed=100))
    _until(lambda: Change("fresh", new) in seen and Change("t7", None) in seen, stop)
    stop.set()
    t.join(timeout=5)
    assert seen == [Change("t3", v2), Change("t3", v1), Change("t7", None), Change("fresh", new)] or seen == [
        Change("t3", v2),
        Change("t3", v1),
        Change("fresh", new),
        Change("t7", None),
    ]
    assert snapshots == [1]  # the watch's starting snapshot only: every change after it was read from the log


def test_redis_watcher_diffs_a_snapshot_when_the_log_cannot_say(redis_registry, tiny_encoder, monkeypatch):
    reg = redis_registry
    v1 = reg.put(make_patch(tiny_encoder, "a", seed=1))
    reg.put(make_patch(tiny_encoder, "a", seed=2))
    snapshots = _count_snapshots(reg, monkeypatch)
    stop = threading.Event()
    seen, t = _watch_in_thread(reg, stop)
    # a rollback written the way a version without the log writes it: the state and the generation, no log entry;
    # only a diff of everything can find it
    with reg.r.pipeline(transaction=True) as pipe:
        pipe.hset(reg.keys.task("a"), "current", 1)
        pipe.incr(reg.keys.generation)
        pipe.execute()
    _until(lambda: Change("a", v1) in seen, stop)
    stop.set()
    t.join(timeout=5)
    assert len(snapshots) == 2  # the starting one, and the diff that found the rollback


def test_disk_watcher_diffs_a_snapshot_when_the_log_cannot_say(tmp_path, tiny_encoder, monkeypatch):
    from patchserve.patches.store.disk import atomic_write

    reg = DiskRegistry(tmp_path / "reg", poll_interval=0.02)
    v1 = reg.put(make_patch(tiny_encoder, "a", seed=1))
    reg.put(make_patch(tiny_encoder, "a", seed=2))
    snapshots = _count_snapshots(reg, monkeypatch)
    stop = threading.Event()
    seen, t = _watch_in_thread(reg, stop)
    # a rollback written the way a version without the log writes it: the manifest and the generation, no line
    manifest = json.loads((tmp_path / "reg" / "tasks" / "a" / "manifest.json").read_bytes())
    reg._write_manifest("a", manifest | {"current": 1})
    atomic_write(tmp_path / "reg" / "GENERATION", str(reg.generation() + 1).encode())
    _until(lambda: Change("a", v1) in seen, stop)
    stop.set()
    t.join(timeout=5)
    assert len(snapshots) == 2  # the starting one, and the diff that found the rollback


def test_disk_change_log_keeps_its_newer_half_and_says_when_a_watcher_fell_behind(tmp_path, tiny_encoder, monkeypatch):
    from patchserve.patches.store import disk

    monkeypatch.setattr(disk, "CHANGE_LOG_MAX_BYTES", 400)
    reg = DiskRegistry(tmp_path / "reg")
    patch = make_patch(tiny_encoder, "t", seed=1)
    log = tmp_path / "reg" / disk.CHANGE_LOG
    n = iter(range(10_000))

    def put() -> str:
        name = f"t{next(n):04d}"
        reg.put(make_patch_for(patch, name))
        return name

    gen, cursor = reg.change_cursor()
    names = {put() for _ in range(5)}
    assert reg.changed_tasks(gen, cursor)[2] == names
    while log.stat().st_size <= 400 - 8:  # the next line rewrites the log: a new file, its newer half
        put()
    inode = log.stat().st_ino
    gen, cursor = reg.change_cursor()
    names = {put() for _ in range(3)}
    assert log.stat().st_ino != inode and log.stat().st_size <= 400
    assert reg.changed_tasks(gen, cursor)[2] == names  # read from the new file, still exact
    assert log.read_bytes().split(b"\n")[0].split(b" ")[1].startswith(b"t")  # it starts at a whole line
    gen, cursor = reg.change_cursor()
    for _ in range(100):  # more than the log keeps
        put()
    new_gen, _, touched = reg.changed_tasks(gen, cursor)
    assert new_gen == gen + 100 and touched is None  # the watcher diffs a snapshot instead


# --- retention ---------------------------------------------------------------------------------------------------
def _kept(reg, task="sentiment"):
    return [v.version for v in reg.versions(task)]


def test_retention_keeps_the_newest_n_and_the_current_one(registry, patches_abc):
    registry.retired_grace_s = 0.0  # no replica to wait for: only the count and the current version count
    for _ in range(6):
        registry.put(patches_abc[0])
    registry.set_current("sentiment", 2)  # rolled back to an old version
    state = _state(registry)
    would = registry.prune("sentiment", 3, dry_run=True)
    assert [v.version for v in would] == [1, 3] and _state(registry) == state  # a dry run changes nothing
    gen = registry.generation()
    gone = registry.prune("sentiment", 3)
    assert gone == would and _kept(registry) == [2, 4, 5, 6]
    assert registry.generation() == gen and registry.info("sentiment").version == 2  # watchers see nothing
    assert registry.get("sentiment", 4)[1].patch_id == patches_abc[0].patch_id
    with pytest.raises(VersionNotFoundError):
        registry.get("sentiment", 1)
    assert registry.prune("sentiment", 3) == []
    registry.set_current("sentiment", 6)
    assert [v.version for v in registry.prune("sentiment", 3)] == [2]  # no longer current: it goes too
    assert registry.put(patches_abc[1]).version == 7  # numbers are never reused
    with pytest.raises(TaskNotFoundError):
        registry.prune("nope", 3)


def test_retention_keeps_what_a_replica_may_still_serve(registry, patches_abc):
    """Within the grace period a version stays if it was registered or current then, whatever the count."""
    registry.retired_grace_s = 1.0
    for _ in range(5):
        registry.put(patches_abc[0])
    assert registry.prune("sentiment", 1) == []  # all registered just now
    time.sleep(1.2)
    registry.set_current("sentiment", 2)  # v5 stops being current now
    registry.set_current("sentiment", 3)  # and v2
    assert [v.version for v in registry.prune("sentiment", 1)] == [1, 4]  # 5 newest, 3 current, 2 current just now
    time.sleep(1.2)
    assert [v.version for v in registry.prune("sentiment", 1)] == [2]
    assert _kept(registry) == [3, 5]


def test_keep_versions_prunes_after_every_registration(registry, patches_abc):
    """1,000 registrations over 3 tasks with --keep-versions 3: never more than 3 versions a task, plus a current
    older one; every current version readable throughout."""
    registry.retired_grace_s, registry.keep_versions = 0.0, 3
    tasks = ["a", "b", "c"]
    patches = {t: make_patch_for(patches_abc[0], t) for t in tasks}
    for i in range(1000):
        task = tasks[i % 3]
        info = registry.put(patches[task])
        if i == 500:
            registry.set_current("a", registry.info("a").version - 2)  # an older version current for a while
        assert len(registry.versions(task)) <= 4
        assert registry.get(task)[0].version == registry.info(task).version
    for task in tasks:
        versions = _kept(registry, task)
        assert versions == list(range(versions[-1] - 2, versions[-1] + 1)), versions
    assert info.version == 334  # the last of 1,000 went to "a"


def make_patch_for(patch, task):
    from dataclasses import replace

    from patchserve.patches.format import Patch

    return Patch(replace(patch.meta, task=task), patch.biases, patch.head_weight, patch.head_bias)


def test_patchserve_prune_dry_run_then_for_real(tmp_path, patches_abc, capsys):
    from patchserve.__main__ import main

    reg = DiskRegistry(tmp_path / "reg")
    for patch in (patches_abc[0], make_patch_for(patches_abc[0], "other")):
        for _ in range(4):
            reg.put(patch)
    url = f"disk://{tmp_path / 'reg'}"
    assert main(["prune", "--registry", url]) == 2
    assert "--keep-versions N" in capsys.readouterr().err
    assert main(["prune", "--registry", url, "--keep-versions", "1", "--dry-run"]) == 0
    assert "would delete 0 versions of 0 tasks" in capsys.readouterr().out  # all registered in the last 10 minutes
    args = ["prune", "--registry", url, "--keep-versions", "1", "--grace-s", "0"]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "other: would delete v1, v2, v3" in out and "sentiment: would delete v1, v2, v3" in out
    assert "would delete 6 versions of 2 tasks" in out and _kept(reg) == [1, 2, 3, 4]
    assert main([*args, "--task", "other", "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)["other"]] == [1, 2, 3]
    assert _kept(reg, "other") == [4] and _kept(reg) == [1, 2, 3, 4]
    assert main([*args]) == 0
    assert "deleted 3 versions of 1 tasks" in capsys.readouterr().out and _kept(reg) == [4]
    assert sorted(p.name for p in (tmp_path / "reg" / "tasks" / "sentiment").iterdir()) == [
        "manifest.json",
        "v00000004.safetensors",
    ]


def test_a_retired_patch_type_is_named_with_what_to_do_and_prune_unservable_removes_it(
    registry, patches_abc, tiny_encoder
):
    """A registry written by an earlier release may hold a bitfit-ln patch, a type this build no longer serves:
    reading it is a clear error naming the task, version and patch id and saying what to do; prune's ``also``
    deletes it (unservable() finds it), never the current version."""
    from patchserve.patches.errors import RetiredPatchTypeError
    from tests.helpers import retired_patch

    old = retired_patch(tiny_encoder)
    registry.put(patches_abc[0])
    registry.put(old)  # v2
    registry.put(patches_abc[1])  # v3, current
    with pytest.raises(RetiredPatchTypeError) as exc:
        registry.get("sentiment", 2)
    message = str(exc.value)
    assert f"'sentiment' v2 ({old.patch_id})" in message and "'bitfit-ln'" in message
    assert "retrain the task" in message and "roll back" in message and "prune --unservable" in message
    assert [v.version for v in registry.unservable("sentiment")] == [2]
    registry.retired_grace_s = 0.0
    assert registry.prune("sentiment", None, also=[2], dry_run=True)[0].version == 2 and _kept(registry) == [1, 2, 3]
    assert [v.version for v in registry.prune("sentiment", None, also=[2])] == [2]
    assert _kept(registry) == [1, 3] and registry.unservable("sentiment") == []
    registry.put(old)  # v4, current: never pruned
    assert registry.prune("sentiment", None, also=[4]) == [] and _kept(registry) == [1, 3, 4]
    with pytest.raises(RetiredPatchTypeError, match="'sentiment' v4"):
        registry.get("sentiment")


def test_patchserve_prune_unservable_deletes_retired_versions_and_names_a_current_one(
    tmp_path, patches_abc, tiny_encoder, capsys
):
    from patchserve.__main__ import main
    from tests.helpers import retired_patch

    reg = DiskRegistry(tmp_path / "reg")
    reg.put(retired_patch(tiny_encoder))  # v1
    reg.put(patches_abc[0])  # v2
    reg.put(retired_patch(tiny_encoder, "other"))  # other v1, current
    args = ["prune", "--registry", f"disk://{tmp_path / 'reg'}", "--grace-s", "0", "--unservable"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "sentiment: deleted v1" in captured.out and "deleted 1 versions of 1 tasks" in captured.out
    assert "other: v1 is current and this build cannot serve it; retrain the task or roll back" in captured.err
    assert _kept(reg) == [2] and _kept(reg, "other") == [1]


def _all_pages(reg, limit, prefix=""):
    pages, after = [], None
    while True:
        page = reg.page(limit, after=after, prefix=prefix)
        pages.append([i.task for i in page.items])
        if page.next_after is None:
            return pages
        assert page.next_after == page.items[-1].task
        after = page.next_after


def test_paged_listing_by_name_prefix_and_a_cursor_that_survives_changes(registry, patches_abc):
    names = [f"{p}-{i:02d}" for p in ("alpha", "beta", "beta2", "gamma") for i in range(5)]
    for i, name in enumerate(names):
        registry.put(make_patch_for(patches_abc[i % 3], name))
    assert [t for p in _all_pages(registry, 7) for t in p] == sorted(names)
    assert [len(p) for p in _all_pages(registry, 7)] == [7, 7, 6]
    assert _all_pages(registry, 10) == [sorted(names)[:10], sorted(names)[10:]]  # a full last page says so
    assert _all_pages(registry, 3, prefix="beta") == [
        ["beta-00", "beta-01", "beta-02"],
        ["beta-03", "beta-04", "beta2-00"],
        ["beta2-01", "beta2-02", "beta2-03"],
        ["beta2-04"],
    ]
    assert _all_pages(registry, 3, prefix="delta") == [[]]
    page = registry.page(1, prefix="gamma")
    assert page.items == [registry.info("gamma-00")]  # each item is the task's current version record
    # the cursor stays valid: a task added behind it is not listed, one ahead of it is; a deleted one is left out
    first = registry.page(5)
    assert first.next_after == "alpha-04"
    registry.put(make_patch_for(patches_abc[0], "alpha-00a"))
    registry.put(make_patch_for(patches_abc[0], "alpha-05"))
    registry.delete("beta-00")
    rest = registry.page(4, after=first.next_after)
    assert [i.task for i in rest.items] == ["alpha-05", "beta-01", "beta-02", "beta-03"]
    # after a cursor before the prefix starts: from the prefix's first task
    assert [i.task for i in registry.page(2, after="alpha-02", prefix="gamma").items] == ["gamma-00", "gamma-01"]
    assert registry.page(2, after="zzz").items == []
    with pytest.raises(ValueError):
        registry.page(0)


def test_redis_builds_the_paging_index_for_a_registry_written_before_it(redis_registry, patches_abc):
    for i in range(12):
        redis_registry.put(make_patch_for(patches_abc[0], f"t{i:02d}"))
    redis_registry.r.delete(redis_registry.keys.task_names)  # as an older patchserve left it: the task set only
    reopened = RedisRegistry(redis_registry.url, prefix=redis_registry.keys.prefix)
    try:
        assert [t for p in _all_pages(reopened, 5) for t in p] == [f"t{i:02d}" for i in range(12)]
        assert reopened.r.zcard(reopened.keys.task_names) == 12
    finally:
        reopened.close()


@given(
    st.lists(st.text("abc", min_size=1, max_size=4), unique=True).map(sorted),
    st.none() | st.text("abc", max_size=4),
    st.text("abc", max_size=2),
    st.integers(1, 6),
)
def test_page_names_is_the_sorted_filter(names, after, prefix, count):
    expected = [n for n in names if n.startswith(prefix) and (after is None or n > after)][:count]
    assert page_names(names, after, prefix, count) == expected
