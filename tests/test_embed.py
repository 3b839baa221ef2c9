"""Embeddings per task: the engine's pooled vectors equal the reference model's under each patch (and the plain
model's for the base), in mixed batches; the HTTP routes; and the real ``openai`` package against /v1."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from patchserve.patches.encoder import load_encoder
from patchserve.patches.model import TaskModel, pool
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import Runner
from tests.helpers import make_patch, served

TEXTS = ["the good movie", "a bad film", "what a boring plot"]


def reference_vector(encoder, patch, text: str) -> torch.Tensor:
    """The pooled vector (before the head) of the plain HF model with ``patch`` applied (None: the base)."""
    model = copy.deepcopy(encoder.model).eval()
    pooling = encoder.default_pooling
    if patch is not None:
        model = TaskModel.from_patch(model, patch).encoder
        pooling = patch.meta.pooling
    enc = encoder.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    return pool(pooling, out.last_hidden_state, enc["attention_mask"], getattr(out, "pooler_output", None))[0]


def test_embedding_rows_equal_the_reference_in_mixed_batches(tiny_bert_dir, tiny_encoder):
    a = make_patch(tiny_encoder, "a", seed=1, pooling="mean")
    b = make_patch(tiny_encoder, "b", seed=2, pooling="cls")
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2)
    tok = tiny_encoder.tokenizer
    rows, expected = [], []
    for i, text in enumerate(TEXTS * 2):
        ids = tok(text)
        patch = [a, b, None][i % 3]
        rows.append(Row(ids["input_ids"], ids["token_type_ids"], patch, "embedding"))
        expected.append(reference_vector(tiny_encoder, patch, text))
    rows.append(Row(tok("good")["input_ids"], tok("good")["token_type_ids"], a, "logits"))  # a head row beside them
    out = runner.run(rows)
    for got, want in zip(out, expected, strict=False):
        assert got.shape == (tiny_encoder.hidden_size,)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert out[-1].shape == (2,)  # the logits row still gets its head
    base = runner.run(
        [Row(tok("the good movie")["input_ids"], tok("the good movie")["token_type_ids"], None, "embedding")]
    )
    assert not torch.allclose(base[0], out[0], atol=1e-3), "a patch must change the embedding"
    torch.testing.assert_close(base[0], reference_vector(tiny_encoder, None, "the good movie"), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def server(tiny_bert_dir, tiny_encoder, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("embed")
    env = {"PATCHSERVE_MODEL": str(tiny_bert_dir), "PATCHSERVE_DEVICE": "cpu", "PATCHSERVE_REGISTRY": f"disk://{tmp}/r"}
    with served(tmp, env, "--predict-token", "pr3d", "--admin-token", "adm", "--slots", "4", "--workers", "2") as base:
        for patch in (make_patch(tiny_encoder, "sentiment", seed=1), make_patch(tiny_encoder, "topic", seed=2)):
            r = httpx.post(f"{base}/tasks", files={"patch": ("p", patch.data)}, headers={"Authorization": "Bearer adm"})
            assert r.status_code == 201, r.text
        yield base


AUTH = {"Authorization": "Bearer pr3d"}


def test_embed_routes(server, tiny_encoder):
    r = httpx.post(f"{server}/tasks/sentiment/embed", json={"inputs": TEXTS}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["task"], body["version"], body["pooling"]) == ("sentiment", 1, "mean")
    assert body["model"] == tiny_encoder.name
    assert body["dimensions"] == tiny_encoder.hidden_size and body["truncated"] == [False] * 3
    patch = make_patch(tiny_encoder, "sentiment", seed=1)
    for text, vector in zip(TEXTS, body["embeddings"], strict=True):
        np.testing.assert_allclose(vector, reference_vector(tiny_encoder, patch, text).numpy(), atol=1e-5)
    unit = httpx.post(f"{server}/tasks/sentiment/embed", json={"inputs": TEXTS, "normalize": True}, headers=AUTH)
    np.testing.assert_allclose(np.linalg.norm(unit.json()["embeddings"], axis=1), 1.0, atol=1e-6)
    base = httpx.post(f"{server}/embed", json={"inputs": "the good movie"}, headers=AUTH).json()
    assert base["task"] is None and base["patch_id"] is None and base["pooling"] == tiny_encoder.default_pooling
    np.testing.assert_allclose(base["embeddings"][0], reference_vector(tiny_encoder, None, "the good movie"), atol=1e-5)
    # the same auth, limits and checks as predict
    assert httpx.post(f"{server}/embed", json={"inputs": "x"}).status_code == 401
    r = httpx.post(f"{server}/tasks/missing/embed", json={"inputs": "x"}, headers=AUTH)
    assert r.status_code == 404 and "not registered" in r.json()["detail"]
    r = httpx.post(f"{server}/tasks/sentiment/embed", json={"inputs": "x", "normalise": True}, headers=AUTH)
    assert r.status_code == 422 and "normalise" in r.json()["detail"]
    metrics = httpx.get(f"{server}/metrics").text
    assert 'patchserve_requests_total{status="200",task="_other"}' in metrics  # no series per task by default
    assert 'patchserve_requests_total{status="200",task="_base"}' in metrics


def test_the_openai_client_works_unchanged(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="pr3d", max_retries=0)
    direct = httpx.post(f"{server}/tasks/topic/embed", json={"inputs": TEXTS, "normalize": True}, headers=AUTH).json()
    for fmt in ("float", "base64"):
        result = client.embeddings.create(model="topic", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in result.data] == [0, 1, 2] and result.model == "topic"
        vectors = [d.embedding for d in result.data]
        if fmt == "base64":  # the client hands base64 back as it came
            vectors = [np.frombuffer(__import__("base64").b64decode(v), dtype="<f4") for v in vectors]
        np.testing.assert_allclose(np.array(vectors), direct["embeddings"], atol=1e-6)
        assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)
    base = client.embeddings.create(model="base", input="the good movie")
    assert len(base.data) == 1 and abs(np.linalg.norm(base.data[0].embedding) - 1) < 1e-6
    assert {m.id for m in client.models.list()} == {"base", "sentiment", "topic"}
    with pytest.raises(openai.NotFoundError, match="not registered"):
        client.embeddings.create(model="missing", input="x")
    with pytest.raises(openai.UnprocessableEntityError, match="token ids"):
        client.embeddings.create(model="topic", input=[[1, 2, 3]])
    stranger = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="neither the predict token"):
        stranger.embeddings.create(model="topic", input="x")
