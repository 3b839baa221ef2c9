"""Many tasks on one server: what 100, 10,000 and 100,000 registered tasks cost a `patchserve serve --workers 2`.

    python bench/scale.py --quick     # 100 and 10,000 tasks, both registries, short phases; last line: JSON
    python bench/scale.py             # 100, 10,000 and 100,000 -> docs/benchmarks/scale.{jsonl,md,png}

Per registry (a throwaway redis-server, or one disk folder), filled to each size in turn (tasks ``task000000``, ...:
one small patch each, registered through the registry API) with a 1-layer hidden-32 BERT, so that the encoder's
work is small and what grows with the tasks shows:

* ready: from starting ``patchserve serve`` to its first 200 on /readyz, the median of ``--startups`` start-ups (one
  varies by seconds on shared cores);
* GET /tasks: the first page (the default limit), median of 20 on one connection, and its size;
* /metrics: median of 10, and its size, at start and again after the traffic (with the series it made);
* cold: COLD_CLIENTS clients at once (each warmed by 4 predicts of the most popular task), each asking in turn for
  tasks the server has not served yet (up to 200 in all, one row each, before any traffic): the latency of those
  first predicts, p50 and p99;
* traffic: 16 clients, one-row predicts, for a task drawn by zipf(1.1) over every task against one task only;
  phases alternate (one, zipf, one, zipf, ...), each zipf phase drawing anew (the popular tasks stay popular, the
  tail brings tasks not seen yet), requests a second are medians; failed counts every non-200;
* visible: a task asked for 8 times (so both front ends hold it), a new version of it registered through the
  registry API, then predicts on new connections (spread over both front ends by the kernel) until 8 answers in a
  row carry it: the time the first of those 8 was sent
  (an answer with the old version before it restarts the run); 5 times, the median and the largest;
* RSS: the server's processes together (supervisor, engine, front ends) after the traffic.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import asyncio
import itertools
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

import httpx

from bench.common import OUT, append_run, latest_run, pyplot, random_bert_folder, rss_mb
from patchserve.local import free_port, patchserve_process, start_redis, wait_ready
from patchserve.patches.encoder import load_encoder
from patchserve.patches.format import Patch
from patchserve.patches.store import open_registry
from patchserve.patches.synthetic import random_patch

CLIENTS = 16
COLD_CLIENTS = 8
COLD_TASKS = 200
FILLERS = 4  # processes registering the tasks
ZIPF_S = 1.1
TEXT = "the good movie"


def task_name(i: int) -> str:
    return f"task{i:06d}"


def fill(url: str, template: Patch, start: int, stop: int) -> float:
    """Register tasks ``start`` .. ``stop - 1`` (one version each) from FILLERS processes at once (the registries
    take writers in parallel; the disk registry's fsyncs leave a core idle otherwise); the seconds it took."""
    t0 = time.perf_counter()
    chunks = [(url, template, i, min(i + 1000, stop)) for i in range(start, stop, 1000)]
    with multiprocessing.get_context("spawn").Pool(FILLERS) as pool:
        pool.starmap(_fill_chunk, chunks)
    return time.perf_counter() - t0


def _fill_chunk(url: str, template: Patch, start: int, stop: int) -> None:
    registry = open_registry(url)
    try:
        for i in range(start, stop):
            registry.put(Patch(replace(template.meta, task=task_name(i)), *_tensors(template)))
    finally:
        registry.close()


def _tensors(p: Patch) -> tuple[Any, ...]:
    return p.biases, p.head_weight, p.head_bias


def _median_ms(fn: Any, n: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        size = len(fn())
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2), size


async def _traffic(
    base: str, tasks: list[str], weights: list[float] | None, seconds: float, seed: int = 0
) -> tuple[float, int]:
    """Requests a second and failures of CLIENTS clients predicting one row at a time for ``seconds`` (the tasks
    drawn by ``weights`` with ``seed``)."""
    done, failed = 0, 0
    rng = random.Random(seed)
    cum = list(itertools.accumulate(weights)) if weights else None
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done, failed
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            while time.perf_counter() < deadline:
                task = tasks[0] if cum is None else rng.choices(tasks, cum_weights=cum)[0]
                try:
                    r = await http.post(f"/tasks/{task}/predict", json={"inputs": TEXT})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                done += ok
                failed += not ok

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return done / (time.perf_counter() - t0), failed


async def _cold(base: str, tasks: list[str], warm: str) -> tuple[float, float]:
    """p50 and p99 (ms) of first predicts: COLD_CLIENTS clients at once, each asking in turn for its share of
    ``tasks`` (none served yet), after a few predicts of ``warm`` on each connection (what is timed is a task's
    first request, not the processes' or a connection's)."""
    times: list[float] = []

    async def client(mine: list[str]) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for _ in range(4):
                (await http.post(f"/tasks/{warm}/predict", json={"inputs": TEXT})).raise_for_status()
            for task in mine:
                t0 = time.perf_counter()
                r = await http.post(f"/tasks/{task}/predict", json={"inputs": TEXT})
                r.raise_for_status()
                times.append((time.perf_counter() - t0) * 1000)

    await asyncio.gather(*(client(tasks[i::COLD_CLIENTS]) for i in range(COLD_CLIENTS)))
    times.sort()
    return round(statistics.median(times), 1), round(times[min(len(times) - 1, int(0.99 * len(times)))], 1)


def _visible(base: str, url: str, template: Patch, task: str, seed: int) -> float:
    """Register a new version of ``task`` and wait until 8 answers in a row on new connections carry it; ms. The
    task is asked for first, so that every front end holds it: the new version must come through its watcher (a
    front end that never served a task reads it from the registry on first use, and sees any version at once)."""
    for _ in range(8):
        httpx.post(f"{base}/tasks/{task}/predict", json={"inputs": TEXT}, timeout=30).raise_for_status()
    registry = open_registry(url)
    try:
        patch = random_patch_like(template, task, seed)
        t0 = time.perf_counter()
        info = registry.put(patch)
    finally:
        registry.close()
    in_a_row, since = 0, 0.0
    while in_a_row < 8:
        sent = time.perf_counter()
        r = httpx.post(f"{base}/tasks/{task}/predict", json={"inputs": TEXT}, timeout=30)
        if r.status_code == 200 and r.json()["version"] == info.version:
            since = since if in_a_row else sent  # the run's first request was sent then
            in_a_row += 1
        else:
            in_a_row = 0
        if time.perf_counter() - t0 > 60:
            return float("inf")
    return (since - t0) * 1000


def random_patch_like(template: Patch, task: str, seed: int) -> Patch:
    rng = random.Random(seed)
    biases = {k: v + rng.random() * 1e-3 for k, v in template.biases.items()}  # new content: a new patch id
    return Patch(replace(template.meta, task=task), biases, template.head_weight, template.head_bias)


def measure(name: str, url: str, n: int, model: Path, template: Patch, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-scale-")) / "server.log"
    serve = ["serve", "--port", str(port), "--model", str(model), "--device", "cpu", "--registry", url]
    serve += ["--workers", "2"]
    base = f"http://127.0.0.1:{port}"
    readies = []
    for _ in range(args.startups - 1):  # start-ups only: the last one below serves the rest
        t0 = time.perf_counter()
        with patchserve_process(serve, {}, log) as proc:
            wait_ready(base, timeout=600, proc=proc)
            readies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    with patchserve_process(serve, {}, log) as proc:
        wait_ready(base, timeout=600, proc=proc)
        readies.append(time.perf_counter() - t0)
        ready_s = statistics.median(readies)
        with httpx.Client(base_url=base, timeout=60) as http:
            page_ms, page_bytes = _median_ms(lambda: http.get("/tasks").content, 20)
            metrics_ms, metrics_bytes = _median_ms(lambda: http.get("/metrics").content, 10)
        tasks = [task_name(i) for i in range(n)]
        weights = [1 / (k + 1) ** ZIPF_S for k in range(n)]
        random.Random(1).shuffle(tasks)  # the popular tasks anywhere in the name order
        cold = tasks[-5 - min(COLD_TASKS, n - 6) : -5]  # the least popular (not the one task of the traffic)
        cold_p50, cold_p99 = asyncio.run(_cold(base, cold, warm=tasks[0]))
        one, many, failed = [], [], 0
        for i in range(args.repeats):
            rps, f1 = asyncio.run(_traffic(base, tasks, None, args.phase_seconds))
            one.append(rps)
            rps, f2 = asyncio.run(_traffic(base, tasks, weights, args.phase_seconds, seed=i))
            many.append(rps)
            failed += f1 + f2
        visible = [_visible(base, url, template, tasks[-1 - i], i) for i in range(5)]
        rss = rss_mb(proc.pid)
        with httpx.Client(base_url=base, timeout=60) as http:  # again, with the series the traffic made
            metrics_after_ms, metrics_after_bytes = _median_ms(lambda: http.get("/metrics").content, 10)
    row = {
        "kind": "scale",
        "backend": name,
        "tasks": n,
        "ready_s": round(ready_s, 2),
        "page_ms": page_ms,
        "page_bytes": page_bytes,
        "metrics_ms": metrics_ms,
        "metrics_bytes": metrics_bytes,
        "metrics_after_ms": metrics_after_ms,
        "metrics_after_bytes": metrics_after_bytes,
        "rps_one_task": round(statistics.median(one), 1),
        "rps_zipf": round(statistics.median(many), 1),
        "zipf_vs_one": round(statistics.median(many) / statistics.median(one), 3),
        "failed": failed,
        "cold_p50_ms": cold_p50,
        "cold_p99_ms": cold_p99,
        "visible_p50_ms": round(statistics.median(visible), 1),
        "visible_max_ms": round(max(visible), 1),
        "rss_mb": round(rss, 1),
    }
    print(json.dumps(row), file=sys.stderr)
    return row


def run_backend(name: str, url: str, sizes: list[int], model: Path, template: Patch, args: argparse.Namespace) -> list:
    rows, have = [], 0
    for n in sizes:
        seconds = fill(url, template, have, n)
        print(f"scale: {name}: {n} tasks registered ({n - have} in {seconds:.1f} s)", file=sys.stderr)
        have = n
        rows.append(measure(name, url, n, model, template, args))
    return rows


def render(jsonl: Path) -> None:
    meta, rows = latest_run(jsonl)
    md = [
        "# Many tasks on one server",
        "",
        f"Written by `{meta['command']}` on {meta['machine']}, {meta['date']} (torch {meta['torch']}, commit "
        f"{meta['commit']}). `patchserve serve --workers 2` on the CPU with a 1-layer hidden-32 BERT, tasks registered "
        f"through the registry API; {CLIENTS} clients (one process, asyncio) and the server share the machine's "
        f"cores. Traffic: {meta['phase_seconds']:g} s phases, one task and zipf({ZIPF_S}) over every task "
        f"alternating, medians of {meta['repeats']}. What each column is: the docstring of bench/scale.py.",
        "",
        "Goals (issue 97), at 100,000 tasks: ready <= 1.2x the time with 100, RSS <= 1.2x, first page <= 20 ms, "
        "/metrics <= 50 ms, zipf traffic >= 0.8x one task with 0 failed, cold first predict p99 <= 50 ms with "
        f"{COLD_CLIENTS} clients, a new version on every front end within 1 s.",
        "",
        "| registry | tasks | ready s | GET /tasks ms | bytes | /metrics ms | bytes | after traffic ms | bytes | "
        "req/s one task | zipf | zipf / one | failed | cold p50 ms | p99 | new version visible p50 ms | max | RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['backend']} | {r['tasks']:,} | {r['ready_s']} | {r['page_ms']} | {r['page_bytes']:,} | "
            f"{r['metrics_ms']} | {r['metrics_bytes']:,} | {r['metrics_after_ms']} | {r['metrics_after_bytes']:,} | "
            f"{r['rps_one_task']} | {r['rps_zipf']} | "
            f"**{r['zipf_vs_one']:.2f}x** | {r['failed']} | {r.get('cold_p50_ms', '-')} | "
            f"{r.get('cold_p99_ms', '-')} | {r['visible_p50_ms']} | {r['visible_max_ms']} | {r['rss_mb']} |"
        )
    (jsonl.parent / "scale.md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for backend in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == backend]
        xs = [r["tasks"] for r in mine]
        for ax, key, label in zip(
            axes,
            ("ready_s", "page_ms", "zipf_vs_one", "visible_p50_ms"),
            ("ready (s)", "GET /tasks first page (ms)", "zipf / one task", "new version visible (ms)"),
            strict=True,
        ):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=backend)
            ax.set(xscale="log", xlabel="tasks", title=label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(jsonl.parent / "scale.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 and 10,000 tasks, 3 s phases; prints JSON")
    ap.add_argument("--backends", default="redis,disk", help="registries to run (redis, disk)")
    ap.add_argument("--tasks", default="100,10000,100000", help="registry sizes, ascending (comma-separated)")
    ap.add_argument("--phase-seconds", type=float, default=10.0, help="length of each traffic phase")
    ap.add_argument("--repeats", type=int, default=3, help="traffic phases each way")
    ap.add_argument("--startups", type=int, default=3, help="start-ups timed for 'ready' (their median)")
    ap.add_argument("--out", type=Path, default=OUT / "scale.jsonl", help="JSON lines of full runs (appended)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    if args.quick:
        args.tasks, args.phase_seconds, args.repeats, args.startups = "100,10000", 3.0, 2, 1
    sizes = sorted(int(x) for x in args.tasks.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    model = random_bert_folder(
        work / "model", num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64
    )
    template = random_patch(load_encoder(str(model)), "task", seed=1)
    results = []
    for name in args.backends.split(","):
        if name == "redis":
            proc, url = start_redis(work)
            try:
                results += run_backend(name, url, sizes, model, template, args)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        else:
            results += run_backend(name, f"disk://{work / 'registry'}", sizes, model, template, args)
    if not args.quick:
        meta = {
            "command": "python bench/scale.py " + " ".join(sys.argv[1:]),
            "phase_seconds": args.phase_seconds,
            "repeats": args.repeats,
            "startups": args.startups,
        }
        append_run(args.out, meta, results)
        render(args.out)
        print(f"wrote {args.out}, scale.md, scale.png", file=sys.stderr)
    largest = [r for r in results if r["tasks"] == sizes[-1]]
    keys = ("ready_s", "page_ms", "zipf_vs_one", "cold_p99_ms", "visible_max_ms")
    print(json.dumps({f"{r['backend']}_{k}": r[k] for r in largest for k in keys}))


if __name__ == "__main__":
    main()
