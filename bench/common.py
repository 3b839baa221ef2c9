"""What the HTTP-level benchmarks share: real sentences, percentiles, the machine they ran on, the server's own
Prometheus figures, a registry filled with distinct tasks, and wrk (the load generator) driven with a Lua script.

wrk (Debian's ``wrk``, ``apt-get install wrk``) is the load: a C, event-driven HTTP/1.1 client in its own process,
so the generator never competes with the server for Python's interpreter; closed loop with a fixed number of
connections (= the concurrency), HdrHistogram latency percentiles, and a Lua hook that gives every request its own
path and body (a task and its inputs) from a table written here.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
DATA = ROOT.parent / "shared" / "data"

# --model FREE: a model that costs almost nothing (the default encoder's real tokenizer over a random BERT of one
# layer, hidden 32), so that a benchmark of the server measures what is around the model, not the model
FREE_MODEL = "FREE"
FREE_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
}


def random_bert_folder(folder: Path, seed: int = 0, **config: Any) -> Path:
    """A random BERT of ``config`` with the default encoder's tokenizer (a real WordPiece vocabulary of 30,522
    tokens), saved as a Hugging Face folder: real tokenising, synthetic weights."""
    from transformers import AutoTokenizer

    from patchserve.patches.encoder import default_encoder_path
    from patchserve.patches.synthetic import random_bert

    return random_bert(folder, AutoTokenizer.from_pretrained(default_encoder_path()), seed=seed, **config)


def model_source(model: str, work: Path) -> str:
    """What ``--model`` names as a source the server loads: FREE is built under ``work``; anything else as given."""
    if model != FREE_MODEL:
        return model
    return str(random_bert_folder(work / "free-model", **FREE_CONFIG))


def sentences(data: Path, seed: int) -> list[str]:
    """Every dev sentence of the shared sets (text, or a tagging set's tokens joined), shuffled."""
    texts: list[str] = []
    for f in sorted(data.glob("*/dev.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                texts.append(row["text"] if "text" in row else " ".join(row["tokens"]))
    if not texts:
        raise SystemExit(f"no */dev.jsonl under {data}: pass --data with the shared evaluation sets")
    random.Random(seed).shuffle(texts)
    return texts


def batch_rows_axis(arg: str | None, device: str) -> list[int]:
    """The row bounds a grid runs (``--max-batch-rows``, comma-separated); unset, ``serve``'s default for the
    device, resolved as the engine resolves it (``auto``, ``mps``)."""
    from patchserve.server.engine.local import max_batch_rows
    from patchserve.server.settings import ServerSettings

    return [int(x) for x in (arg or str(max_batch_rows(ServerSettings(device=device)))).split(",")]


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` and every process below it (a server's engine and front ends), in MB."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:  # it ended meanwhile
            continue
        total += next((int(x.split()[1]) for x in status.split("\n") if x.startswith("VmRSS:")), 0)
        stack += [int(c) for c in children]
    return total / 1024 if total else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def count_ops(fn: Callable[[], object], device: Any) -> int:
    """ATen ops (CPU) or host-side launches -- kernels, graph launches, copies -- (CUDA) of one call of ``fn``,
    after one warm call (a CUDA graph is captured outside the count)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    if cuda:
        return sum(1 for n in names if "LaunchKernel" in n or "GraphLaunch" in n or n.startswith("cudaMemcpy"))
    return sum(1 for n in names if n.startswith("aten::"))


#: the instruction sets that decide a CPU run's arithmetic (the trainer's bfloat16 products) and speed
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")


def cpu_name() -> str:
    """This CPU as /proc/cpuinfo names it, with the instruction sets of ``CPU_FLAGS`` it has ("AMD EPYC (avx512f,
    avx512_bf16)"): machines of one name here differ in them, and with them in a run's arithmetic."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    have = [f for f in CPU_FLAGS if f in flags]
    name = name or platform.processor() or platform.machine()
    return f"{name} ({', '.join(have)})" if have else name


def machine() -> dict[str, Any]:
    """Where and with what a benchmark ran: recorded with every result line."""
    import torch

    from patchserve import __version__

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "patchserve": __version__,
        "commit": commit.stdout.strip() or None,
    }


def server_figures(metrics_text: str) -> dict[str, float]:
    """The server's batch totals from its /metrics text: rows, batches and seconds spent in forward passes, slot
    misses and evictions."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"batch_rows": 0.0, "batches": 0.0, "batch_seconds": 0.0, "slot_misses": 0.0, "slot_evictions": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "patchserve_batch_rows_sum":
                out["batch_rows"] = s.value
            elif s.name == "patchserve_batch_rows_count":
                out["batches"] = s.value
            elif s.name == "patchserve_batch_seconds_sum":
                out["batch_seconds"] = s.value
            elif s.name == "patchserve_slot_events_total" and s.labels.get("event") in ("miss", "eviction"):
                out["slot_" + {"miss": "misses", "eviction": "evictions"}[s.labels["event"]]] = s.value
    return out


def fill_registry(url: str, patches: Iterable[Any]) -> float:
    """Register ``patches`` straight into the registry at ``url`` (no server); returns the seconds it took."""
    from patchserve.patches.store import open_registry

    registry = open_registry(url)
    t0 = time.perf_counter()
    try:
        for p in patches:
            registry.put(p)
    finally:
        registry.close()
    return time.perf_counter() - t0


def append_run(out: Path, meta: dict[str, Any], lines: list[dict[str, Any]]) -> None:
    """Append one full run to the JSON lines file ``out``: a ``meta`` line (what ran, where: ``machine()`` added)
    then ``lines``, every one tagged with the same new run id."""
    run_id = f"{time.strftime('%Y-%m-%d')}-{random.Random().getrandbits(32):08x}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for line in ({"kind": "meta", **machine(), **meta}, *lines):
            f.write(json.dumps({"run": run_id, **line}) + "\n")


def latest_run(jsonl: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The newest run in ``jsonl``: its meta line and its other lines."""
    lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    meta = next(x for x in reversed(lines) if x["kind"] == "meta")
    return meta, [x for x in lines if x.get("run") == meta["run"] and x["kind"] != "meta"]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (with a note) where the plot extra is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", file=sys.stderr)
        return None
    return plt


def plot_cdf(ax: Any, values: list[float], label: str) -> None:
    """The empirical distribution of ``values`` on ``ax``: the fraction at or below each value."""
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


# --- wrk -----------------------------------------------------------------------------------------------------------
_WRK_SCRIPT = """
local requests = {%s}
local n = #requests
local i = math.random(n)
request = function()
  i = i %% n + 1
  local r = requests[i]
  return wrk.format("POST", r[1], {["Content-Type"] = "application/json"%s}, r[2])
end
done = function(summary, latency, _)
  local e = summary.errors
  io.write(string.format(
    'WRK {"requests": %%d, "duration_us": %%d, "connect": %%d, "read": %%d, "write": %%d, "status": %%d, ' ..
    '"timeout": %%d, "p50_us": %%d, "p95_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(95), latency:percentile(99), latency.max))
end
"""


def _lua_string(s: str) -> str:
    level = 0
    while f"]{'=' * level}]" in s:
        level += 1
    return f"[{'=' * level}[{s}]{'=' * level}]"


def wrk_script(path: Path, requests: list[tuple[str, dict[str, Any]]], token: str | None = None) -> Path:
    """A wrk Lua script that cycles through ``requests`` ((path, JSON body) pairs) from a random start."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    rows = ",".join(f"{{{_lua_string(p)},{_lua_string(json.dumps(b))}}}" for p, b in requests)
    auth = f', ["Authorization"] = "Bearer {token}"' if token else ""
    path.write_text(_WRK_SCRIPT % (rows, auth))
    return path


def run_wrk(base: str, script: Path, connections: int, seconds: float, threads: int = 1) -> dict[str, Any]:
    """wrk with ``connections`` open connections (the concurrency) for ``seconds``; its figures, latencies in ms."""
    cmd = ["wrk", "-t", str(min(threads, connections)), "-c", str(connections), "-d", f"{seconds:g}s"]
    cmd += ["--timeout", "60s", "-s", str(script), base]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{done.stdout}\n{done.stderr}")
    raw = json.loads(line[4:])
    errors = sum(raw[k] for k in ("connect", "read", "write", "status", "timeout"))
    return {
        "requests": raw["requests"],
        "seconds": raw["duration_us"] / 1e6,
        "errors": errors,
        "rps": raw["requests"] / (raw["duration_us"] / 1e6),
        **{f"p{q}_ms": raw[f"p{q}_us"] / 1e3 for q in (50, 95, 99)},
        "max_ms": raw["max_us"] / 1e3,
    }
