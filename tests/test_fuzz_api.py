"""schemathesis against a real ``patchserve serve`` process: it reads /openapi.json and sends generated requests
(valid and invalid) to every route, a bounded number per route; no response may be a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import httpx

from tests.helpers import make_patch, served

TOKEN = "fuzz-admin"


def test_schemathesis_finds_no_server_error(redis_url, tiny_bert_dir, tiny_encoder, tmp_path):
    exe = shutil.which("schemathesis")
    assert exe, "schemathesis is not installed: pip install -e '.[test]'"
    registry = f"{redis_url}?prefix=fuzz-{uuid.uuid4().hex[:6]}:"  # Redis, so the job routes have a queue too
    env = {"PATCHSERVE_REGISTRY": registry, "PATCHSERVE_MODEL": str(tiny_bert_dir), "PATCHSERVE_DEVICE": "cpu"}
    with served(tmp_path, env, "--admin-token", TOKEN, "--slots", "4", "--workers", "2") as base:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        patch = make_patch(tiny_encoder, "sentiment")  # the task the schema's examples name
        r = httpx.post(f"{base}/tasks", files={"patch": ("p.safetensors", patch.data)}, headers=auth, timeout=30)
        assert r.status_code == 201, r.text
        run = subprocess.run(
            [
                exe,
                "run",
                f"{base}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "40",
                "--seed",
                "1",
                "--header",
                f"Authorization: Bearer {TOKEN}",
                "--request-timeout",
                "30",
                "--no-color",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        log = "".join(p.read_text() for p in tmp_path.glob("server-*.log"))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:] + log[-3000:]
    assert "Traceback" not in log, log[-3000:]
