"""Hot swap across replicas: how soon a version registered on one replica is served by another, and what a
registration every second costs the predictions around it.

    python bench/swap.py --quick      # Redis: 50 swaps, 2 x 10 s load each way; last line: JSON
    python bench/swap.py              # Redis and disk: 200 swaps, 3 x 20 s each way -> docs/benchmarks/swap.*

Per registry (a throwaway redis-server, or one disk folder): two real `patchserve serve` processes, A and B, share
it (default encoder, CPU). Each swap POSTs a new patch of task ``swap`` (new content every time, so B must fetch
and load it) to A; from the moment A answers 201, two clients ask B to predict for that task back to back until an
answer carries the new version. The swap time is that answer's arrival minus A's 201: the registry's change
notice, B's fetch and slot load, and one predict round trip on B (reported alone: B's predict p50 for a resident
task with no swap around it).

Then the cost of swapping under traffic: wrk keeps --concurrency connections predicting on B over 8 tasks, with and
without one registration per second on A (a new version of one of those 8 tasks each time), in alternating phases;
the ratio is the median p99 with registrations over the median p99 without.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime
from typing import Any

import httpx

from bench.common import (
    DATA,
    OUT,
    append_run,
    fill_registry,
    latest_run,
    percentile,
    plot_cdf,
    pyplot,
    run_wrk,
    sentences,
    wrk_script,
)
from patchserve.local import free_port, patchserve_process, start_redis, wait_ready
from patchserve.patches.encoder import load_encoder
from patchserve.patches.synthetic import random_patch

TRAFFIC_TASKS = 8


def upload(client: httpx.AsyncClient, data: bytes) -> Any:
    return client.post("/tasks", files={"patch": ("p.safetensors", data)}, timeout=60)


async def first_answer(client: httpx.AsyncClient, version: int, text: str) -> float:
    """Two clients predict for ``swap`` back to back; when the first answer carrying ``version`` arrived."""
    seen = asyncio.Event()
    arrived: list[float] = []

    async def poll() -> None:
        while not seen.is_set():
            p = await client.post("/tasks/swap/predict", json={"inputs": [text]}, timeout=60)
            now = time.perf_counter()
            if p.status_code == 200 and p.json()["version"] >= version:
                arrived.append(now)
                seen.set()

    await asyncio.wait_for(asyncio.gather(poll(), poll()), timeout=60)
    return min(arrived)


CHANGE_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO server\.catalog: registry change: swap -> v(\d+)$"
)


def notice_times(log: Path, answered: dict[int, float]) -> list[float]:
    """ms from A's 201 (wall clock) to B's log line applying that version (ms resolution; the same machine's
    clock); with several front ends in B, the last of their lines (every front end has it). Negative: B heard of
    it before A's answer reached the client."""
    applied: dict[int, float] = {}
    for line in log.read_text().splitlines():
        m = CHANGE_LINE.match(line)
        if m and int(m.group(2)) in answered:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            applied[int(m.group(2))] = max(at, applied.get(int(m.group(2)), at))
    return [(at - answered[version]) * 1000 for version, at in applied.items()]


async def swaps(a: str, b: str, patches: list[bytes], text: str) -> tuple[list[float], list[float], dict[int, float]]:
    """Swap times (ms); B's predict latency (ms) for a resident task with no swap around it (the floor); the wall
    clock time of each version's 201."""
    times: list[float] = []
    floor: list[float] = []
    answered: dict[int, float] = {}
    async with httpx.AsyncClient(base_url=a) as ca, httpx.AsyncClient(base_url=b) as cb:
        for _ in range(50):  # the floor: B's answer for a resident task, no swap around it
            s = time.perf_counter()
            (await cb.post("/tasks/task0/predict", json={"inputs": [text]}, timeout=60)).raise_for_status()
            floor.append((time.perf_counter() - s) * 1000)
        for data in patches:
            r = await upload(ca, data)
            t0 = time.perf_counter()
            assert r.status_code == 201, r.text
            answered[r.json()["version"]] = time.time()
            times.append((await first_answer(cb, r.json()["version"], text) - t0) * 1000)
            await asyncio.sleep(0.1)
    return times, floor, answered


async def registering(a: str, patches: list[bytes], stop: asyncio.Event) -> int:
    """One registration per second on A until ``stop``; returns how many were answered 201."""
    ok = 0
    async with httpx.AsyncClient(base_url=a) as ca:
        for data in patches:
            t0 = time.perf_counter()
            if (await upload(ca, data)).status_code == 201:
                ok += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, 1.0 - (time.perf_counter() - t0)))
                return ok
            except TimeoutError:
                continue
    return ok


async def load_phase(b: str, script: Path, args: argparse.Namespace, a: str | None, patches: list[bytes]) -> dict:
    stop = asyncio.Event()
    reg = asyncio.create_task(registering(a, patches, stop)) if a else None
    load = await asyncio.to_thread(run_wrk, b, script, args.concurrency, args.phase_seconds)
    stop.set()
    load["registrations"] = await reg if reg else 0
    return load


def backend_run(name: str, url: str, args: argparse.Namespace, work: Path, encoder: Any, texts: list[str]) -> dict:
    traffic = [random_patch(encoder, f"task{i}", seed=i + 1, scale=0.05) for i in range(TRAFFIC_TASKS)]
    fill_registry(url, [*traffic, random_patch(encoder, "swap", seed=10_000, scale=0.05)])
    seed = iter(range(20_000, 10**9))
    swap_patches = [random_patch(encoder, "swap", seed=next(seed), scale=0.05).data for _ in range(args.swaps)]
    n_regs = int(args.phase_seconds * args.repeats) + 2
    reg_patches = [
        random_patch(encoder, f"task{i % TRAFFIC_TASKS}", seed=next(seed), scale=0.05).data for i in range(n_regs)
    ]
    rng = random.Random(args.seed)
    script = wrk_script(
        work / f"{name}.lua",
        [(f"/tasks/task{rng.randrange(TRAFFIC_TASKS)}/predict", {"inputs": [rng.choice(texts)]}) for _ in range(2000)],
    )
    bases = []
    with ExitStack() as stack:
        for replica in ("a", "b"):
            port = free_port()
            serve = ["serve", "--port", str(port), "--device", "cpu", "--registry", url, "--model", args.model]
            if args.workers is not None:
                serve += ["--workers", str(args.workers)]
            stack.enter_context(patchserve_process(serve, {}, work / f"{name}-{replica}.log"))
            bases.append(f"http://127.0.0.1:{port}")
        for base in bases:
            wait_ready(base)
        a, b = bases
        run_wrk(b, script, args.concurrency, 2)  # warm every traffic task on B
        print(f"{name}: {args.swaps} swaps", file=sys.stderr)
        times, floor, answered = asyncio.run(swaps(a, b, swap_patches, texts[0]))
        phases: dict[str, list[dict]] = {"without": [], "with": []}
        for rep in range(args.repeats):
            for mode in ("without", "with") if rep % 2 == 0 else ("with", "without"):
                mine = reg_patches[: int(args.phase_seconds) + 1] if mode == "with" else []
                reg_patches = reg_patches[len(mine) :]
                r = asyncio.run(load_phase(b, script, args, a if mode == "with" else None, mine))
                print(f"{name} {mode} registrations: {json.dumps(r)}", file=sys.stderr)
                phases[mode].append(r)
    p99 = {m: statistics.median(r["p99_ms"] for r in rs) for m, rs in phases.items()}
    notices = notice_times(work / f"{name}-b.log", answered)
    return {
        "kind": "backend",
        "backend": name,
        "swaps": len(times),
        "swap_p50_ms": round(percentile(times, 0.5), 1),
        "swap_p95_ms": round(percentile(times, 0.95), 1),
        "swap_p99_ms": round(percentile(times, 0.99), 1),
        "swap_max_ms": round(max(times), 1),
        "notice_p50_ms": round(percentile(notices, 0.5), 1),
        "notice_p99_ms": round(percentile(notices, 0.99), 1),
        "floor_p50_ms": round(percentile(floor, 0.5), 1),
        "p99_without_ms": round(p99["without"], 1),
        "p99_with_ms": round(p99["with"], 1),
        "p99_ratio_with_swaps": round(p99["with"] / p99["without"], 3),
        "p50_without_ms": round(statistics.median(r["p50_ms"] for r in phases["without"]), 1),
        "p50_with_ms": round(statistics.median(r["p50_ms"] for r in phases["with"]), 1),
        "rps_without": round(statistics.median(r["rps"] for r in phases["without"]), 1),
        "rps_with": round(statistics.median(r["rps"] for r in phases["with"]), 1),
        "failed": sum(r["errors"] for rs in phases.values() for r in rs),
        "registrations": sum(r["registrations"] for r in phases["with"]),
        "times_ms": [round(t, 2) for t in times],
    }


def render(jsonl: Path) -> None:
    meta, rows = latest_run(jsonl)
    md = [
        "# Hot swap across replicas",
        "",
        f"Written by `{meta['command']}` on {meta['machine']}, {meta['date']} (torch {meta['torch']}, commit "
        f"{meta['commit']}). Two `patchserve serve` processes (A, B) on one registry, default encoder on the CPU; "
        f"the load generator (wrk) and both servers share the machine's cores.",
        "",
        "swap = A answers 201 to POST /tasks -> the first prediction from B that carries the new version (includes "
        "one predict round trip on B: 'B predict p50' is that alone, for a resident task with no swap around it). "
        "p99 with / without = predict p99 on B under "
        f"wrk at concurrency {meta['concurrency']} over {TRAFFIC_TASKS} tasks, with one registration per second on A "
        f"(of those tasks) or none; {meta['phase_seconds']:g} s phases, alternating, medians of {meta['repeats']}.",
        "",
        "Goals (issue 15): swap p99 < 100 ms on Redis; predict p99 with a registration every second <= 1.2x without.",
        "",
        "notice = A's 201 -> B's log line applying the new version (ms-resolution log clock; the same machine).",
        "",
        "| registry | swaps | swap p50 ms | p95 | p99 | max | notice p50 ms | notice p99 | B predict p50 ms "
        "| predict p99 without ms | with | ratio | req/s without | with | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['backend']} | {r['swaps']} | {r['swap_p50_ms']} | {r['swap_p95_ms']} | **{r['swap_p99_ms']}** | "
            f"{r['swap_max_ms']} | {r.get('notice_p50_ms', '')} | {r.get('notice_p99_ms', '')} | {r['floor_p50_ms']} | "
            f"{r['p99_without_ms']} | {r['p99_with_ms']} | "
            f"**{r['p99_ratio_with_swaps']:.2f}x** | {r['rps_without']} | {r['rps_with']} | {r['failed']} |"
        )
    md += [
        "",
        "Reading it: on Redis, B hears of a new version as soon as A does (pub/sub; a notice near 0 ms, negative when "
        "B applied it before A's 201 reached the client). The rest of a swap is B answering: the first request that "
        "carries the new version fetches and parses it (~2 ms for a MiniLM patch), folds it into a slot (~2 ms) and "
        "runs a forward; with two clients predicting back to back, that answer lands 1 to 1.5 round trips (B predict "
        "p50) after the notice. The disk registry's watchers poll a generation file every 0.2 s, so its notice is up "
        "to 200 ms: it is the one-machine backend; replicas share Redis. Both servers and the load generator share "
        "this machine's cores, so A's work on each registration is also taken from B.",
    ]
    (jsonl.parent / "swap.md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        plot_cdf(left, r["times_ms"], r["backend"])
    left.axvline(100, color="grey", ls="--", lw=1)
    left.set(xlabel="swap time (ms)", ylabel="fraction of swaps", title="A's 201 -> B serves the new version")
    left.legend()
    xs = range(len(rows))
    right.bar([x - 0.2 for x in xs], [r["p99_without_ms"] for r in rows], width=0.4, label="no registrations")
    right.bar([x + 0.2 for x in xs], [r["p99_with_ms"] for r in rows], width=0.4, label="1 registration/s")
    right.set_xticks(list(xs), [r["backend"] for r in rows])
    right.set(ylabel="predict p99 on B (ms)", title="predictions around registrations")
    right.legend()
    fig.tight_layout()
    fig.savefig(jsonl.parent / "swap.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Redis only, 50 swaps, 2 x 10 s phases; prints JSON")
    ap.add_argument("--workers", type=int, help="each server's front ends (default: the server's default)")
    ap.add_argument("--backends", default="redis,disk", help="registries to run (redis, disk)")
    ap.add_argument("--swaps", type=int, default=200)
    ap.add_argument("--phase-seconds", type=float, default=20.0, help="length of each load phase")
    ap.add_argument("--repeats", type=int, default=3, help="load phases each way")
    ap.add_argument("--concurrency", type=int, default=8, help="wrk connections predicting on B")
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "swap.jsonl", help="JSON lines of full runs (appended)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    if args.quick:
        args.backends, args.swaps, args.phase_seconds, args.repeats = "redis", 50, 10.0, 2
    texts = sentences(args.data, args.seed)
    encoder = load_encoder(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    results = []
    for name in args.backends.split(","):
        if name == "redis":
            proc, url = start_redis(work)
            try:
                results.append(backend_run(name, url, args, work, encoder, texts))
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        else:
            results.append(backend_run(name, f"disk://{work / 'registry'}", args, work, encoder, texts))
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "times_ms"}), file=sys.stderr)
    if not args.quick:
        meta = {
            "command": "python bench/swap.py " + " ".join(sys.argv[1:]),
            "concurrency": args.concurrency,
            "phase_seconds": args.phase_seconds,
            "repeats": args.repeats,
        }
        append_run(args.out, meta, results)
        render(args.out)
        print(f"wrote {args.out}, swap.md, swap.png", file=sys.stderr)
    first = results[0]
    print(json.dumps({k: first[k] for k in ("swap_p50_ms", "swap_p99_ms", "p99_ratio_with_swaps", "failed")}))


if __name__ == "__main__":
    main()
