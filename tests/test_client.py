"""patchserve.client (Client and AsyncClient) and the client CLI commands against real `patchserve serve` and
`patchserve worker` processes sharing a real redis-server: every call, typed results, typed errors."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
import zipfile
from collections.abc import Iterator

import pytest
import torch

from patchserve.__main__ import main
from patchserve.client import (
    PEFT_FILES,
    AsyncClient,
    Client,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    Unauthorized,
    _adapter_zip,
)
from patchserve.patches.api import PairInput
from patchserve.patches.peft_io import CONFIG_FILE, WEIGHTS_FILE
from tests.helpers import make_patch, patchserve_process, served, synthetic_rows
from tests.test_peft import TEXTS, _logits, _peft_model
from tests.test_peft_upload import LORA, _zip

ADMIN, PREDICT = "client-admin", "client-predict"
JOB = {"task": "sent", "min_steps": 300, "epochs": 1, "eval_every": 50, "lr": 1e-2, "pooling": "mean", "patience": 100}


@pytest.fixture(scope="module")
def server(redis_url, tiny_bert_dir, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("client")
    env = {
        "PATCHSERVE_REGISTRY": f"{redis_url}?prefix=client-{uuid.uuid4().hex[:6]}:",
        "PATCHSERVE_MODEL": str(tiny_bert_dir),
        "PATCHSERVE_DEVICE": "cpu",
    }
    with (
        served(tmp, env, "--admin-token", ADMIN, "--predict-token", PREDICT, "--slots", "4", "--workers", "2") as base,
        patchserve_process(["worker", "--name", "client-worker"], env, tmp / "worker.log"),
    ):
        yield base


def _rows(n: int, seed: int) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in synthetic_rows("classification", n, seed)).encode()


def test_tasks_predict_and_every_input_shape(server, tiny_encoder, tmp_path):
    a, b = make_patch(tiny_encoder, "sentiment", seed=1), make_patch(tiny_encoder, "sentiment", seed=2)
    pairs = make_patch(tiny_encoder, "sts", kind="regression", seed=3)
    path = tmp_path / "a.safetensors"
    path.write_bytes(a.data)
    with Client(server, token=ADMIN) as ps:
        assert ps.healthy() and ps.ready()["fingerprint"] == tiny_encoder.fingerprint
        first = ps.register(path)  # a file
        assert (first.name, first.version, first.patch_id) == ("sentiment", 1, a.patch_id)
        assert ps.register(b.data).version == 2  # bytes
        assert ps.register(pairs).kind == "regression"  # a Patch
        assert {t.name: t.version for t in ps.tasks()} == {"sentiment": 2, "sts": 1}
        detail = ps.task("sentiment")
        assert detail.current == 2 and detail.metadata["labels"] == ["negative", "positive"]
        assert [v.version for v in ps.versions("sentiment")] == [1, 2]
    with Client(server, token=PREDICT) as ps:
        one = ps.predict("sentiment", "the good movie", top_k=2, all_scores=True)
        assert one.version == 2 and len(one.predictions) == 1 and len(one.predictions[0].top_k or []) == 2
        many = ps.predict("sentiment", ["the good movie", "a bad film"])
        assert [p.label for p in many.predictions] == [
            p.label for p in ps.predict("sentiment", [{"text": "the good movie"}, {"text": "a bad film"}]).predictions
        ]
        for shape in ([("a cat runs", "a dog runs")], [PairInput(text="a cat runs", text_pair="a dog runs")]):
            assert ps.predict("sts", shape).predictions[0].value is not None
        vectors = ps.embed(["the good movie"], task="sentiment", normalize=True)
        assert vectors.dimensions == tiny_encoder.hidden_size and ps.embed("x").task is None
    with Client(server, token=ADMIN) as ps:
        assert ps.rollback("sentiment", 1).version == 1
        assert ps.predict("sentiment", "x").patch_id == a.patch_id
        assert ps.delete("sts").deleted and [t.name for t in ps.tasks()] == ["sentiment"]


def test_tasks_come_a_page_at_a_time(server, tiny_encoder, monkeypatch):
    import patchserve.client as client_module

    names = [f"page-{i}" for i in (3, 0, 4, 1, 2)]
    with Client(server, token=ADMIN) as ps:
        for name in names:
            ps.register(make_patch(tiny_encoder, name, seed=1))
        first = ps.tasks_page(limit=2, prefix="page-")
        assert [t.name for t in first.tasks] == ["page-0", "page-1"] and first.next_cursor is not None
        second = ps.tasks_page(limit=2, prefix="page-", cursor=first.next_cursor)
        assert [t.name for t in second.tasks] == ["page-2", "page-3"]
        last = ps.tasks_page(limit=2, prefix="page-", cursor=second.next_cursor)
        assert [t.name for t in last.tasks] == ["page-4"] and last.next_cursor is None
        monkeypatch.setattr(client_module, "PAGE_LIMIT", 2)  # tasks() follows the pages: 3 of them here
        assert [t.name for t in ps.tasks(prefix="page-")] == sorted(names)
        with pytest.raises(InvalidRequest, match="cursor"):
            ps.tasks_page(cursor="not-a-cursor")

    async def paged() -> list[str]:
        async with AsyncClient(server, token=ADMIN) as aps:
            return [t.name for t in await aps.tasks(prefix="page-")]

    assert asyncio.run(paged()) == sorted(names)
    with Client(server, token=ADMIN) as ps:
        for name in names:
            ps.delete(name)


def test_errors_are_typed_and_carry_the_servers_message(server):
    with Client(server) as anonymous, Client(server, token="wrong") as stranger, Client(server, token=ADMIN) as ps:
        with pytest.raises(Unauthorized) as exc:
            anonymous.tasks()
        assert exc.value.status == 401 and "Bearer" in exc.value.detail
        with pytest.raises(Forbidden):
            stranger.predict("sentiment", "x")
        with pytest.raises(NotFound, match="task 'missing' is not registered"):
            ps.predict("missing", "x")
        with pytest.raises(InvalidRequest, match="top_k"):
            ps.predict("sentiment", "x", top_k=0)
        with pytest.raises(InvalidRequest, match="invalid patch"):
            ps.register(b"not a patch")
        with pytest.raises(NotFound, match="has no version 99"):
            ps.rollback("sentiment", 99)


def test_register_a_peft_adapter_as_its_folder_or_an_archive(server, tiny_bert_dir, tiny_encoder, tmp_path):
    """A PEFT adapter registers through the client as the folder save_pretrained wrote (the client zips its two
    files, nothing else) or as an archive (a path, or bytes with the async client), and serves with PEFT's outputs.
    What the client can tell is wrong (a folder without a task name, one that is not an adapter, a label with a
    comma) is refused before anything is sent; what the server refuses raises with its message and registers
    nothing."""
    folder = tmp_path / "adapter"
    model = _peft_model(tiny_bert_dir, LORA, labels=2)
    model.save_pretrained(folder)
    (folder / "optimizer.pt").write_bytes(bytes(1 << 20))  # beside the adapter, as training scripts leave them
    assert PEFT_FILES == (CONFIG_FILE, WEIGHTS_FILE)  # the client's names are PEFT's, as the server reads them
    assert zipfile.ZipFile(io.BytesIO(_adapter_zip(folder))).namelist() == list(PEFT_FILES)  # not optimizer.pt
    probs = torch.softmax(_logits(model, tiny_encoder.tokenizer, TEXTS)[0], dim=-1)
    archive = tmp_path / "adapter.zip"
    archive.write_bytes(_zip({name: (folder / name).read_bytes() for name in PEFT_FILES}))
    not_an_adapter = tmp_path / "not-an-adapter"
    not_an_adapter.mkdir()
    (not_an_adapter / CONFIG_FILE).write_bytes((folder / CONFIG_FILE).read_bytes())
    with Client(server, token=ADMIN) as ps:
        first = ps.register(folder, task="peft-folder", labels=["neg", "pos"])
        assert (first.name, first.patch_type, first.labels) == ("peft-folder", "lora", ["neg", "pos"])
        served_ = ps.predict("peft-folder", TEXTS, all_scores=True).predictions
        for pred, want in zip(served_, probs, strict=True):
            assert pred.scores is not None
            assert pred.scores["neg"] == pytest.approx(float(want[0]), abs=1e-5)
            assert pred.scores["pos"] == pytest.approx(float(want[1]), abs=1e-5)
        again = ps.register(archive, task="peft-zip")
        assert again.labels == ["LABEL_0", "LABEL_1"] and again.patch_id != first.patch_id  # another task: another id
        with pytest.raises(ValueError, match="task=NAME"):
            ps.register(folder)
        with pytest.raises(FileNotFoundError, match=f"no {WEIGHTS_FILE}"):
            ps.register(not_an_adapter, task="peft-none")
        with pytest.raises(TypeError, match="a list of names"):
            ps.register(folder, task="peft-comma", labels="bad,good")
        with pytest.raises(ValueError, match="comma"):
            ps.register(folder, task="peft-comma", labels=["bad, good", "fine"])
        with pytest.raises(InvalidRequest, match="2 outputs but 3 labels"):
            ps.register(folder, task="peft-three", labels=["a", "b", "c"])
        names = {t.name for t in ps.tasks()}
        assert {"peft-folder", "peft-zip"} <= names and not names & {"peft-none", "peft-comma", "peft-three"}

    async def from_bytes() -> None:
        async with AsyncClient(server, token=ADMIN) as ps:
            registered = await ps.register(archive.read_bytes(), task="peft-bytes", labels=["neg", "pos"])
            assert (registered.patch_type, registered.labels) == ("lora", ["neg", "pos"])
            scores = (await ps.predict("peft-bytes", TEXTS[0], all_scores=True)).predictions[0].scores
            assert scores is not None and served_[0].scores is not None
            assert scores == pytest.approx(served_[0].scores, abs=1e-6)  # the same adapter, served alike

    asyncio.run(from_bytes())


def test_submit_and_wait_with_a_real_worker(server, capsys):
    with Client(server, token=ADMIN) as ps:
        job = ps.submit(
            JOB, train=("train.jsonl", _rows(200, 1)), dev=("dev.jsonl", _rows(50, 2)), gate={"min_dev": 0.5}
        )
        assert job.status == "queued" and job.task == "sent" and job.gate["min_dev"] == 0.5
        done = ps.wait(job, poll_s=0.2, timeout=240)
        assert done.status == "succeeded", done.error
        assert done.result["version"] >= 1 and done.progress["step"] == done.progress["total_steps"]
        assert ps.job(done.id).status == "succeeded" and done.id in [j.id for j in ps.jobs(limit=10)]
        with pytest.raises(Conflict, match="already ended"):
            ps.cancel(done)
        with pytest.raises(InvalidRequest, match="epochs"):
            ps.submit(JOB | {"epochs": "5"}, train=("train.jsonl", _rows(20, 1)))
    err = capsys.readouterr().err
    assert f"job {done.id} (sent): succeeded" in err  # off a terminal: plain progress lines


def test_the_async_client(server):
    async def session() -> None:
        async with AsyncClient(server, token=ADMIN) as ps:
            tasks = await ps.tasks()
            assert "sentiment" in [t.name for t in tasks]
            answers = await asyncio.gather(*(ps.predict("sentiment", f"text {i}") for i in range(8)))
            assert {a.task for a in answers} == {"sentiment"}
            with pytest.raises(NotFound):
                await ps.task("missing")
            job = await ps.submit(JOB | {"max_steps": 20}, train=("t.jsonl", _rows(60, 1)))
            done = await ps.wait(job.id, poll_s=0.2, timeout=240, progress=False)
            assert done.status == "succeeded", done.error

    asyncio.run(session())


def test_cli_commands_against_a_server(server, capsys, monkeypatch):
    monkeypatch.setenv("PATCHSERVE_TOKEN", ADMIN)
    assert main(["predict", "--url", server, "--task", "sentiment", "the good movie", "a bad film"]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    assert len(lines) == 2 and lines[0].endswith("\tthe good movie") and lines[0].split()[0] in ("positive", "negative")
    assert main(["predict", "--url", server, "--task", "sentiment", "--json", "x"]) == 0
    assert json.loads(capsys.readouterr().out)["task"] == "sentiment"
    assert main(["versions", "--url", server, "--task", "sentiment"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("version\tcurrent") and "\n1\t" in out
    assert main(["rollback", "--url", server, "--task", "sentiment", "--version", "2"]) == 0
    assert "version 2 is current" in capsys.readouterr().out
    assert main(["predict", "--url", server, "--task", "missing", "x"]) == 1
    assert "task 'missing' is not registered" in capsys.readouterr().err
    assert main(["delete", "--url", server, "--task", "sentiment", "--token", "wrong"]) == 1
    assert "HTTP 403" in capsys.readouterr().err
    assert main(["versions", "--url", "http://127.0.0.1:9", "--task", "x"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err
