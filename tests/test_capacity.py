"""Capacity: a server with BERT-base dimensions accepts 10,000 slots, holds 10,000 tasks resident at once in under
2 GB of bank memory in half precision, and serves each task with its own biases and head (issue 15).

The encoder has BERT-base's layer stack (12 layers, hidden 768, 12 heads, intermediate 3072) with random weights
and the tiny test vocabulary: what a task costs depends on the layer stack, not on the vocabulary. The tasks train
the query and intermediate biases (a subset that keeps 10,000 patch files at 1.9 GB in the registry); every slot
still holds a full folded bank row, the same size whatever a patch trains.
"""

from __future__ import annotations

import random

import pytest
import torch
from fastapi.testclient import TestClient

from patchserve.patches.bitfit import apply_values
from patchserve.patches.encoder import load_encoder
from patchserve.patches.model import pool
from patchserve.patches.store import open_registry
from patchserve.server.app import create_app
from patchserve.server.settings import ServerSettings
from tests.helpers import make_patch, make_tiny_bert_folder, start_redis

BERT_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 64,
}
N_TASKS = 10_000
LABELS = [f"l{i}" for i in range(8)]
TEXT = "the good movie was very fun"


@pytest.fixture(scope="module")
def bert_base_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_bert_folder(tmp_path_factory.mktemp("bert-base"), seed=3, **BERT_BASE)


def reference_scores(model, tokenizer, patch) -> torch.Tensor:
    """Class probabilities from the plain HF model in float32 with the patch's biases applied."""
    apply_values(model, patch.biases)
    enc = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    pooled = pool("mean", out.last_hidden_state, enc["attention_mask"], out.pooler_output)
    return torch.softmax(pooled @ patch.head_weight.T + patch.head_bias, dim=-1)[0]


def test_server_holds_and_serves_10000_bert_base_tasks_in_half_precision(bert_base_dir, tmp_path):
    encoder = load_encoder(str(bert_base_dir))
    reference = load_encoder(str(bert_base_dir))
    sample = [0, N_TASKS - 1, *random.Random(0).sample(range(1, N_TASKS - 1), 22)]
    kept = {}  # only the sampled patches stay in memory (10,000 would hold 3.8 GB here)
    proc, url = start_redis(tmp_path)
    try:
        registry = open_registry(url)
        for i in range(N_TASKS):
            patch = make_patch(
                encoder, f"task{i}", labels=LABELS, subset="query-intermediate", seed=i + 1, scale=0.2, head_scale=0.05
            )
            registry.put(patch)
            if i in sample:
                kept[i] = patch
        registry.close()
        settings = ServerSettings(
            registry=url, device="cpu", dtype="bfloat16", slots=N_TASKS, preload=True, host_cache_mb=64
        )
        with TestClient(create_app(settings, encoder=encoder)) as client:
            runner = client.app.state.service.engine.runner
            # every task resident at once, in half-precision banks under 2 GB
            assert len(runner.slots) == N_TASKS and runner.slots.stats.misses == N_TASKS
            packed, heads = runner.backend.packed, runner.backend.head_bank
            per_task = packed.bank_bytes_per_slot + heads.weight[0].nbytes + heads.bias[0].nbytes
            assert per_task == runner.slot_bytes and packed.banks["0.qkv"].dtype == torch.bfloat16
            assert per_task * N_TASKS < 2e9, f"{per_task} bytes per task"

            served = {}
            for i in sample:
                r = client.post(f"/tasks/task{i}/predict", json={"inputs": [TEXT], "all_scores": True})
                assert r.status_code == 200, r.text
                scores = r.json()["predictions"][0]["scores"]
                served[i] = torch.tensor([scores[label] for label in LABELS])
            # served from the resident slots: no task was loaded again, none evicted
            assert runner.slots.stats.misses == N_TASKS and runner.slots.stats.evictions == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    expected = {i: reference_scores(reference.model, reference.tokenizer, kept[i]) for i in sample}
    for i in sample:
        # its own task's answer (bfloat16 against float32), and nearer to it than to any other sampled task's
        assert torch.allclose(served[i], expected[i], atol=0.03), (i, served[i], expected[i])
        distances = {j: float((served[i] - expected[j]).abs().max()) for j in sample}
        assert min(distances, key=distances.__getitem__) == i


def test_preload_fills_free_slots_with_the_most_recent_tasks_and_evicts_none(tiny_bert_dir, tiny_encoder, tmp_path):
    url = f"disk://{tmp_path}/reg"
    registry = open_registry(url)
    patches = [make_patch(tiny_encoder, f"t{i}", seed=i + 1) for i in range(5)]
    for p in patches:
        registry.put(p)
    registry.close()
    common = {"registry": url, "model": str(tiny_bert_dir), "device": "cpu", "slots": 3}
    with TestClient(create_app(ServerSettings(**common))) as client:  # off by default: nothing resident
        assert len(client.app.state.service.engine.runner.slots) == 0
    with TestClient(create_app(ServerSettings(**common, preload=True))) as client:
        slots = client.app.state.service.engine.runner.slots
        assert len(slots) == 3 and slots.stats.evictions == 0
        assert {p.patch_id for p in patches[2:]} == {p.patch_id for p in patches if p.patch_id in slots}
        for i in (2, 3, 4):  # resident: answered without a load
            assert client.post(f"/tasks/t{i}/predict", json={"inputs": "the good movie"}).status_code == 200
        assert slots.stats.misses == 3
