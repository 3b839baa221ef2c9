"""The Open Inference Protocol (KServe v2) driven by the real ``tritonclient[http]`` package against a real
``patchserve serve`` process: its answers equal POST /tasks/{name}/predict for every kind, with JSON and binary
tensors, and its errors reach the client with the server's message."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from patchserve.patches.format import Patch
from tests.helpers import make_patch, served

TOKEN = "oip-predict"


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}  # a fresh dict: tritonclient adds its own headers to the one passed


TEXTS = ["the good movie", "a bad film", "what a boring plot and a very bad actor"]
PAIRS = ["a great film", "the movie", "good"]


def _pair_task(patch: Patch) -> Patch:
    return Patch(replace(patch.meta, text_pair=True), patch.biases, patch.head_weight, patch.head_bias)


@pytest.fixture(scope="module")
def server(tiny_bert_dir, tiny_encoder, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("oip")
    env = {"PATCHSERVE_MODEL": str(tiny_bert_dir), "PATCHSERVE_DEVICE": "cpu", "PATCHSERVE_REGISTRY": f"disk://{tmp}/r"}
    with served(tmp, env, "--predict-token", TOKEN, "--admin-token", "adm", "--slots", "4", "--workers", "2") as base:
        patches = [
            make_patch(tiny_encoder, "sentiment", seed=1),
            make_patch(tiny_encoder, "sentiment", seed=2),  # version 2 (current)
            _pair_task(make_patch(tiny_encoder, "sts", kind="regression", seed=3)),
            make_patch(tiny_encoder, "pos", kind="token-classification", seed=4),
        ]
        for p in patches:
            r = httpx.post(f"{base}/tasks", files={"patch": ("p", p.data)}, headers={"Authorization": "Bearer adm"})
            assert r.status_code == 201, r.text
        # each of the 2 front ends follows the registry on its own: wait until every one serves sentiment v2 (new
        # connections land on either), or a request to one and a request to the other see different versions
        deadline = time.monotonic() + 10
        while not all(_predict(base, "sentiment", ["x"], full=True)["version"] == 2 for _ in range(10)):
            assert time.monotonic() < deadline, "a front end did not pick up sentiment v2"
            time.sleep(0.1)
        yield base


def _client(base: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=base.removeprefix("http://"))


def _text_input(name: str, texts: list[str], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
    return tensor


def _predict(base: str, task: str, inputs: list, full: bool = False) -> Any:
    r = httpx.post(
        f"{base}/tasks/{task}/predict",
        json={"inputs": inputs, **({"all_scores": True} if task == "sentiment" else {})},
        headers=auth(),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json() if full else r.json()["predictions"]


def test_health_and_model_metadata(server):
    client = _client(server)
    assert client.is_server_live() and client.is_server_ready(headers=auth())
    assert client.is_model_ready("sentiment", headers=auth())
    assert client.is_model_ready("sentiment", model_version="1", headers=auth())
    assert not client.is_model_ready("missing", headers=auth())
    meta = client.get_model_metadata("sentiment", headers=auth())
    assert meta["versions"] == ["1", "2"] and meta["platform"] == "patchserve"
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("text", "BYTES"), ("text_pair", "BYTES")]
    assert {t["name"]: t["shape"] for t in meta["outputs"]} == {"label": [-1], "score": [-1], "logits": [-1, 2]}
    assert [t["name"] for t in client.get_model_metadata("pos", headers=auth())["outputs"]] == [
        "token",
        "label",
        "score",
    ]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_classification_answers_equal_predict(server, binary):
    client = _client(server)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "score", "logits")]
    result = client.infer("sentiment", [_text_input("text", TEXTS, binary)], outputs=outputs, headers=auth())
    expected = _predict(server, "sentiment", TEXTS)
    labels = [x.decode() if isinstance(x, bytes) else x for x in result.as_numpy("label")]
    assert labels == [p["label"] for p in expected]
    np.testing.assert_allclose(result.as_numpy("score"), [p["score"] for p in expected], rtol=1e-5)
    logits = result.as_numpy("logits")
    assert logits.shape == (3, 2)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(probs[:, 1], [p["scores"]["positive"] for p in expected], rtol=1e-4)
    assert result.get_response()["model_version"] == "2"


def test_a_stored_version_and_sentence_pairs_and_tagging(server):
    client = _client(server)
    v1 = client.infer("sentiment", [_text_input("text", TEXTS, True)], model_version="1", headers=auth())
    r = httpx.post(
        f"{server}/v2/models/sentiment/versions/1/infer",
        json={"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": TEXTS}]},
        headers=auth(),
    )
    assert r.status_code == 200 and r.json()["model_version"] == "1"
    assert v1.get_response()["model_version"] == "1"
    pair = client.infer(
        "sts", [_text_input("text", TEXTS, True), _text_input("text_pair", PAIRS, True)], headers=auth()
    )
    expected = _predict(server, "sts", [{"text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS, strict=True)])
    np.testing.assert_allclose(pair.as_numpy("value"), [p["value"] for p in expected], rtol=1e-5)
    tags = client.infer("pos", [_text_input("text", TEXTS, False)], headers=auth())
    expected = _predict(server, "pos", TEXTS)
    width = max(len(p["tokens"]) for p in expected)
    labels = tags.as_numpy("label")
    assert labels.shape == (3, width)
    for row, pred in zip(labels, expected, strict=True):
        got = [x.decode() if isinstance(x, bytes) else x for x in row]
        assert got == [t["label"] for t in pred["tokens"]] + [""] * (width - len(pred["tokens"]))


def test_errors_reach_the_client_with_the_servers_message(server):
    client = _client(server)
    with pytest.raises(InferenceServerException, match="task 'missing' is not registered"):
        client.infer("missing", [_text_input("text", TEXTS, True)], headers=auth())
    with pytest.raises(InferenceServerException, match="Bearer"):
        client.infer("sentiment", [_text_input("text", TEXTS, True)])  # the same auth as predict
    with pytest.raises(InferenceServerException, match="scores sentence pairs"):
        client.infer("sts", [_text_input("text", TEXTS, True)], headers=auth())
    with pytest.raises(InferenceServerException, match="unknown output 'probabilities'"):
        client.infer(
            "sentiment",
            [_text_input("text", TEXTS, True)],
            outputs=[triton.InferRequestedOutput("probabilities")],
            headers=auth(),
        )
    wrong = triton.InferInput("text", [2], "FP32")
    wrong.set_data_from_numpy(np.zeros(2, dtype=np.float32))
    with pytest.raises(InferenceServerException, match="must be BYTES"):
        client.infer("sentiment", [wrong], headers=auth())
    r = httpx.post(
        f"{server}/v2/models/sentiment/infer", content=b"{}", headers=auth() | {"Inference-Header-Content-Length": "99"}
    )
    assert r.status_code == 422 and "Inference-Header-Content-Length" in r.json()["error"]
