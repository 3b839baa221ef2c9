"""The HTTP API, in process, against the real engine on a tiny seeded BERT and real registries."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import replace

import pytest
import redis
import torch
from fastapi.testclient import TestClient

from patchserve.patches.format import Patch
from patchserve.patches.model import TaskModel
from patchserve.patches.store import redact_url
from patchserve.server.app import create_app
from patchserve.server.settings import ServerSettings
from tests.helpers import make_patch, start_redis, synthetic_rows, wait_until


def settings_for(registry: str, model_dir, **kw) -> ServerSettings:
    base = {"registry": registry, "model": str(model_dir), "device": "cpu", "slots": 8, "max_wait_ms": 1.0}
    return ServerSettings(**(base | kw))


@pytest.fixture
def make_client(tmp_path, tiny_bert_dir):
    clients = []

    def make(registry: str | None = None, **kw) -> TestClient:
        client = TestClient(create_app(settings_for(registry or f"disk://{tmp_path}/reg", tiny_bert_dir, **kw)))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def upload(client: TestClient, patch, headers=None):
    return client.post("/tasks", files={"patch": ("p.safetensors", patch.data)}, headers=headers or {})


def reference_probs(encoder, patch, text, pair=None):
    model = TaskModel.from_patch(copy.deepcopy(encoder.model), patch).eval()
    enc = encoder.tokenizer([text], None if pair is None else [pair], return_tensors="pt")
    with torch.no_grad():
        return model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])[0]


@pytest.mark.parametrize("scales", [0.0, 0.3], ids=["bitfit", "bitfit-ia3"])
def test_register_then_predict_matches_the_reference(make_client, tiny_encoder, scales):
    client = make_client()
    patch = make_patch(tiny_encoder, "sentiment", seed=3, ia3_scale=scales)
    r = upload(client, patch)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body == {
        "name": "sentiment",
        "version": 1,
        "patch_id": patch.patch_id,
        "kind": "classification",
        "labels": ["negative", "positive"],
        "n_params": patch.n_params,
        "patch_type": "bitfit-ia3" if scales else "bitfit",
        "base": {"name": tiny_encoder.name, "fingerprint": tiny_encoder.fingerprint},
    }
    r = client.post(
        "/tasks/sentiment/predict",
        json={"inputs": ["the movie was good", "boring plot"], "all_scores": True, "top_k": 1},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["task"], out["version"], out["patch_id"]) == ("sentiment", 1, patch.patch_id)
    for text, pred in zip(["the movie was good", "boring plot"], out["predictions"], strict=True):
        probs = reference_probs(tiny_encoder, patch, text).softmax(-1)
        best = int(probs.argmax())
        assert pred["label"] == patch.meta.labels[best]
        assert pred["score"] == pytest.approx(float(probs[best]), abs=1e-5)
        assert pred["scores"]["positive"] == pytest.approx(float(probs[1]), abs=1e-5)
        assert pred["top_k"] == [{"label": pred["label"], "score": pred["score"]}]
        assert pred["truncated"] is False


def test_labels_answer_with_the_json_type_they_were_trained_with(make_client, tiny_encoder):
    # a set labelled 0/1 gets 0/1 back (numbers, not "0"/"1"); a string label stays a string
    client = make_client()
    patch = make_patch(tiny_encoder, "numbers", labels=[0, 1], seed=3)
    r = upload(client, patch)
    assert r.status_code == 201 and r.json()["labels"] == [0, 1]
    r = client.post("/tasks/numbers/predict", json={"inputs": ["good", "bad"], "top_k": 2, "all_scores": True})
    assert r.status_code == 200, r.text
    for pred in r.json()["predictions"]:
        assert type(pred["label"]) is int and pred["label"] in (0, 1)
        assert [type(s["label"]) for s in pred["top_k"]] == [int, int]
        assert set(pred["scores"]) == {"0", "1"}  # JSON object keys are strings in any JSON
    assert client.get("/tasks/numbers").json()["metadata"]["labels"] == [0, 1]
    mixed = make_patch(tiny_encoder, "mixed", labels=[7, "seven-ish"], seed=4)
    assert upload(client, mixed).status_code == 201
    labels = {
        p["label"]
        for p in client.post("/tasks/mixed/predict", json={"inputs": ["a", "b", "c"], "top_k": 2}).json()[
            "predictions"
        ][0]["top_k"]
    }
    assert labels == {7, "seven-ish"}


def test_regression_pairs_and_tagging(make_client, tiny_encoder):
    client = make_client()
    sts = make_patch(tiny_encoder, "sts", kind="regression", seed=4)
    pos = make_patch(tiny_encoder, "pos", kind="token-classification", seed=5)
    assert upload(client, sts).status_code == 201 and upload(client, pos).status_code == 201
    r = client.post("/tasks/sts/predict", json={"inputs": [{"text": "a cat runs", "text_pair": "a dog runs"}]})
    assert r.status_code == 200, r.text
    expected = reference_probs(tiny_encoder, sts, "a cat runs", "a dog runs")[0]
    assert r.json()["predictions"][0]["value"] == pytest.approx(float(expected), abs=1e-5)
    r = client.post("/tasks/pos/predict", json={"inputs": "the cat runs quickly"})
    assert r.status_code == 200, r.text
    tokens = r.json()["predictions"][0]["tokens"]
    assert [t["token"] for t in tokens] == ["the", "cat", "runs", "quickly"]
    assert all(t["label"] in ("DET", "NOUN", "VERB") and 0 < t["score"] <= 1 for t in tokens)
    r = client.post("/tasks/pos/predict", json={"inputs": [{"text": "a", "text_pair": "b"}]})
    assert r.status_code == 422 and "text_pair" in r.json()["detail"]


def test_long_inputs_are_truncated_and_flagged(make_client, tiny_encoder):
    client = make_client(max_seq_length=16)
    upload(client, make_patch(tiny_encoder, "t"))
    r = client.post("/tasks/t/predict", json={"inputs": ["the movie " * 40, "good"]})
    assert r.status_code == 200, r.text
    assert [p["truncated"] for p in r.json()["predictions"]] == [True, False]


def test_huge_inputs_are_cut_to_bounded_work_and_answer_as_the_cut_text(make_client, tiny_encoder):
    """Eight 1 MB texts once froze the server for 17 s (tokenised whole). Now each is cut to max_input_chars before
    tokenising, and the answer is the one for the text's first max_seq_length tokens."""
    client = make_client(max_seq_length=16, max_input_chars=64, max_predict_body_bytes=16 * 1024 * 1024)
    patch = make_patch(tiny_encoder, "t")
    tagger = make_patch(tiny_encoder, "pos", kind="token-classification", seed=5)
    upload(client, patch), upload(client, tagger)
    huge = "the good movie " * 70_000  # ~1 MB
    r = client.post("/tasks/t/predict", json={"inputs": [huge] * 8, "all_scores": True})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert all(p["truncated"] for p in preds)
    head = tiny_encoder.tokenizer.decode(
        tiny_encoder.tokenizer(huge[:64], truncation=True, max_length=16)["input_ids"][1:-1]
    )
    expected = reference_probs(tiny_encoder, patch, head).softmax(-1)
    assert preds[0]["scores"]["positive"] == pytest.approx(float(expected[1]), abs=1e-5)
    # under the character cap but over the token limit: truncated by the tokenizer, still flagged
    r = client.post("/tasks/t/predict", json={"inputs": ["a " * 30, "good"]})  # 60 characters, 32 tokens
    assert [p["truncated"] for p in r.json()["predictions"]] == [True, False]
    # tagging tags whole words only: a word the character cap split is dropped, and the row is flagged
    r = client.post("/tasks/pos/predict", json={"inputs": "the cat runs quickly " * 10})
    tokens = r.json()["predictions"][0]["tokens"]
    assert r.json()["predictions"][0]["truncated"] and all(
        t["token"] in ("the", "cat", "runs", "quickly") for t in tokens
    )


def test_requests_a_task_cannot_serve_are_refused_not_reinterpreted(make_client, tiny_encoder):
    client = make_client()

    def variant(task: str, kind: str = "classification", text_pair: bool | None = None):
        p = make_patch(tiny_encoder, task, kind=kind)
        return Patch(replace(p.meta, text_pair=text_pair), p.biases, p.head_weight, p.head_bias)

    for patch in (variant("single", text_pair=False), variant("pair", text_pair=True), variant("legacy")):
        assert upload(client, patch).status_code == 201
    assert upload(client, variant("sts", "regression", text_pair=True)).status_code == 201
    pair = [{"text": "a cat runs", "text_pair": "a dog runs"}]
    r = client.post("/tasks/single/predict", json={"inputs": pair})
    assert r.status_code == 422 and "reads single texts" in r.json()["detail"]
    r = client.post("/tasks/pair/predict", json={"inputs": "a cat runs"})
    assert r.status_code == 422 and "scores sentence pairs" in r.json()["detail"]
    assert client.post("/tasks/pair/predict", json={"inputs": pair}).status_code == 200
    # a patch from before text_pair was recorded: both forms, as before
    assert client.post("/tasks/legacy/predict", json={"inputs": pair}).status_code == 200
    assert client.post("/tasks/legacy/predict", json={"inputs": "a cat"}).status_code == 200
    # options that only classification has are refused, not ignored; so is a field the route does not know
    r = client.post("/tasks/sts/predict", json={"inputs": pair, "top_k": 2})
    assert r.status_code == 422 and "top_k and all_scores apply to classification" in r.json()["detail"]
    r = client.post("/tasks/single/predict", json={"inputs": "a cat", "topk": 2})
    assert r.status_code == 422 and "topk" in r.json()["detail"]


@pytest.mark.parametrize(
    "body, words",
    [
        ('{"inputs": "x", "top_k": NaN}', "top_k: Input should be a valid integer"),
        ('{"inputs": "x", "top_k": Infinity}', "top_k"),
        ('{"inputs": "x", "top_k": true}', "top_k: Input should be a valid integer"),
        ('{"inputs": "x", "top_k": 1e400}', "top_k"),
        ('{"inputs": "x\\ud800"}', "lone UTF-16 surrogate at character 1"),
        ('{"inputs": [{"text": "a", "text_pair": "\\udfff"}]}', "inputs.0.text_pair"),
        ('{"inputs": 5}', "inputs must be a text, a list of texts"),
        ('{"inputs": ["a", 3]}', "inputs.1"),
        ('{"inputs": ' + "[" * 50_000 + "]" * 50_000 + "}", "parsing the body"),
        ('{"inputs": "x", "all_scores": "yes"}', "all_scores"),
        ("not json", "JSON"),
        ("[]", "body"),
    ],
    ids=lambda v: v[:30] if isinstance(v, str) else None,
)
def test_client_input_never_ends_in_a_5xx(make_client, tiny_encoder, body, words):
    client = make_client()
    upload(client, make_patch(tiny_encoder, "t"))
    r = client.post("/tasks/t/predict", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and words in detail, detail  # one error shape: {"detail": "..."}


def test_task_management_routes(make_client, tiny_encoder):
    client = make_client()
    a, b = make_patch(tiny_encoder, "t", seed=1), make_patch(tiny_encoder, "t", seed=2)
    upload(client, a)
    assert upload(client, b).json()["version"] == 2
    tasks = client.get("/tasks").json()
    assert [(t["name"], t["version"], t["patch_id"]) for t in tasks] == [("t", 2, b.patch_id)]
    detail = client.get("/tasks/t").json()
    assert detail["current"] == 2 and [v["version"] for v in detail["versions"]] == [1, 2]
    assert detail["metadata"]["patch_id"] == b.patch_id and detail["metadata"]["kind"] == "classification"
    r = client.post("/tasks/t/rollback", json={"version": 1})
    assert r.status_code == 200 and r.json()["patch_id"] == a.patch_id
    assert client.post("/tasks/t/predict", json={"inputs": "good"}).json()["patch_id"] == a.patch_id
    r = client.post("/tasks/t/rollback", json={"version": 9})
    assert r.status_code == 404 and "versions are [1, 2]" in r.json()["detail"]
    assert client.delete("/tasks/t").json() == {"name": "t", "deleted": True}
    r = client.post("/tasks/t/predict", json={"inputs": "good"})
    assert r.status_code == 404 and "GET /tasks" in r.json()["detail"]
    assert client.get("/tasks").json() == []


def test_get_tasks_is_paged_by_name_with_a_link_to_the_next_page(make_client, tiny_encoder, tmp_path):
    from patchserve.patches.store import open_registry
    from patchserve.server.routes import DEFAULT_PAGE

    reg = open_registry(f"disk://{tmp_path}/reg")
    patch = make_patch(tiny_encoder, "t", seed=1)
    names = [f"t{i:03d}" for i in range(DEFAULT_PAGE + 3)] + ["b-1", "b-2", "b-3"]
    for name in names:
        reg.put(Patch(replace(patch.meta, task=name), patch.biases, patch.head_weight, patch.head_bias))
    client = make_client()
    first = client.get("/tasks")
    assert [t["name"] for t in first.json()] == sorted(names)[:DEFAULT_PAGE]  # the default page is bounded
    seen, url = [], "/tasks?limit=40"
    while url:
        r = client.get(url)
        seen += [t["name"] for t in r.json()]
        url = r.links.get("next", {}).get("url")
    assert seen == sorted(names)
    r = client.get("/tasks", params={"prefix": "b-", "limit": 2})
    assert [t["name"] for t in r.json()] == ["b-1", "b-2"]
    assert "prefix=b-" in r.headers["link"] and 'rel="next"' in r.headers["link"]
    r = client.get(r.links["next"]["url"])
    assert [t["name"] for t in r.json()] == ["b-3"] and "link" not in r.headers
    # the cursor stays valid while tasks are added (a task behind it is not listed, one ahead is) or deleted
    r = client.get("/tasks", params={"limit": 1})
    reg.put(Patch(replace(patch.meta, task="a-0"), patch.biases, patch.head_weight, patch.head_bias))
    reg.delete("b-2")
    assert [t["name"] for t in client.get(r.links["next"]["url"]).json()] == ["b-3"]
    for params, words in (
        ({"cursor": "%%%"}, "cursor"),
        ({"cursor": "Li4vZXRj"}, "cursor"),  # ../etc: not a task name, so not a cursor of ours
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"prefix": "../"}, "prefix"),
    ):
        r = client.get("/tasks", params=params)
        assert r.status_code == 422 and words in r.json()["detail"], (params, r.text)


def test_a_retired_patch_type_in_the_registry_is_a_409_that_says_what_to_do(make_client, tiny_encoder, tmp_path):
    """A registry an earlier release wrote may hold a bitfit-ln patch (a type since removed): predicting with it is
    a 409 naming the version and what to do, the task stays listed, a rollback serves again, and uploading one is
    refused."""
    from patchserve.patches.store import DiskRegistry
    from tests.helpers import retired_patch

    good, old = make_patch(tiny_encoder, "t", seed=1), retired_patch(tiny_encoder, "t")
    registry = DiskRegistry(tmp_path / "reg")
    registry.put(good)
    registry.put(old)  # v2, current
    client = make_client()
    r = client.post("/tasks/t/predict", json={"inputs": "good"})
    detail = r.json()["detail"]
    assert r.status_code == 409 and f"'t' v2 ({old.patch_id})" in detail and "'bitfit-ln'" in detail
    assert "retrain the task" in detail and "roll back" in detail
    assert [(t["name"], t["version"]) for t in client.get("/tasks").json()] == [("t", 2)]
    assert client.post("/tasks/t/rollback", json={"version": 1}).status_code == 200
    assert client.post("/tasks/t/predict", json={"inputs": "good"}).json()["patch_id"] == good.patch_id
    r = upload(client, old)
    assert r.status_code == 422 and "is no longer served" in r.json()["detail"]
    assert registry.info("t").version == 1


def test_bad_patches_are_refused_and_the_registry_is_unchanged(make_client, tiny_encoder):
    client = make_client(max_patch_bytes=200_000)
    good = make_patch(tiny_encoder, "t")
    upload(client, good)
    before = client.get("/tasks/t").json()
    r = upload(client, type("P", (), {"data": good.data[:-7]})())
    assert r.status_code == 422 and "truncated" in r.json()["detail"]
    r = upload(client, type("P", (), {"data": b"not a patch at all"})())
    assert r.status_code == 422
    other_base = make_patch(tiny_encoder, "t", seed=9)
    other_base.meta.base = type(other_base.meta.base)("elsewhere", "sha256:" + "e" * 64)
    other_base.__dict__.pop("data", None)
    other_base.__dict__.pop("patch_id", None)
    r = upload(client, other_base)
    assert (
        r.status_code == 422 and "sha256:eee" in r.json()["detail"] and tiny_encoder.fingerprint in r.json()["detail"]
    )
    r = upload(client, type("P", (), {"data": b"\0" * 300_000})())
    assert r.status_code == 413
    r = client.post("/tasks", files={"wrong_field": ("p", good.data)})
    assert r.status_code == 422
    assert client.get("/tasks/t").json() == before


def test_bad_requests_get_clear_4xx(make_client, tiny_encoder):
    client = make_client(max_inputs_per_request=3)
    upload(client, make_patch(tiny_encoder, "t"))
    cases = [
        ({"inputs": []}, 422, "empty"),
        ({"inputs": ["a"] * 4}, 422, "limit is 3"),
        ({"inputs": [{"text": "a", "text_pair": "b"}, {"text": "c"}]}, 422, "text_pair"),
        ({"inputs": "good", "top_k": 0}, 422, "greater than or equal"),
        ({"text": "good"}, 422, "inputs"),
    ]
    for body, status, words in cases:
        r = client.post("/tasks/t/predict", json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.text, (body, r.text)
    r = client.post("/tasks/bad..name/predict", json={"inputs": "x"})
    assert r.status_code == 422 and "invalid task name" in r.json()["detail"]


def test_auth(make_client, tiny_encoder):
    client = make_client(admin_token="adm1n", predict_token="pr3d")
    patch = make_patch(tiny_encoder, "t")
    r = upload(client, patch)
    assert r.status_code == 401 and "Bearer" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    assert upload(client, patch, {"Authorization": "Bearer pr3d"}).status_code == 403
    assert upload(client, patch, {"Authorization": "Bearer adm1n"}).status_code == 201
    assert client.delete("/tasks/t", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.post("/tasks/t/predict", json={"inputs": "x"}).status_code == 401
    assert (
        client.post("/tasks/t/predict", json={"inputs": "x"}, headers={"Authorization": "Bearer x"}).status_code == 403
    )
    for token in ("pr3d", "adm1n"):
        r = client.post("/tasks/t/predict", json={"inputs": "x"}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
    assert client.get("/healthz").status_code == 200  # probes need no token
    # reads (task metadata: labels, metrics, training settings) need a token too; probes and metrics do not
    for path in ("/tasks", "/tasks/t"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 403
        for token in ("pr3d", "adm1n"):
            assert client.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200, path


def test_metrics_have_series_of_their_own_for_at_most_the_first_n_tasks(make_client, tiny_encoder):
    client = make_client(metrics_task_labels=2)
    for name in ("a", "b", "c", "d"):
        upload(client, make_patch(tiny_encoder, name))
    for name in ("b", "a", "c", "d", "a", "c"):
        assert client.post(f"/tasks/{name}/predict", json={"inputs": "x"}).status_code == 200
    client.post("/tasks/missing/predict", json={"inputs": "x"})
    text = client.get("/metrics").text
    counted = dict(re.findall(r'^patchserve_requests_total\{status="(?:\d+)",task="([^"]+)"\} ([0-9.]+)$', text, re.M))
    assert counted == {"b": "1.0", "a": "2.0", "_other": "3.0", "_unknown": "1.0"}
    tasks_in_latency = set(re.findall(r'^patchserve_request_latency_seconds_count\{task="([^"]+)"\}', text, re.M))
    assert tasks_in_latency == {"a", "b", "_other"}


def test_with_only_an_admin_token_predict_is_open_and_reads_need_it(make_client, tiny_encoder):
    client = make_client(admin_token="adm1n")
    assert upload(client, make_patch(tiny_encoder, "t"), {"Authorization": "Bearer adm1n"}).status_code == 201
    assert client.post("/tasks/t/predict", json={"inputs": "x"}).status_code == 200
    assert client.get("/tasks").status_code == 401
    assert client.get("/tasks/t", headers={"Authorization": "Bearer adm1n"}).status_code == 200


def test_ops_routes_and_openapi(make_client, tiny_encoder):
    client = make_client()
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["fingerprint"] == tiny_encoder.fingerprint
    upload(client, make_patch(tiny_encoder, "t"))
    client.post("/tasks/t/predict", json={"inputs": ["good", "bad"]})
    client.post("/tasks/missing/predict", json={"inputs": "x"})
    text = client.get("/metrics").text
    assert 'patchserve_requests_total{status="200",task="_other"} 1.0' in text  # no series per task by default
    assert 'patchserve_requests_total{status="404",task="_unknown"} 1.0' in text
    for name in (
        "patchserve_batch_rows",
        "patchserve_batch_tasks",
        "patchserve_queue_rows",
        'patchserve_slot_events_total{event="miss"}',
        "patchserve_patch_load_seconds",
        "patchserve_request_latency_seconds",
    ):
        assert name in text, name
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in (
        "/tasks/{name}/predict",
        "/tasks",
        "/tasks/{name}",
        "/tasks/{name}/rollback",
        "/tasks/{name}/embed",
        "/embed",
        "/v1/embeddings",
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer",
        "/v2/health/ready",
        "/jobs/{job_id}/cancel",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths
    refs = set(re.findall(r'"#/components/schemas/([A-Za-z0-9_]+)"', json.dumps(spec)))
    assert refs and refs <= set(spec["components"]["schemas"]), "every schema the document refers to is in it"


@contextlib.contextmanager
def device_held(client: TestClient):
    """Hold the engine's device: a batch launched meanwhile waits until the block ends (what a long batch does)."""
    runner = client.app.state.service.engine.runner
    release, held, launch = threading.Event(), threading.Event(), runner.launch

    def held_launch(rows):
        held.set()
        release.wait(timeout=60)
        return launch(rows)

    runner.launch = held_launch
    try:
        yield held
    finally:
        release.set()
        runner.launch = launch


def test_overload_is_503_with_retry_after(make_client, tiny_encoder):
    # while the device runs the first request's rows, the second request's 3 rows fill the queue
    client = make_client(max_queue_rows=3, max_inputs_per_request=3)
    upload(client, make_patch(tiny_encoder, "t"))
    answers: list = []

    def ask(inputs):
        answers.append(client.post("/tasks/t/predict", json={"inputs": inputs}))

    with device_held(client) as held:
        threads = [threading.Thread(target=ask, args=(["a", "b", "c"],))]
        threads[0].start()
        assert held.wait(30), "the first request never reached the device"
        threads.append(threading.Thread(target=ask, args=(["d", "e", "f"],)))
        threads[1].start()
        batcher = client.app.state.service.engine.batcher
        wait_until(lambda: batcher.queued_rows == 3, what="the second request's rows to queue")
        r = client.post("/tasks/t/predict", json={"inputs": "g"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "queued" in r.json()["detail"]
    for t in threads:
        t.join()
    assert [a.status_code for a in answers] == [200, 200]
    assert client.post("/tasks/t/predict", json={"inputs": "d"}).status_code == 200


def test_a_lone_request_does_not_wait_for_company(make_client, tiny_encoder):
    # an idle device starts a batch at once: max_wait_ms only applies behind a batch that is still running
    client = make_client(max_wait_ms=5000, request_timeout_s=2)
    upload(client, make_patch(tiny_encoder, "t"))
    r = client.post("/tasks/t/predict", json={"inputs": "good"})
    assert r.status_code == 200, r.text


def test_a_request_that_could_never_fit_the_queue_is_refused_at_start_up(tiny_bert_dir, tmp_path):
    with pytest.raises(ValueError, match="max_queue_rows"):
        settings_for(f"disk://{tmp_path}", tiny_bert_dir, max_queue_rows=2, max_inputs_per_request=3)


def test_slow_requests_time_out_with_504(make_client, tiny_encoder):
    client = make_client(request_timeout_s=0.2)
    upload(client, make_patch(tiny_encoder, "t"))
    with device_held(client):
        r = client.post("/tasks/t/predict", json={"inputs": "good"})
    assert r.status_code == 504 and "REQUEST_TIMEOUT" in r.json()["detail"]
    assert client.post("/tasks/t/predict", json={"inputs": "good"}).status_code == 200


def test_body_limits_hold_with_and_without_a_content_length(make_client, tiny_encoder):
    client = make_client(max_body_bytes=16384, max_predict_body_bytes=2048)
    patch = make_patch(tiny_encoder, "t")  # ~5 KB: under the upload limit, over the predict one
    assert upload(client, patch).status_code == 201
    small = json.dumps({"inputs": "the movie was good"}).encode()
    big = json.dumps({"inputs": "x" * 5000}).encode()

    def chunked(data: bytes):  # a generator body goes out with Transfer-Encoding: chunked, no Content-Length
        for i in range(0, len(data), 512):
            yield data[i : i + 512]

    json_type = {"content-type": "application/json"}
    for content in (big, chunked(big)):
        r = client.post("/tasks/t/predict", content=content, headers=json_type)
        assert r.status_code == 413, r.text
        assert "2048 bytes" in r.json()["detail"] and "PATCHSERVE_MAX_PREDICT_BODY_BYTES" in r.json()["detail"]
    for content in (small, chunked(small)):
        assert client.post("/tasks/t/predict", content=content, headers=json_type).status_code == 200
    # uploads have the larger limit, chunked or not
    huge = b"\0" * 20000
    r = client.post("/tasks", files={"patch": ("p.safetensors", huge)})
    assert r.status_code == 413 and "PATCHSERVE_MAX_BODY_BYTES" in r.json()["detail"], r.text
    boundary = "b0undary"
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="patch"; filename="p.safetensors"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + huge
        + f"\r\n--{boundary}--\r\n".encode()
    )
    r = client.post(
        "/tasks", content=chunked(form), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 413 and "16384 bytes" in r.json()["detail"], r.text
    assert [t["version"] for t in client.get("/tasks").json()] == [1]  # nothing was registered


def _traffic(client, task, stop, results, errors):
    while not stop.is_set():
        t0 = time.monotonic()
        r = client.post(f"/tasks/{task}/predict", json={"inputs": ["the movie was good", "awful"]})
        if r.status_code != 200:
            errors.append(r.text)
        else:
            results.append((t0, r.json()["patch_id"]))


def test_hot_swap_under_traffic_fails_no_request(make_client, tiny_encoder):
    client = make_client()
    v1, v2 = make_patch(tiny_encoder, "t", seed=1), make_patch(tiny_encoder, "t", seed=2)
    upload(client, v1)
    stop, results, errors = threading.Event(), [], []
    threads = [threading.Thread(target=_traffic, args=(client, "t", stop, results, errors)) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 20 or errors, what="traffic on v1")
        assert upload(client, v2).status_code == 201
        swapped = time.monotonic()
        wait_until(lambda: len([r for r in results if r[0] > swapped]) >= 20 or errors, what="traffic on v2")
    finally:
        stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert {pid for _, pid in results} == {v1.patch_id, v2.patch_id}
    assert all(pid == v2.patch_id for t0, pid in results if t0 > swapped), "a request after the swap got v1"


def test_two_replicas_share_a_redis_registry(make_client, redis_url, tiny_encoder):
    url = f"{redis_url}?prefix=replicas-{uuid.uuid4().hex[:6]}:"
    a, b = make_client(url), make_client(url)
    v1, v2 = make_patch(tiny_encoder, "shared", seed=1), make_patch(tiny_encoder, "shared", seed=2)
    assert upload(a, v1).status_code == 201
    r = b.post("/tasks/shared/predict", json={"inputs": "good"})  # never seen by b before: looked up at once
    assert r.status_code == 200 and r.json()["patch_id"] == v1.patch_id
    assert upload(a, v2).status_code == 201
    deadline = time.monotonic() + 10
    while b.post("/tasks/shared/predict", json={"inputs": "good"}).json()["patch_id"] != v2.patch_id:
        assert time.monotonic() < deadline, "replica b never served v2"
        time.sleep(0.02)
    b.post("/tasks/shared/rollback", json={"version": 1})
    deadline = time.monotonic() + 10
    while a.post("/tasks/shared/predict", json={"inputs": "good"}).json()["patch_id"] != v1.patch_id:
        assert time.monotonic() < deadline, "replica a never saw the rollback"
        time.sleep(0.02)
    a.delete("/tasks/shared")
    deadline = time.monotonic() + 10
    while b.post("/tasks/shared/predict", json={"inputs": "good"}).status_code != 404:
        assert time.monotonic() < deadline, "replica b still serves a deleted task"
        time.sleep(0.02)


def test_a_redis_that_refuses_writes_is_a_503_that_says_why(make_client, tiny_encoder, tmp_path):
    """A real redis-server out of memory answers reads but refuses writes: registering a patch or queueing a job
    is a 503 naming the cause (not a 500), reads go on, and writes work again once Redis has room."""
    proc, url = start_redis(tmp_path, "--maxmemory", "1", "--maxmemory-policy", "noeviction")
    try:
        client = make_client(url)
        patch = make_patch(tiny_encoder)
        r = upload(client, patch)
        assert r.status_code == 503 and "refuses writes" in r.json()["detail"]
        assert "out of memory: raise its maxmemory" in r.json()["detail"]
        assert client.get("/tasks").status_code == 200 and client.get("/tasks").json() == []
        rows = "".join(json.dumps(row) + "\n" for row in synthetic_rows("classification", 20, 1))
        r = client.post("/jobs", files={"train": ("t.jsonl", rows.encode())}, data={"config": '{"task": "t"}'})
        assert r.status_code == 503 and "job queue at" in r.json()["detail"] and "out of memory" in r.json()["detail"]
        redis.Redis.from_url(url).config_set("maxmemory", 0)
        assert upload(client, patch).status_code == 201
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_redis_password_never_leaves_the_server(make_client, tiny_encoder, tmp_path, caplog):
    """Not in /readyz (which needs no token), not in 503 bodies, not in the logs."""
    proc, url = start_redis(tmp_path, password="s3cret-pw")
    assert ":s3cret-pw@" in url
    try:
        with caplog.at_level(logging.INFO):
            client = make_client(url)
            ready = client.get("/readyz").json()
            assert ready["registry"] == url.replace("s3cret-pw", "***")
            assert upload(client, make_patch(tiny_encoder)).status_code == 201
            proc.terminate()
            proc.wait(timeout=10)
            bodies = [client.get("/readyz"), client.get("/tasks"), upload(client, make_patch(tiny_encoder, seed=2))]
            bodies.append(client.get("/jobs"))
            rows = "".join(json.dumps(row) + "\n" for row in synthetic_rows("classification", 20, 1))
            bodies.append(
                client.post("/jobs", files={"train": ("t.jsonl", rows.encode())}, data={"config": '{"task": "t"}'})
            )
            assert [r.status_code for r in bodies] == [503] * 5
            for r in bodies:
                assert "s3cret-pw" not in r.text and ":***@" in r.text, r.text
            wait_until(lambda: "registry watch failed" in caplog.text, what="the watcher to notice")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
    assert "s3cret-pw" not in caplog.text
    assert redact_url("redis://user:pw@h:1/0?password=pw&prefix=a:") == "redis://user:***@h:1/0?password=***&prefix=a:"


def test_api_docs_work_offline_and_the_schema_is_exact(make_client):
    client = make_client(admin_token="adm1n")
    for page in ("/docs", "/redoc"):
        html = client.get(page).text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert assets and not [a for a in assets if a.startswith(("http:", "https:", "//"))], assets  # no CDN
        for asset in assets:
            assert client.get(asset).status_code == 200, asset  # every asset is served by the app itself
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["HTTPBearer"]["description"],
    }
    ops = {(path, method): op for path, item in spec["paths"].items() for method, op in item.items()}
    assert ops[("/tasks", "post")]["security"] == [{"HTTPBearer": []}]
    assert "security" not in ops[("/healthz", "get")] and "security" not in ops[("/metrics", "get")]
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # every 422 is {"detail": "..."}
    codes = {key: {c for c in op["responses"] if c.startswith(("4", "5"))} for key, op in ops.items()}
    assert codes[("/healthz", "get")] == set() and codes[("/readyz", "get")] == {"503"}
    assert codes[("/tasks", "get")] == {"401", "403", "422", "503"}  # no 404 or 413 where none can happen
    assert "Link" in ops[("/tasks", "get")]["responses"]["200"]["headers"]
    assert codes[("/tasks/{name}", "delete")] == {"401", "403", "404", "422", "503"}
    assert codes[("/jobs/{job_id}/cancel", "post")] == {"401", "403", "404", "409", "422", "501", "503"}
    assert "504" in codes[("/tasks/{name}/predict", "post")] and "409" not in codes[("/jobs", "post")]
    for key, op in ops.items():
        for code in codes[key]:
            schema = op["responses"][code]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (key, code)
    assert ops[("/jobs/{job_id}", "get")]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobPublic"
    }
    assert ops[("/tasks/{name}", "delete")]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TaskDeleted"
    }


def test_start_up_objects_are_frozen_out_of_the_collector_while_serving(make_client):
    # a full collection over everything start-up built (~400k objects) stalls every request for ~190 ms
    import gc

    client = make_client()
    assert gc.get_freeze_count() > 100_000
    assert client.get("/healthz").status_code == 200
    client.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0


def test_keep_versions_prunes_what_post_tasks_registers(tmp_path, tiny_bert_dir, tiny_encoder):
    """serve --keep-versions 2: each POST /tasks is followed by a prune of that task; the current version answers."""
    from patchserve.patches.store import DiskRegistry

    reg = DiskRegistry(tmp_path / "reg")
    reg.retired_grace_s = 0.0  # no other replica here
    settings = settings_for(f"disk://{tmp_path}/reg", tiny_bert_dir, keep_versions=2)
    with TestClient(create_app(settings, registry=reg)) as client:
        for seed in range(1, 6):
            assert upload(client, make_patch(tiny_encoder, seed=seed)).status_code == 201
        listed = client.get("/tasks/sentiment").json()
        assert [v["version"] for v in listed["versions"]] == [4, 5] and listed["current"] == 5
        assert client.post("/tasks/sentiment/rollback", json={"version": 4}).status_code == 200
        assert client.post("/tasks/sentiment/rollback", json={"version": 2}).status_code == 404
        assert client.post("/tasks/sentiment/predict", json={"inputs": ["fine"]}).json()["version"] == 4


def test_start_up_reads_no_task_and_the_catalog_holds_what_was_asked_or_changed(
    tmp_path, tiny_bert_dir, tiny_encoder, monkeypatch
):
    from patchserve.patches.store import DiskRegistry

    reg = DiskRegistry(tmp_path / "reg", poll_interval=0.02)
    patch = make_patch(tiny_encoder, "t", seed=1)
    for i in range(30):
        reg.put(Patch(replace(patch.meta, task=f"t{i:02d}"), patch.biases, patch.head_weight, patch.head_bias))
    reads = []
    real = reg._read_manifest
    monkeypatch.setattr(reg, "_read_manifest", lambda task: reads.append(task) or real(task))  # a spy: counts
    app = create_app(settings_for(reg.url, tiny_bert_dir), registry=reg)
    with TestClient(app) as client:
        assert reads == []  # ready without reading any task's record
        catalog = app.state.service.catalog
        r = client.post("/tasks/t07/predict", json={"inputs": "good"})
        assert r.status_code == 200 and r.json()["version"] == 1
        assert set(reads) == {"t07"}
        # another replica's new version of a task held here is served (the watcher reads the change log's names)
        other = DiskRegistry(tmp_path / "reg")
        v2 = other.put(Patch(replace(patch.meta, task="t07"), patch.biases, patch.head_weight * 2, patch.head_bias))
        wait_until(lambda: client.post("/tasks/t07/predict", json={"inputs": "good"}).json()["version"] == 2, 10)
        assert v2.version == 2
        assert client.post("/tasks/t21/predict", json={"inputs": "good"}).json()["version"] == 1  # on first use
        assert set(reads) <= {"t07", "t21"}, set(reads)
        assert set(catalog.current) == {"t07", "t21"}
