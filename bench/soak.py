"""Soak: a real `patchserve serve` process under mixed-task traffic at a fixed rate, with a new version registered
every second, after a phase of the largest requests the server allows beside /healthz probes.

    python bench/soak.py                    # 30 min soak after a 2 min limits phase; writes docs/benchmarks/soak.*
    python bench/soak.py --quick            # 60 s soak after a 20 s limits phase; prints the headline JSON last

The server runs as its own process (default encoder, a Redis registry on a throwaway redis-server, fewer device
slots than tasks, so slots churn); this process is the load generator. Phases:

1. limits: two clients send, back to back, the largest predict requests the server's limits allow (256 inputs of
   8192 characters for a task that reads 512 tokens; and 8 MiB bodies of 8 texts), while /healthz is probed every
   50 ms. Reports the probes'
   latency (goal: p99 < 100 ms). The big requests may time out (504) on a small CPU: that is their answer, not a
   failure of the soak.
2. soak: --rate requests/s, open loop (a request is sent on schedule whether or not earlier ones have answered),
   each of 1-4 real sentences for one of --tasks tasks, plus one POST /tasks per second alternating two patches
   per task. Every answer that is not 200 is a failure (goal: 0). Per window: requests, failures, p50/p99
   latency, server RSS, slot evictions; over the whole run, the RSS slope (goal: flat).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import asyncio
import json
import platform
import random
import re
import statistics
import time
from dataclasses import replace
from typing import Any

import httpx

from bench.common import DATA, percentile, rss_mb, sentences
from patchserve.local import free_port, patchserve_process, start_redis, wait_ready
from patchserve.patches.encoder import load_encoder
from patchserve.patches.format import Patch
from patchserve.patches.synthetic import random_patch

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per hour."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


async def probe(client: httpx.AsyncClient, every: float, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await client.get("/healthz", timeout=30)
        out.append((time.perf_counter() - t0) * 1000 if r.status_code == 200 else float("inf"))
        await asyncio.sleep(every)


async def limits_phase(client: httpx.AsyncClient, seconds: float, texts: list[str]) -> dict[str, Any]:
    """The largest allowed requests, back to back on two connections, with /healthz probed beside them."""
    most_work = {"inputs": [(" ".join(texts) * 40)[:8192] for _ in range(256)]}
    biggest_body = {"inputs": [("x " * 600_000)[: 1024 * 1024 - 64] for _ in range(8)]}  # ~8 MiB, under the limit
    stop, probes, answers = asyncio.Event(), [], []

    async def sender(body: dict[str, Any]) -> None:
        while not stop.is_set():
            r = await client.post("/tasks/big/predict", json=body, timeout=120)
            answers.append(r.status_code)

    tasks = [
        asyncio.create_task(c) for c in (sender(most_work), sender(biggest_body), probe(client, 0.05, stop, probes))
    ]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return {
        "healthz_probes": len(probes),
        "healthz_p50_ms": percentile(probes, 0.5),
        "healthz_p99_ms": percentile(probes, 0.99),
        "healthz_max_ms": max(probes),
        "big_requests": {str(s): answers.count(s) for s in sorted(set(answers))},
    }


async def soak_phase(
    client: httpx.AsyncClient, args: argparse.Namespace, patches: list[list[bytes]], texts: list[str], pid: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rng = random.Random(args.seed)
    records: list[tuple[float, int, float]] = []  # (sent at, status, ms)
    registrations: list[int] = []
    rss: list[tuple[float, float]] = []
    start = time.perf_counter()
    inflight: set[asyncio.Task[None]] = set()

    async def one(task: int, inputs: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            r = await client.post(f"/tasks/task{task}/predict", json={"inputs": inputs}, timeout=60)
            status = r.status_code
        except httpx.HTTPError:
            status = 0
        records.append((t0 - start, status, (time.perf_counter() - t0) * 1000))

    async def register(i: int) -> None:
        task = i % len(patches)
        data = patches[task][(i // len(patches)) % 2]
        r = await client.post("/tasks", files={"patch": ("p.safetensors", data)}, timeout=60)
        registrations.append(r.status_code)

    def spawn(coro: Any) -> None:
        task = asyncio.create_task(coro)
        inflight.add(task)  # a reference until it is done
        task.add_done_callback(inflight.discard)

    n = int(args.seconds * args.rate)
    for i in range(n):
        due = start + i / args.rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        k = rng.randint(1, 4)
        spawn(one(rng.randrange(args.tasks), [rng.choice(texts) for _ in range(k)]))
        if i % int(args.rate) == 0:  # once a second: a registration and an RSS sample
            second = i // int(args.rate)
            spawn(register(second))
            rss.append((time.perf_counter() - start, rss_mb(pid)))
    await asyncio.gather(*inflight)
    metrics = (await client.get("/metrics")).text
    evictions = re.search(r'patchserve_slot_events_total\{event="eviction"\} ([0-9.e+]+)', metrics)
    windows = []
    for w in range(int(args.seconds // args.window)):
        lo, hi = w * args.window, (w + 1) * args.window
        mine = [r for r in records if lo <= r[0] < hi]
        ok = [ms for _, status, ms in mine if status == 200]
        windows.append(
            {
                "t_s": hi,
                "requests": len(mine),
                "failed": len(mine) - len(ok),
                "p50_ms": round(percentile(ok, 0.5), 1),
                "p99_ms": round(percentile(ok, 0.99), 1),
                "rss_mb": round(statistics.fmean([m for t, m in rss if lo <= t < hi] or [float("nan")]), 1),
            }
        )
    ok_all = [ms for _, status, ms in records if status == 200]
    half = [p for p in rss if p[0] >= args.seconds / 2]  # after warm-up: caches and slots are full by then
    summary = {
        "requests": len(records),
        "failed": sum(1 for r in records if r[1] != 200),
        "statuses": {str(s): sum(1 for r in records if r[1] == s) for s in sorted({r[1] for r in records})},
        "p50_ms": round(percentile(ok_all, 0.5), 1),
        "p99_ms": round(percentile(ok_all, 0.99), 1),
        "registrations": len(registrations),
        "registrations_failed": sum(1 for s in registrations if s != 201),
        "slot_evictions": float(evictions.group(1)) if evictions else 0.0,
        "rss_start_mb": round(rss[0][1], 1),
        "rss_end_mb": round(rss[-1][1], 1),
        "rss_slope_mb_per_h": round(slope_per_hour(half), 1),
    }
    return windows, summary


def write_outputs(meta: dict[str, Any], limits: dict[str, Any], windows: list[dict], summary: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "soak.jsonl", "w") as f:
        f.write(json.dumps({"kind": "run", **meta}) + "\n")
        f.write(json.dumps({"kind": "limits", **limits}) + "\n")
        for w in windows:
            f.write(json.dumps({"kind": "window", **w}) + "\n")
        f.write(json.dumps({"kind": "summary", **summary}) + "\n")
    rows = "\n".join(
        f"| {w['t_s']:.0f} | {w['requests']} | {w['failed']} | {w['p50_ms']} | {w['p99_ms']} | {w['rss_mb']} |"
        for w in windows
    )
    (OUT / "soak.md").write_text(
        f"# Soak\n\n`{meta['command']}` on {meta['machine']} ({meta['date']}); server: {meta['server']}.\n\n"
        f"## Largest allowed requests beside /healthz\n\n{limits['healthz_probes']} probes while 256 x 8192-character "
        f"and 8 MiB requests were served back to back: /healthz p50 {limits['healthz_p50_ms']:.1f} ms, "
        f"**p99 {limits['healthz_p99_ms']:.1f} ms** (goal < 100), max {limits['healthz_max_ms']:.1f} ms. "
        f"Big requests answered: {limits['big_requests']}.\n\n"
        f"## Soak: {summary['requests']} requests at {meta['rate']}/s over {meta['seconds']:.0f} s, "
        f"{summary['registrations']} registrations\n\n"
        f"**{summary['failed']} failed** (goal 0), statuses {summary['statuses']}; p50 {summary['p50_ms']} ms, "
        f"p99 {summary['p99_ms']} ms; registrations failed: {summary['registrations_failed']}; slot evictions: "
        f"{summary['slot_evictions']:.0f}; server RSS {summary['rss_start_mb']} -> {summary['rss_end_mb']} MB, "
        f"slope over the second half **{summary['rss_slope_mb_per_h']} MB/h**.\n\n"
        f"| t (s) | requests | failed | p50 ms | p99 ms | RSS MB |\n| --- | --- | --- | --- | --- | --- |\n{rows}\n"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [w["t_s"] / 60 for w in windows]
    a.plot(t, [w["p50_ms"] for w in windows], label="p50")
    a.plot(t, [w["p99_ms"] for w in windows], label="p99")
    a.set_ylabel("predict latency (ms)")
    a.legend()
    b.plot(t, [w["rss_mb"] for w in windows], color="tab:red")
    b.set_ylabel("server RSS (MB)")
    b.set_xlabel("minutes")
    fig.suptitle(f"soak: {meta['rate']} req/s + 1 registration/s, {summary['failed']} failed")
    fig.tight_layout()
    fig.savefig(OUT / "soak.png", dpi=100)


async def run(
    args: argparse.Namespace, base: str, pid: int, big: bytes, patches: list[list[bytes]], texts: list[str]
) -> None:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        for data in [big, *(versions[0] for versions in patches)]:
            r = await client.post("/tasks", files={"patch": ("p.safetensors", data)}, timeout=60)
            assert r.status_code == 201, r.text
        print(f"limits phase: {args.limits_seconds:.0f} s", file=sys.stderr)
        limit_figures = await limits_phase(client, args.limits_seconds, texts)
        print(json.dumps(limit_figures), file=sys.stderr)
        # the big requests' last batches may still be on the device: one small answer means the server has drained
        await client.post("/tasks/task0/predict", json={"inputs": "drained"}, timeout=300)
        print(f"soak phase: {args.seconds:.0f} s at {args.rate}/s", file=sys.stderr)
        windows, summary = await soak_phase(client, args, patches, texts, pid)
    meta = {
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "server": f"default encoder on CPU, Redis registry, {args.tasks} tasks in {args.slots} slots",
        "rate": args.rate,
        "seconds": args.seconds,
    }
    if not args.quick:
        write_outputs(meta, limit_figures, windows, summary)
        print(f"wrote {OUT}/soak.jsonl, soak.md, soak.png", file=sys.stderr)
    for w in windows:
        print(json.dumps(w), file=sys.stderr)
    headline = {
        "requests": summary["requests"],
        "failed": summary["failed"],
        "p99_ms": summary["p99_ms"],
        "registrations": summary["registrations"],
        "rss_slope_mb_per_h": summary["rss_slope_mb_per_h"],
        "slot_evictions": summary["slot_evictions"],
        "healthz_p99_ms": round(limit_figures["healthz_p99_ms"], 1),
    }
    print(json.dumps(headline))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 s soak after a 20 s limits phase; no files written")
    ap.add_argument("--workers", type=int, help="the server's front ends (default: the server's default)")
    ap.add_argument("--seconds", type=float, help="soak length (default 1800; 60 with --quick)")
    ap.add_argument("--limits-seconds", type=float, help="limits phase length (default 120; 20 with --quick)")
    ap.add_argument("--rate", type=float, default=8.0, help="predict requests per second (default 8)")
    ap.add_argument("--tasks", type=int, default=24, help="tasks in the traffic (default 24)")
    ap.add_argument("--slots", type=int, default=16, help="the server's device slots (default 16: slots churn)")
    ap.add_argument("--window", type=float, help="seconds per reported window (default 60; 10 with --quick)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.seconds = args.seconds or (60.0 if args.quick else 1800.0)
    args.limits_seconds = args.limits_seconds or (20.0 if args.quick else 120.0)
    args.window = args.window or (10.0 if args.quick else 60.0)

    encoder = load_encoder(args.model)
    patches = [
        [random_patch(encoder, f"task{i}", seed=2 * i + v + 1, scale=0.05).data for v in range(2)]
        for i in range(args.tasks)
    ]
    one = random_patch(encoder, "big", seed=99, scale=0.05)  # a task that reads 512 tokens: the most work allowed
    big = Patch(replace(one.meta, max_seq_length=512), one.biases, one.head_weight, one.head_bias).data
    del encoder
    texts = sentences(DATA, args.seed)
    workdir = Path(__import__("tempfile").mkdtemp(prefix="soak-"))
    redis_proc, redis_url = start_redis(workdir)
    port = free_port()
    serve = ["serve", "--port", str(port), "--model", args.model, "--device", "cpu", "--slots", str(args.slots)]
    if args.workers is not None:
        serve += ["--workers", str(args.workers)]
    try:
        with patchserve_process(serve, {"PATCHSERVE_REGISTRY": redis_url}, workdir / "server.log") as proc:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            asyncio.run(run(args, base, proc.pid, big, patches, texts))
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


if __name__ == "__main__":
    main()
