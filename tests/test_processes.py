"""``patchserve serve --workers N`` for real: an engine process and front-end processes under their supervisor.
Answers equal the one-process server's, hot swap reaches every front end, /metrics adds up every process, and the
faults: an engine killed under load (in-flight requests 503 at once, then it is back), a front end killed (replaced),
SIGTERM (in-flight requests finish), an engine that cannot start or keeps dying (non-zero exit)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from patchserve.patches.store import open_registry
from patchserve.server.app import create_app
from patchserve.server.engine.batcher import OverloadedError
from patchserve.server.engine.local import LocalEngine
from patchserve.server.engine.patch_cache import PatchCache
from patchserve.server.engine.process import EngineServer, engine_info
from patchserve.server.engine.protocol import Cancel, Row, encode
from patchserve.server.engine.remote import RemoteEngine
from patchserve.server.engine.rows import pack_requests
from patchserve.server.metrics import Metrics
from patchserve.server.settings import ServerSettings, available_cpus
from tests.helpers import free_port, make_patch, patchserve_process, wait_ready

TEXTS = ["the good movie", "a bad film", "the cat runs quickly", "what is the name of the city"]


@dataclass
class Server:
    base: str
    proc: object
    log: Path

    def pids(self, pattern: str) -> list[int]:
        return [int(p) for p in re.findall(pattern, self.log.read_text())]

    def engine_pid(self) -> int:
        return self.pids(r"engine ready \(pid (\d+)\)")[-1]

    def front_end_pids(self) -> list[int]:
        return self.pids(r"Started server process \[(\d+)\]")


def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            value = pred()
            if value:
                return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def multi(tmp_path: Path, model: Path, registry: str, *args: str) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    serve = ["serve", "--port", str(port), "--model", str(model), "--device", "cpu", "--registry", registry]
    with patchserve_process([*serve, "--workers", "2", "--slots", "8", *args], {}, log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc=proc)
        yield Server(base, proc, log)


@pytest.fixture
def registry_url(tmp_path, tiny_encoder) -> str:
    url = f"disk://{tmp_path}/registry"
    reg = open_registry(url)
    reg.put(make_patch(tiny_encoder, "sent", seed=1))
    reg.put(make_patch(tiny_encoder, "sts", kind="regression", seed=2, ia3_scale=0.3))  # a bitfit-ia3 patch
    reg.put(make_patch(tiny_encoder, "pos", kind="token-classification", seed=3))
    reg.put(make_patch(tiny_encoder, "lora", seed=4, lora_rank=4, pooling="cls"))  # a lora patch
    reg.close()
    return url


def _predict(base: str, task: str, inputs, timeout: float = 30, **kw) -> httpx.Response:
    return httpx.post(f"{base}/tasks/{task}/predict", json={"inputs": inputs, **kw}, timeout=timeout)


def test_front_ends_answer_as_the_one_process_server(tmp_path, tiny_bert_dir, tiny_encoder, registry_url):
    asks = [
        ("sent", TEXTS, {"all_scores": True}),
        ("sts", [{"text": t, "text_pair": "the film"} for t in TEXTS], {}),
        ("pos", TEXTS, {}),
        ("lora", TEXTS, {"all_scores": True}),
    ]
    settings = ServerSettings(registry=registry_url, model=str(tiny_bert_dir), device="cpu", slots=8)
    with TestClient(create_app(settings)) as client:
        expected = [client.post(f"/tasks/{t}/predict", json={"inputs": x, **kw}).json() for t, x, kw in asks]
        embedded = client.post("/embed", json={"inputs": TEXTS}).json()
    with multi(tmp_path, tiny_bert_dir, registry_url) as server:
        for (task, inputs, kw), want in zip(asks, expected, strict=True):
            for _ in range(4):  # new connections: either front end may answer
                got = _predict(server.base, task, inputs, **kw)
                assert got.status_code == 200, got.text
                assert _close(got.json(), want)
        got = httpx.post(f"{server.base}/embed", json={"inputs": TEXTS}, timeout=30).json()
        np.testing.assert_allclose(got["embeddings"], embedded["embeddings"], rtol=1e-5, atol=1e-6)
        # a front end checks a lora patch against the engine's LoRA sites, which it learns from the engine process
        lora = make_patch(tiny_encoder, "lora2", seed=5, lora_rank=2, lora_targets=("key", "intermediate.dense"))
        r = httpx.post(f"{server.base}/tasks", files={"patch": ("p.safetensors", lora.data)}, timeout=30)
        assert r.status_code == 201 and r.json()["patch_type"] == "lora", r.text
        # what serves, as the engine process told its front ends (the Info message)
        ready = httpx.get(f"{server.base}/readyz", timeout=10).json()
        assert (ready["family"], ready["engine"], ready["dtype"]) == ("bert", "packed", "float32")
        assert ready["patch_types"] == ["bitfit", "bitfit-ia3", "lora"]
        # on the CPU the engine's forward takes every core
        assert f"{available_cpus()} CPU threads" in server.log.read_text()


def _close(got, want) -> bool:
    """Equal JSON, numbers to float32 precision (a row's batch companions may change the last bits)."""
    if isinstance(want, dict):
        assert set(got) == set(want), (got, want)
        return all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        assert len(got) == len(want)
        return all(_close(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        return True
    assert got == want
    return True


def test_hot_swap_reaches_every_front_end_and_metrics_add_up(tmp_path, tiny_bert_dir, tiny_encoder, registry_url):
    with multi(tmp_path, tiny_bert_dir, registry_url, "--metrics-task-labels", "4") as server:
        base = server.base
        first = _predict(base, "sent", "the good movie").json()
        v2 = make_patch(tiny_encoder, "sent", seed=7)
        r = httpx.post(f"{base}/tasks", files={"patch": ("p.safetensors", v2.data)}, timeout=30)
        assert r.status_code == 201 and r.json()["version"] == 2
        # every front end (new connections land on either) serves v2 within the registry watcher's bound
        _until(lambda: all(_predict(base, "sent", "x").json()["version"] == 2 for _ in range(10)), 10, "v2 everywhere")
        r = httpx.post(f"{base}/tasks/sent/rollback", json={"version": 1}, timeout=30)
        assert r.status_code == 200
        _until(lambda: all(_predict(base, "sent", "x").json()["version"] == 1 for _ in range(10)), 10, "v1 again")
        assert _predict(base, "sent", "the good movie").json() == first

        def counted() -> float:
            text = httpx.get(f"{base}/metrics", timeout=10).text
            found = re.search(r'patchserve_requests_total\{status="200",task="sts"\} ([0-9.]+)', text)
            return float(found.group(1)) if found else 0.0

        def rows_run() -> float:
            text = httpx.get(f"{base}/metrics", timeout=10).text
            return float(re.search(r"patchserve_batch_rows_sum ([0-9.e+]+)", text).group(1))

        before = rows_run()
        for _ in range(24):  # one connection each: both front ends count some of them
            assert _predict(base, "sts", [{"text": "a", "text_pair": "b"}] * 2).status_code == 200
        assert counted() == 24  # the request counters of both front ends, summed
        assert rows_run() - before == 48  # the engine's batches, seen from whichever front end answers /metrics
        # the host tier of each process: each front end read each version it served once (a miss), then found it; the
        # engine parsed it once per version a front end sent
        text = httpx.get(f"{base}/metrics", timeout=10).text

        def tier(process: str, event: str) -> float:
            found = re.search(
                rf'patchserve_host_cache_events_total\{{event="{event}",process="{process}"\}} (\S+)', text
            )
            return float(found.group(1)) if found else 0.0

        assert 1 <= tier("front_end", "miss") <= 6 and tier("front_end", "hit") >= 24 - 2
        assert tier("engine", "miss") >= 1 and tier("engine", "hit") >= 1
        assert re.search(r'patchserve_host_cache_bytes\{process="engine"\} [1-9]', text)


def _load(base: str, stop: threading.Event, results: list[tuple[int, float, str]]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = client.post(f"{base}/tasks/sent/predict", json={"inputs": TEXTS})
                results.append((r.status_code, time.monotonic() - t0, r.text))
            except httpx.TransportError as exc:
                results.append((-1, time.monotonic() - t0, repr(exc)))


def test_an_engine_killed_under_load_fails_in_flight_requests_with_503_and_comes_back(
    tmp_path, tiny_bert_dir, registry_url
):
    with multi(tmp_path, tiny_bert_dir, registry_url, "--request-timeout-s", "20") as server:
        before = _predict(server.base, "sent", TEXTS).json()
        stop, results = threading.Event(), []
        threads = [threading.Thread(target=_load, args=(server.base, stop, results)) for _ in range(6)]
        for t in threads:
            t.start()
        _until(lambda: len(results) > 50, 30, "traffic")
        old = server.engine_pid()
        os.kill(old, signal.SIGKILL)
        _until(lambda: server.engine_pid() != old, 60, "a new engine process")
        _until(lambda: httpx.get(f"{server.base}/readyz", timeout=5).status_code == 200, 60, "ready again")
        served_after = len(results)
        _until(lambda: len(results) > served_after + 50, 30, "traffic after the restart")
        stop.set()
        for t in threads:
            t.join(60)
        statuses = [s for s, _, _ in results]
        refused = [text for s, _, text in results if s == 503]
        assert set(statuses) <= {200, 503}, [r for r in results if r[0] not in (200, 503)][:3]
        assert refused and all("engine process" in text for text in refused), refused[:3]
        assert max(seconds for _, seconds, _ in results) < 10, "a request waited for an engine that was gone"
        assert statuses[-50:] == [200] * 50
        assert _predict(server.base, "sent", TEXTS).json() == before
    assert "restarting the engine process" in server.log.read_text()


def test_a_killed_front_end_is_replaced(tmp_path, tiny_bert_dir, registry_url):
    with multi(tmp_path, tiny_bert_dir, registry_url) as server:
        pids = server.front_end_pids()
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        _until(lambda: len(server.front_end_pids()) == 3, 60, "a replacement front end")
        after_death = lambda: server.log.read_text().partition(f"front end {pids[0]} died")[2]  # noqa: E731
        _until(lambda: "Application startup complete" in after_death(), 60, "the replacement to start")
        for _ in range(20):
            assert _predict(server.base, "sent", "the good movie").status_code == 200


def test_sigterm_lets_in_flight_requests_finish(tmp_path, tiny_bert_dir, registry_url):
    long_text = " ".join(["the good movie"] * 30)
    with multi(tmp_path, tiny_bert_dir, registry_url, "--max-batch-rows", "1") as server:
        answers: list[httpx.Response] = []
        # 128 batches of one row each: a request that takes a while, and that stays inside the server's 30 s request
        # timeout and drain grace on a loaded machine (2 cores beside two niced busy loops: 13 ms a batch, 1 ms idle)
        big = [long_text] * 128

        def ask() -> None:  # the client waits longer than the server's grace: a cut request shows as a failure
            answers.append(_predict(server.base, "sent", big, timeout=120))

        def metric(name: str) -> float:
            text = httpx.get(f"{server.base}/metrics", timeout=10).text
            return float(re.search(rf"^{name} ([0-9.e+]+)", text, re.MULTILINE).group(1))

        def accepted() -> float:  # rows the engine has taken: one a batch done (batches of one row), or queued
            return metric("patchserve_batch_rows_count") - start + metric("patchserve_queue_rows")

        start = metric("patchserve_batch_rows_count")
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        # every request in flight (on a loaded machine a thread's request can still be on its way after 20
        # batches: refused with 503 once the server drains, as it should be), and work done on them
        _until(
            lambda: accepted() >= 4 * len(big) - 1 and metric("patchserve_batch_rows_count") > start + 20,
            60,
            "the requests to be running",
        )
        assert any(t.is_alive() for t in threads)
        os.killpg(server.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers if a.status_code != 200]
    assert all(len(a.json()["predictions"]) == len(big) for a in answers)


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: whoever reaps orphans here may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_supervisor_takes_its_engine_and_front_ends_with_it(tmp_path, tiny_bert_dir, registry_url):
    with multi(tmp_path, tiny_bert_dir, registry_url) as server:
        children = [server.engine_pid(), *server.front_end_pids()]
        os.kill(server.proc.pid, signal.SIGKILL)
        _until(lambda: all(_gone(pid) for pid in children), 60, "the engine and the front ends to exit")
    assert "the supervisor is gone" in server.log.read_text()


def test_an_engine_that_cannot_start_stops_serve_with_status_3(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with patchserve_process(["serve", "--port", str(port), "--model", "/no/such/model"], {}, log) as proc:
        assert proc.wait(60) == 3
    assert "does not exist" in log.read_text()


def test_an_engine_that_keeps_dying_stops_serve_with_status_1(tmp_path, tiny_bert_dir, registry_url):
    from patchserve.server.supervisor import MAX_ENGINE_DEATHS

    with multi(tmp_path, tiny_bert_dir, registry_url) as server:
        for _ in range(MAX_ENGINE_DEATHS + 1):
            old = server.engine_pid()
            os.kill(old, signal.SIGKILL)
            if server.proc.poll() is None:
                _until(lambda old=old: server.engine_pid() != old or server.proc.poll() is not None, 60, "a restart")
        assert server.proc.wait(60) == 1
    assert "died 6 times" in server.log.read_text()


@contextlib.asynccontextmanager
async def _engine_in_process(tmp_path: Path, settings: ServerSettings, cache: PatchCache):
    """The engine process's server on this event loop (an EngineServer over a LocalEngine) and a front end's
    RemoteEngine connected to it; both stopped on the way out."""
    from patchserve.patches.encoder import load_encoder

    encoder = load_encoder(settings.model)
    engine = LocalEngine(encoder, settings, Metrics())
    info = engine_info(engine, encoder.spec, encoder.source, encoder.max_positions, encoder.default_pooling)
    server = EngineServer(engine, encoder.spec, info, cache, settings.max_patch_bytes)
    address = f"ipc://{tmp_path}/engine"
    stop, bound = asyncio.Event(), asyncio.Event()
    engine.start()
    serving = asyncio.ensure_future(server.serve(address, stop, bound))
    await bound.wait()
    remote = RemoteEngine(address)
    await remote.connect(timeout=10)
    try:
        yield server, remote
    finally:
        await remote.close()
        stop.set()
        await serving
        await engine.stop()


def test_patches_travel_by_id_and_are_sent_again_when_the_engine_lacks_them(tmp_path, tiny_bert_dir, tiny_encoder):
    """The engine keeps a byte-bounded cache of the patches it was sent (here: room for one); a request for one it
    evicted is answered Missing, and the front end sends it again with the bytes."""
    from patchserve.patches.encoder import load_encoder

    patches = [make_patch(tiny_encoder, f"t{i}", seed=i + 1) for i in range(3)]
    settings = ServerSettings(model=str(tiny_bert_dir), device="cpu", slots=2)
    reference = LocalEngine(load_encoder(str(tiny_bert_dir)), settings, Metrics())
    ids = tiny_encoder.tokenizer(TEXTS)["input_ids"]

    def rows(patch):
        return [Row(list(i), [0] * len(i), patch) for i in ids]

    expected = {p.patch_id: [o.numpy().copy() for o in reference.runner.run(rows(p))] for p in patches}

    async def _travel(remote: RemoteEngine) -> list[str]:
        assert remote.info is not None and remote.info.fingerprint == tiny_encoder.spec.fingerprint
        sent: list[str] = []
        transmit = remote._transmit

        def spy(mid, msg):
            sent.extend(msg.patches)
            return transmit(mid, msg)

        remote._transmit = spy  # type: ignore[method-assign]
        for p in [*patches, patches[0], patches[0]]:
            outputs = await remote.run(rows(p))
            for got, want in zip(outputs, expected[p.patch_id], strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        return sent

    cache = PatchCache(1)

    async def scenario() -> list[str]:
        async with _engine_in_process(tmp_path, settings, cache) as (_, remote):
            return await _travel(remote)

    sent = asyncio.run(scenario())
    ids_sent = [p.patch_id for p in patches]
    # each once on first use; t0 again after the cache evicted it (Missing, then resent); then held
    assert sent == [*ids_sent, ids_sent[0]]
    # the engine's host tier: four parses (misses), the last request's patch held (a hit), three made room
    assert (cache.stats.misses, cache.stats.hits, cache.stats.evictions) == (4, 1, 3)


def test_requests_of_one_turn_go_out_as_one_message(tmp_path, tiny_bert_dir, tiny_encoder):
    """Requests a front end makes in one turn of its event loop travel as one message of arrays and come back as
    one: each gets its own rows' outputs (logits, embeddings, the base encoder's, tags), as the engine in process
    gives them; a cancelled request's rows are dropped while the others in its message are answered; and when the
    engine's queue has room for only the first requests of a message, the others are answered 503."""
    from patchserve.patches.encoder import load_encoder

    patches = [make_patch(tiny_encoder, f"t{i}", seed=i + 1) for i in range(3)]
    tagger = make_patch(tiny_encoder, "tags", seed=9, kind="token-classification")
    settings = ServerSettings(
        model=str(tiny_bert_dir), device="cpu", slots=8, max_queue_rows=24, max_inputs_per_request=4
    )
    reference = LocalEngine(load_encoder(str(tiny_bert_dir)), settings, Metrics())
    ids = tiny_encoder.tokenizer(TEXTS)["input_ids"]

    def rows(patch, output="logits"):
        return [Row(list(i), [0] * len(i), patch, output) for i in ids]

    requests = [rows(p) for p in patches] + [rows(tagger), rows(patches[0], "embedding"), rows(None, "embedding")]
    expected = [[o.numpy().copy() for o in reference.runner.run(r)] for r in requests]

    async def scenario():
        async with _engine_in_process(tmp_path, settings, PatchCache(2**20)) as (server, remote):
            return await _messages(server, remote)

    async def _messages(server: EngineServer, remote: RemoteEngine):
        messages: list[int] = []
        transmit = remote._transmit

        def spy(mid, msg):
            messages.append(len(msg.counts) // 4)
            return transmit(mid, msg)

        remote._transmit = spy  # type: ignore[method-assign]
        got = await asyncio.gather(*(remote.run(r) for r in requests))  # 6 requests, 4 rows each, one turn
        one_turn = list(messages)
        calls = [asyncio.ensure_future(remote.run(r)) for r in requests[:3]]
        await asyncio.sleep(0)  # the message is out; now the middle request's client goes away
        calls[1].cancel()
        kept = await asyncio.gather(calls[0], calls[2])
        # in the engine: a Cancel drops that request's rows of its message, and only those
        answers = []
        send = server._send
        server._send = lambda ident, msg: (
            answers.extend(getattr(msg, "items", [msg])) if ident == b"peer" else send(ident, msg)
        )
        server._on_messages([[b"peer", encode(pack_requests(100, requests[:3], {}))]])
        server._on_messages([[b"peer", encode(Cancel(101))]])
        await server._inflight[b"peer", 100].future
        dropped = np.concatenate([np.frombuffer(a.sizes, "<i4") for a in sorted(answers, key=lambda a: a.first)])
        assert sum(a.count for a in answers) == 3
        # the queue holds 24 rows: of 7 requests of 4 rows sent together, the first 6 are taken, the 7th refused
        tried = await asyncio.gather(*(remote.run(r) for r in [*requests, requests[0]]), return_exceptions=True)
        return got, one_turn, kept, tried, dropped

    got, one_turn, kept, tried, dropped = asyncio.run(scenario())
    assert [int(n > 0) for n in dropped] == [1] * 4 + [0] * 4 + [1] * 4
    assert one_turn == [6], "the requests of one turn did not go out as one message"
    for outputs, want in zip([*got, *kept], [*expected, expected[0], expected[2]], strict=True):
        for g, w in zip(outputs, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(t, Exception) for t in tried[:6]), tried
    assert isinstance(tried[6], OverloadedError), tried[6]


def test_messages_that_arrive_together_run_as_one_job_and_each_front_end_gets_one_answer(
    tmp_path, tiny_bert_dir, tiny_encoder
):
    """Every message the engine's socket holds when its loop gets to it is queued as one job (its Python work grows
    with the turns that brought messages, not with each message), and a batch's answers for one front end go out as
    one message (``Answers``). Each message is still answered as its own: its requests' outputs as the
    engine in process gives them; a malformed one 400 and the others unharmed; the queue's room cut across messages
    (the first requests taken, the rest refused); a Cancel after its request in the same batch drops its rows."""
    import msgspec

    from patchserve.patches.encoder import load_encoder
    from patchserve.server.engine import remote as remote_module
    from patchserve.server.engine.protocol import Failed, Results
    from patchserve.server.engine.rows import unpack_results

    patches = [make_patch(tiny_encoder, f"t{i}", seed=i + 1) for i in range(3)]
    settings = ServerSettings(
        model=str(tiny_bert_dir), device="cpu", slots=8, max_queue_rows=14, max_inputs_per_request=4
    )
    reference = LocalEngine(load_encoder(str(tiny_bert_dir)), settings, Metrics())
    ids = tiny_encoder.tokenizer(TEXTS)["input_ids"]

    def rows(patch, n=4, output="logits"):
        return [Row(list(i), [0] * len(i), patch, output) for i in ids[:n]]

    def want(requests):
        return np.concatenate([o.numpy().ravel() for r in requests for o in reference.runner.run(r)])

    a1 = [rows(patches[0]), rows(None, 2, "embedding")]  # 6 rows
    b1 = [rows(patches[1], 3)]  # 3 rows
    a2 = [rows(patches[2], 2), rows(patches[0], 3), rows(patches[1], 1)]  # the queue has room for the first 5 rows
    bad = msgspec.structs.replace(pack_requests(30, [rows(patches[2])], {}), counts=np.array([5], "<i4").tobytes())
    cache = PatchCache(2**20)
    for p in patches:
        cache.put(p)  # held: no bytes travel

    async def scenario():
        async with _engine_in_process(tmp_path, settings, cache) as (server, remote):
            sent: list[tuple[bytes, list]] = []
            send, max_rows = server._send, remote_module.MAX_MESSAGE_ROWS
            server._send = lambda ident, msg: sent.append((ident, list(getattr(msg, "items", [msg]))))
            batch = [(b"a", pack_requests(10, a1, {})), (b"b", pack_requests(20, b1, {})), (b"b", bad)]
            batch.append((b"a", pack_requests(40, a2, {})))
            server._on_messages([[ident, encode(msg)] for ident, msg in batch])
            queued = [len(job.block) for job in server.engine.batcher._queue]
            await asyncio.gather(server._inflight[b"a", 10].future)
            before = len(sent)
            server._on_messages(
                [[b"c", encode(pack_requests(50, [rows(patches[0], 2)] * 2, {}))], [b"c", encode(Cancel(51))]]
            )
            await server._inflight[b"c", 50].future
            # two jobs of one front end in one batch: still one message to it
            server._on_messages([[b"d", encode(pack_requests(60, b1, {}))]])
            server._on_messages([[b"d", encode(pack_requests(70, b1, {}))]])
            two_jobs = len(sent)
            await server._inflight[b"d", 70].future
            # a real front end, two messages in one turn (a message's row cap is 4 here), both in the engine's
            # socket before its loop looks: one Answers of two, which the front end takes answer by answer
            together: list[int] = []
            server._send = lambda ident, msg: (together.append(len(getattr(msg, "items", [msg]))), send(ident, msg))
            loop, channel = asyncio.get_running_loop(), server._channel
            remote_module.MAX_MESSAGE_ROWS = 4
            loop.remove_reader(channel._fd)
            try:
                calls = asyncio.gather(*(remote.run(r) for r in a2[:2]))
                await asyncio.sleep(0.2)  # both sent and delivered
                loop.add_reader(channel._fd, channel._drain)
                channel._drain()
                over_remote = await calls
            finally:
                remote_module.MAX_MESSAGE_ROWS = max_rows
            return queued, sent[:before], sent[before:two_jobs], sent[two_jobs:], together, over_remote

    queued, sent, cancelled, two_jobs, together, over_remote = asyncio.run(scenario())
    assert [(ident, [m.id for m in msgs]) for ident, msgs in two_jobs] == [(b"d", [60, 70])]
    assert together == [2]
    for outputs, requests in zip(over_remote, a2[:2], strict=True):
        np.testing.assert_allclose(np.concatenate([o.ravel() for o in outputs]), want([requests]), rtol=1e-5, atol=1e-5)
    assert queued == [14], "the messages that arrived together were not queued as one job"
    failed = [(ident, m) for ident, msgs in sent for m in msgs if isinstance(m, Failed)]
    assert [(ident, m.id, m.status) for ident, m in failed] == [(b"b", 30, 400)]
    answers = [(ident, msgs) for ident, msgs in sent if not isinstance(msgs[0], Failed)]
    assert sorted(ident for ident, _ in answers) == [b"a", b"b"], "one message a front end for the batch"
    got = {m.id: m for _, msgs in answers for m in msgs}
    assert sorted(got) == [10, 20, 40]
    assert [(got[i].first, got[i].count, got[i].refused) for i in (10, 20, 40)] == [(0, 2, 0), (0, 1, 0), (0, 2, 1)]
    for i, requests in ((10, a1), (20, b1), (40, a2[:2])):
        np.testing.assert_allclose(unpack_results(got[i]).data, want(requests), rtol=1e-5, atol=1e-5)
    results = [m for _, msgs in cancelled for m in msgs if isinstance(m, Results)]
    sizes = np.concatenate([np.frombuffer(m.sizes, "<i4") for m in sorted(results, key=lambda m: m.first)])
    assert [int(n > 0) for n in sizes] == [1, 1, 0, 0], "the Cancel behind its request did not drop its rows"


def test_default_front_ends_and_engine_threads_follow_the_cores(monkeypatch):
    import patchserve.server.settings as settings_module

    cores = (1, 2, 3, 4, 8, 16, 64)
    assert [settings_module.default_workers(True, n) for n in cores] == [1, 2, 3, 4, 8, 8, 8]
    assert [settings_module.default_workers(False, n) for n in cores] == [1] * len(cores)
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 16)
    s = ServerSettings()
    assert (s.front_ends(True), s.forward_threads(True)) == (8, 8)  # GPU: the cores the front ends leave
    assert (s.front_ends(False), s.forward_threads(False)) == (1, 16)  # CPU: the forward takes every core
    assert ServerSettings(workers=3).forward_threads(True) == 13
    assert ServerSettings(workers=0).front_ends(True) == 0
    assert ServerSettings(workers=3, engine_threads=2).forward_threads(False) == 2


def test_batch_rows_default_to_the_device(tiny_bert_dir):
    """32 rows a batch on the CPU, 256 on a GPU, unless --max-batch-rows says; the engine built here (CPU) uses it."""
    from patchserve.patches.encoder import load_encoder

    s = ServerSettings()
    assert (s.batch_rows(False), s.batch_rows(True)) == (32, 256)
    assert ServerSettings(max_batch_rows=7).batch_rows(True) == 7
    engine = LocalEngine(load_encoder(str(tiny_bert_dir)), ServerSettings(device="cpu"), Metrics())
    assert engine.batcher.max_rows == 32
    engine = LocalEngine(load_encoder(str(tiny_bert_dir)), ServerSettings(device="cpu", max_batch_rows=5), Metrics())
    assert engine.batcher.max_rows == 5


def test_settings_reach_the_child_processes_as_they_were(monkeypatch):
    monkeypatch.setenv("PATCHSERVE_MAX_WAIT_MS", "77")  # read by the parent, not again by a child
    s = ServerSettings(admin_token="s3cret", workers=2, slots=5)
    child = ServerSettings.from_json(s.to_json())
    assert child == s and child.admin_token.get_secret_value() == "s3cret" and child.max_wait_ms == 77
    monkeypatch.setenv("PATCHSERVE_MAX_WAIT_MS", "1")
    assert ServerSettings.from_json(s.to_json()).max_wait_ms == 77
