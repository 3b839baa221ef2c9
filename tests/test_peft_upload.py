"""POST /tasks with a PEFT adapter archive: registered and served with PEFT's outputs; a hostile or malformed archive
refused with a clear 4xx that leaves the registry unchanged."""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import zipfile

import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig

from patchserve.patches.peft_archive import MAX_MEMBERS, adapter_files, is_archive
from patchserve.server.app import create_app
from tests.test_api import settings_for
from tests.test_peft import TEXTS, _logits, _peft_model

LORA = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, bias="all", target_modules=["query", "value"])


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_bert_dir, tiny_encoder):
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    model = _peft_model(tiny_bert_dir, LORA, labels=2)
    model.save_pretrained(folder)
    probs = torch.softmax(_logits(model, tiny_encoder.tokenizer, TEXTS)[0], dim=-1)
    return folder, {p.name: p.read_bytes() for p in folder.iterdir()}, probs


def _zip(files, prefix="adapter/"):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(prefix + name, data)
    return buf.getvalue()


def _tar(files, mode="w:gz", links=()):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            t.addfile(info)
    return buf.getvalue()


@pytest.fixture
def client(tmp_path, tiny_bert_dir):
    with TestClient(create_app(settings_for(f"disk://{tmp_path}/reg", tiny_bert_dir, max_patch_bytes=4 << 20))) as c:
        yield c


@pytest.mark.parametrize("pack", ["zip", "tar.gz"])
def test_an_uploaded_adapter_serves_with_peft_outputs(client, adapter, pack):
    _, files, probs = adapter
    body = _zip(files) if pack == "zip" else _tar({f"adapter/{k}": v for k, v in files.items()})
    r = client.post("/tasks", files={"patch": ("a." + pack, body)}, data={"task": "peft-sst", "labels": "neg,pos"})
    assert r.status_code == 201, r.text
    assert r.json()["patch_type"] == "lora" and r.json()["labels"] == ["neg", "pos"]
    for text, want in zip(TEXTS, probs, strict=True):
        r = client.post("/tasks/peft-sst/predict", json={"inputs": text, "all_scores": True})
        assert r.status_code == 200, r.text
        scores = r.json()["predictions"][0]["scores"]
        assert scores["neg"] == pytest.approx(float(want[0]), abs=1e-5)
        assert scores["pos"] == pytest.approx(float(want[1]), abs=1e-5)


def _bomb(size):
    """A tar.gz whose one member decompresses to ``size`` zero bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as t:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = size
        t.addfile(info, io.BytesIO(bytes(size)))
    return gzip.compress(raw.getvalue(), compresslevel=9)


def _bad_archives(files):
    wide = {f"junk{i}.txt": b"x" for i in range(MAX_MEMBERS + 1)} | files
    return {
        "traversal": (_tar({"../adapter_config.json": files["adapter_config.json"]}), 422, "climbs out"),
        "absolute": (_zip(files, prefix="/etc/"), 422, "absolute or unsafe"),
        "symlink": (
            _tar(
                {"adapter_config.json": files["adapter_config.json"]},
                links=[("adapter_model.safetensors", "/etc/passwd")],
            ),
            422,
            "not a regular file",
        ),
        "bomb": (_bomb(64 << 20), 413, "more than|over"),
        "members": (_zip(wide, prefix=""), 422, "entries"),
        "missing": (_zip({"adapter_config.json": files["adapter_config.json"]}), 422, "no adapter_model.safetensors"),
        "damaged": (_zip(files)[:200], 422, "cannot be read"),
        "config": (_zip({**files, "adapter_config.json": b"{not json"}), 422, "adapter_config.json"),
    }


def test_hostile_or_malformed_archives_are_refused_and_change_nothing(client, adapter):
    _, files, _ = adapter
    for name, (body, status, why) in _bad_archives(files).items():
        assert is_archive(body), name
        r = client.post("/tasks", files={"patch": ("a", body)}, data={"task": "bad"})
        assert r.status_code == status, (name, r.text)
        assert re.search(why, r.json()["detail"]), (name, r.json())
    assert client.get("/tasks").json() == []
    r = client.post("/tasks", files={"patch": ("a.zip", _zip(files, prefix=""))})  # a good archive, no task name
    assert r.status_code == 422 and "form field 'task'" in r.json()["detail"]
    assert client.get("/tasks").json() == []


def test_a_wanted_file_twice_is_ambiguous():
    body = _tar({"a/adapter_config.json": b"{}", "b/adapter_config.json": b"{}"}, mode="w")
    with pytest.raises(Exception, match="twice"):
        adapter_files(body, limit=1 << 20)


def test_a_patch_file_keeps_its_own_task_name(client, tiny_encoder):
    from tests.helpers import make_patch

    patch = make_patch(tiny_encoder, "named", seed=3, lora_rank=2)
    r = client.post("/tasks", files={"patch": ("p.safetensors", patch.data)}, data={"task": "other"})
    assert r.status_code == 422 and "carries its own task name" in r.json()["detail"]
    r = client.post("/tasks", files={"patch": ("p.safetensors", patch.data)}, data={"task": "named"})
    assert r.status_code == 201 and r.json()["patch_type"] == "lora"
