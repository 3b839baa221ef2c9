"""A Redis failover under load: what predictions, registrations and acknowledged writes go through.

    python bench/failover.py --quick     # 3 failovers at each --redis-min-replicas 0 and 1; last line: JSON
    python bench/failover.py             # 20 each -> docs/benchmarks/failover.{jsonl,md,png}
    python bench/failover.py --render    # rewrite the table and plot from the JSON lines

For each --redis-min-replicas setting, a fresh deployment: a Redis primary, two replicas and three Sentinels
(patchserve.local.SentinelRedis: real redis-server processes on free ports), and a `patchserve serve` on its
redis+sentinel:// URL with that setting (the model that costs almost nothing, so the 2 cores go to Redis and the
load). Meanwhile:

- predictions: 4 clients ask the server back to back for a resident task (failed = any answer but 200);
- registrations over HTTP, one a second (201, or 503 while writes wait for a primary);
- a writer registering straight into the registry with the same setting, as fast as it can from 0.5 s before each
  kill until it gets through to the new primary, 10 a second otherwise: the acknowledged writes whose loss we count
  (a registration a second seldom falls in the instant before a kill).

Then, N times: let it run 3 s, kill -9 whichever node is primary, wait until the Sentinels promote a replica
(Sentinel's down-after-milliseconds is 1 s here), bring the killed node back as a replica, and wait until every
Sentinel sees both replicas in sync again (a Sentinel learns of a returning replica within 10 s; one that has not
does not repoint it in the next failover). Reported per
failover: Sentinel's own failover time (the kill -> the Sentinels name another primary) and the write gap (the
longest pause between acknowledged writes, from the last one before the kill to the next kill). At the end every
acknowledged version (HTTP 201 or the writer's) is looked up: lost = not there with the patch it was acknowledged
for.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import itertools
import json
import math
import statistics
import tempfile
import threading
import time
from typing import Any

import httpx

from bench.common import FREE_MODEL, OUT, append_run, model_source, pyplot

EVENTS = {False: "kill -9", True: "switchover"}  # how the primary goes: killed, or SENTINEL FAILOVER
SETTLE_S = 3.0
BURST_S = 0.5  # the writer runs flat out from this long before each kill to this long after it gets through
PACED_S = 0.1  # and writes every 0.1 s otherwise (flat out all the time, the registry grows by GBs and every
# restarted node's full resync takes longer than the failover itself)


def _patches(model: str, task: str, n: int) -> list[bytes]:
    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.synthetic import random_patch

    encoder = load_encoder(model)
    return [random_patch(encoder, task, seed=s).data for s in range(1, n + 1)]


def _syncs(port: int) -> tuple[int, int]:
    """(full, partial) resyncs the node on ``port`` has served as a primary since it started."""
    import redis

    client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    try:
        stats = client.info("stats")
    except redis.RedisError:
        return (0, 0)
    finally:
        client.close()
    return int(stats.get("sync_full", 0)), int(stats.get("sync_partial_ok", 0))


def run_setting(
    min_replicas: int, failovers: int, work: Path, model: str, switchover: bool = False
) -> tuple[list[dict], dict[str, Any]]:
    from patchserve.local import SentinelRedis, served
    from patchserve.patches.errors import RegistryUnavailableError
    from patchserve.patches.format import Patch
    from patchserve.patches.store import open_registry

    folder = work / f"min{min_replicas}"
    folder.mkdir()
    deployment = SentinelRedis(folder, replicas=2)
    direct_patches = [Patch.from_bytes(d) for d in _patches(model, "direct", 97)]
    http_patches = _patches(model, "http", 31)
    stop = threading.Event()
    burst = threading.Event()  # set from just before a kill until writes go through again: the writer at full speed
    predicts: list[tuple[float, int]] = []
    http_writes: list[tuple[float, int, dict[str, Any]]] = []
    direct_ok: list[tuple[float, int, str]] = []  # (when it was acknowledged, version, patch id)
    # writes refused because, after their WAIT, another node acted as primary (DurableWrites' PrimaryCheck)
    second_primary_refusals: list[float] = []
    try:
        env = {"PATCHSERVE_REGISTRY": deployment.url, "PATCHSERVE_REDIS_MIN_REPLICAS": str(min_replicas)}
        args = ["--model", model, "--device", "cpu", "--slots", "16"]
        with served(folder, env, *args) as base:
            r = httpx.post(f"{base}/tasks", files={"patch": ("p", _patches(model, "load", 1)[0])}, timeout=30)
            assert r.status_code == 201, r.text
            writer = open_registry(deployment.url, min_replicas=min_replicas)

            def predict_loop() -> None:
                with httpx.Client(base_url=base, timeout=30) as client:
                    while not stop.is_set():
                        try:
                            status = client.post("/tasks/load/predict", json={"inputs": ["a fine film"]}).status_code
                        except httpx.HTTPError:
                            status = 0
                        predicts.append((time.monotonic(), status))

            def http_register_loop() -> None:
                i = 0
                with httpx.Client(base_url=base, timeout=30) as client:
                    while not stop.wait(1.0):
                        data = http_patches[i % len(http_patches)]
                        try:
                            r = client.post("/tasks", files={"patch": ("p.safetensors", data)})
                            http_writes.append((time.monotonic(), r.status_code, r.json()))
                        except (httpx.HTTPError, ValueError):
                            http_writes.append((time.monotonic(), 0, {}))
                        i += 1

            def direct_loop() -> None:
                i = 0
                while not stop.is_set():
                    try:
                        info = writer.put(direct_patches[i % len(direct_patches)])
                        direct_ok.append((time.monotonic(), info.version, info.patch_id))
                        if not burst.is_set():  # paced between kills, so the registry stays small
                            stop.wait(PACED_S)
                    except RegistryUnavailableError as exc:
                        if "failover is under way" in str(exc):
                            second_primary_refusals.append(time.monotonic())
                        time.sleep(0.02)
                    i += 1

            threads = [threading.Thread(target=predict_loop) for _ in range(4)]
            threads += [threading.Thread(target=http_register_loop), threading.Thread(target=direct_loop)]
            for t in threads:
                t.start()
            events: list[dict[str, Any]] = []
            try:
                for n in range(failovers):
                    deadline = time.monotonic() + 90
                    while not deployment.healthy(2) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    time.sleep(SETTLE_S - BURST_S)
                    burst.set()
                    time.sleep(BURST_S)
                    promotions_before = deployment.promotions()
                    t_kill = time.monotonic()
                    old = deployment.switchover() if switchover else deployment.kill_primary()
                    new = deployment.wait_for_failover(old, timeout=60)
                    failover_s = time.monotonic() - t_kill
                    syncs_before = _syncs(new)
                    while not stop.is_set() and not (direct_ok and direct_ok[-1][0] > t_kill + failover_s):
                        time.sleep(0.05)  # until the writer gets through to the new primary
                    time.sleep(BURST_S)
                    burst.clear()
                    # the killed node comes back once the Sentinels have repointed the surviving replica (as an
                    # operator brings a node back, not in the middle of the failover it caused)
                    deadline = time.monotonic() + 90
                    while not deployment.healthy(1) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    syncs_after = _syncs(new)
                    resync = (
                        "full"
                        if syncs_after[0] > syncs_before[0]
                        else "partial"
                        if syncs_after[1] > syncs_before[1]
                        else "none seen"
                    )
                    if not switchover:  # (after a switchover the old primary rejoins by itself, as a replica)
                        deployment.restart_as_replica(old)
                    t_back = time.monotonic()
                    # the next kill only once every Sentinel knows both replicas again (patchserve.local's
                    # SentinelRedis.healthy says why: up to 10 s after a node comes back)
                    while not deployment.healthy(2) and time.monotonic() < t_back + 90:
                        time.sleep(0.1)
                    healthy_s = time.monotonic() - t_back
                    promotions = deployment.promotions() - promotions_before
                    events.append(
                        {
                            "n": n,
                            "t_kill": t_kill,
                            "failover_s": round(failover_s, 2),
                            "healthy_s": round(healthy_s, 1),
                            "resync": resync,
                            "promotions": promotions,
                        }
                    )
                    print(
                        f"min-replicas {min_replicas}: failover {n + 1}/{failovers} in {failover_s:.1f} s",
                        file=sys.stderr,
                    )
                time.sleep(SETTLE_S)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=60)
            stored_direct = {v.version: v.patch_id for v in writer.versions("direct")}
            stored_http = {v.version: v.patch_id for v in writer.versions("http")}
            writer.close()
    finally:
        deployment.stop()
    acked_times = sorted(t for t, _, _ in direct_ok)
    lost_times = sorted(t for t, v, p in direct_ok if stored_direct.get(v) != p)
    near: list[list[float]] = [[] for _ in events]
    for lost_at in lost_times:  # each lost write to the kill nearest it in time
        if events:
            j = min(range(len(events)), key=lambda i: abs(lost_at - events[i]["t_kill"]))
            near[j].append(lost_at - events[j]["t_kill"])
    lines = []
    for j, e in enumerate(events):
        # the longest pause between two acknowledged writes from the last one before the kill to the first one
        # after the next kill (writes in flight at the kill can still be acknowledged a few ms after it)
        end = events[j + 1]["t_kill"] if j + 1 < len(events) else math.inf
        before = [t for t in acked_times if t <= e["t_kill"]]
        window = before[-1:] + [t for t in acked_times if e["t_kill"] < t < end]
        gap = max((b - a for a, b in itertools.pairwise(window)), default=float("nan"))
        http_503 = sum(1 for t, s, _ in http_writes if s == 503 and e["t_kill"] <= t <= e["t_kill"] + gap + 2)
        second_primary = sum(1 for t in second_primary_refusals if e["t_kill"] <= t < end)
        lines.append(
            {
                "kind": "failover",
                "event": EVENTS[switchover],
                "min_replicas": min_replicas,
                "n": e["n"],
                "failover_s": e["failover_s"],
                "healthy_again_s": e["healthy_s"],
                "survivor_resync": e["resync"],
                # replicas promoted after this kill: 1, or 2 when a Sentinel then failed over the new primary too
                "promotions": e["promotions"],
                "second_primary_refusals": second_primary,
                "write_gap_s": round(gap, 2),
                "gap_over_failover_s": round(gap - e["failover_s"], 2),
                "http_503": http_503,
                # acknowledged writes lost nearest this kill, and when the first and last of them were acknowledged,
                # from the kill (negative: before it; a write just before a kill vs one after the failover)
                "lost": len(near[j]),
                "lost_acked_s": [round(near[j][0], 3), round(near[j][-1], 3)] if near[j] else [],
            }
        )
    lost_direct = len(lost_times)
    acked_http = [(b["version"], b["patch_id"]) for _, s, b in http_writes if s == 201]
    lost_http = sum(1 for v, p in acked_http if stored_http.get(v) != p)
    gaps = [x["write_gap_s"] for x in lines]
    summary = {
        "kind": "setting",
        "event": EVENTS[switchover],
        "min_replicas": min_replicas,
        "failovers": len(lines),
        "predicts": len(predicts),
        "failed_predicts": sum(1 for _, s in predicts if s != 200),
        "http_registrations": len(http_writes),
        "http_201": len(acked_http),
        "http_503": sum(1 for _, s, _ in http_writes if s == 503),
        "http_other": sum(1 for _, s, _ in http_writes if s not in (201, 503)),
        "acked_writes": len(direct_ok) + len(acked_http),
        "lost_acked_writes": lost_direct + lost_http,
        "failover_s_p50": statistics.median(x["failover_s"] for x in lines),
        "write_gap_s_p50": statistics.median(gaps),
        "write_gap_s_max": max(gaps),
        "gap_over_failover_s_max": max(x["gap_over_failover_s"] for x in lines),
        # the surviving replica's resync with the new primary: partial (PSYNC) or full (a new copy of the data set)
        "survivor_full_resyncs": sum(1 for x in lines if x["survivor_resync"] == "full"),
        # failovers after which the Sentinels promoted a second replica (the new primary wrongly seen as down)
        "double_failovers": sum(1 for x in lines if x["promotions"] > 1),
        "second_primary_refusals": len(second_primary_refusals),
    }
    return lines, summary


def _gaps_where(setting: dict[str, Any], lines: list[dict[str, Any]], keep: Any) -> str:
    """How many of the setting's failovers ``keep(line)`` holds for, and their write gaps."""
    gaps = [
        x["write_gap_s"]
        for x in lines
        if x["kind"] == "failover" and x["min_replicas"] == setting["min_replicas"] and keep(x)
    ]
    return f"{len(gaps)}" + (f" ({', '.join(f'{g:.1f}' for g in gaps)} s)" if gaps else "")


def _resyncs(setting: dict[str, Any], lines: list[dict[str, Any]]) -> str:
    if "survivor_full_resyncs" not in setting:
        return "-"
    return _gaps_where(setting, lines, lambda x: x["survivor_resync"] == "full")


def _doubles(setting: dict[str, Any], lines: list[dict[str, Any]]) -> str:
    if "double_failovers" not in setting:
        return "-"
    return f"{_gaps_where(setting, lines, lambda x: x['promotions'] > 1)}; {setting['second_primary_refusals']}"


def _losses(lines: list[dict[str, Any]]) -> str:
    """Where the lost writes were, per failover: how many, and when they were acknowledged relative to the kill."""
    lossy = [x for x in lines if x["kind"] == "failover" and x.get("lost")]
    if not lossy:
        return ""
    items = [
        f"{x['event']}, --redis-min-replicas {x['min_replicas']}, failover {x['n'] + 1}: {x['lost']} lost, "
        f"acknowledged {x['lost_acked_s'][0]:+.3f} to {x['lost_acked_s'][1]:+.3f} s from the failover's start"
        for x in lossy
    ]
    return "\nLost acknowledged writes, by the kill nearest them:\n\n" + "\n".join(f"- {i}" for i in items) + "\n"


def _latest_runs(jsonl: Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The newest run of each event (kill -9, switchover): its meta line and its other lines."""
    lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    newest: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for meta in (x for x in lines if x["kind"] == "meta"):  # in order: a later run of an event replaces an earlier
        run = [x for x in lines if x.get("run") == meta["run"] and x["kind"] != "meta"]
        for x in run:
            x.setdefault("event", EVENTS[False])  # runs written before switchovers were measured
        if run:
            newest[run[0]["event"]] = (meta, run)
    return [newest[e] for e in EVENTS.values() if e in newest]


def render(jsonl: Path) -> None:
    runs = _latest_runs(jsonl)
    written = "; ".join(
        f"`{meta['command']}` on {meta['machine']}, {meta['date']} (commit {meta['commit']})" for meta, _ in runs
    )
    rows = "\n".join(
        f"| {s['event']} | {s['min_replicas']} | {s['failovers']} | {s['failover_s_p50']:.1f} | "
        f"{s['write_gap_s_p50']:.1f} | {s['write_gap_s_max']:.1f} | {s['gap_over_failover_s_max']:.1f} | "
        f"**{s['failed_predicts']}** of {s['predicts']:,} | {s['http_201']} / {s['http_503']} / {s['http_other']} | "
        f"**{s['lost_acked_writes']}** of {s['acked_writes']:,} | {_resyncs(s, lines)} | {_doubles(s, lines)} |"
        for _, lines in runs
        for s in lines
        if s["kind"] == "setting"
    )
    (OUT / "failover.md").write_text(
        "# Redis failover under load\n\n"
        f"Written by {written}. "
        "Per setting: a primary, two replicas and three Sentinels (down-after-milliseconds 1,000) as local "
        "processes, a `patchserve serve` on the redis+sentinel:// URL, 4 clients predicting back to back, one "
        "registration a second over HTTP and a writer registering straight into the registry (flat out from 0.5 s "
        "before each failover until it gets through to the new primary, 10 a second otherwise). Each failover, "
        "after 3 s of load: **kill -9** the primary, wait for the Sentinels to promote a replica and bring the killed "
        "node back as a replica; or a **switchover** (`SENTINEL FAILOVER`, as before maintenance: a replica is "
        "promoted while the primary lives on, and the Sentinels then make the old primary a replica). Then wait "
        "until every Sentinel sees both replicas in sync (the next failover meets a healthy deployment).\n\n"
        "failover = the kill (or the switchover's start) -> the Sentinels name another primary. write gap = the "
        "longest pause between acknowledged writes, from the last one before the failover to the next failover. "
        "lost = acknowledged (201, or the writer's put returned) but not in the registry afterwards with that "
        "patch.\n\n"
        "Goals (issue 27): 0 failed predictions; writes unavailable for <= the failover time + 2 s; with "
        "--redis-min-replicas 1, 0 acknowledged writes lost over at least 20 failovers.\n\n"
        "| primary | min replicas | failovers | failover s (p50) | write gap s (p50) | max | gap - failover s (max) "
        "| failed predicts | HTTP 201 / 503 / other | lost acknowledged writes | survivor's resync: full (their "
        "write gaps) | double failovers (their write gaps); writes refused for a second primary |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|\n" + rows + "\n\n"
        "A failover's surviving replica resyncs with the new primary: partially (PSYNC: it continues from its "
        "offset) or, where it cannot, fully (the new primary sends a new copy of the data set). With "
        "--redis-min-replicas 1, writes wait for that replica to be attached to the new primary again.\n\n"
        "Two primaries at once: in a switchover, the old primary takes writes until the Sentinels demote it, with "
        "the other replica still attached until they repoint it; after a kill -9, in a double failover (a "
        "Sentinel sees the primary it has just promoted as down -- no answer to its ping within "
        "down-after-milliseconds on these 2 busy cores, while the other Sentinels' answers about the killed node, "
        "under 5 s old, still count towards its quorum -- and promotes the other replica). Writes made on the old "
        "side then pass WAIT 1 and are dropped when it is demoted: acknowledged writes were lost that way before "
        "patchserve checked, after each write's WAIT, that the Sentinels still name its node primary and that no "
        "replica they list acts as one (DurableWrites). Such writes are now refused (503, may be lost): the last "
        "column counts them.\n" + "".join(_losses(lines) for _, lines in runs)
    )
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for _, lines in runs:
        for s in (x for x in lines if x["kind"] == "setting"):
            gaps = [
                x["write_gap_s"] for x in lines if x["kind"] == "failover" and x["min_replicas"] == s["min_replicas"]
            ]
            label = f"{s['event']}, --redis-min-replicas {s['min_replicas']}"
            ax.plot(range(1, len(gaps) + 1), gaps, marker="o", markersize=3, label=label)
    failover = [x["failover_s"] for _, lines in runs for x in lines if x["kind"] == "failover"]
    ax.axhline(statistics.median(failover), color="grey", linestyle="--", label="Sentinel failover (median)")
    ax.set_xlabel("failover")
    ax.set_ylabel("write gap (s)")
    ax.set_title("writes unavailable around each failover of the primary")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "failover.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 failovers per setting; no files written")
    ap.add_argument("--failovers", type=int, help="failovers per setting (default 20; 3 with --quick)")
    ap.add_argument("--min-replicas", default="0,1", help="--redis-min-replicas settings to run (comma-separated)")
    ap.add_argument("--model", default=FREE_MODEL, help="the server's encoder (default FREE: costs almost nothing)")
    ap.add_argument("--out", type=Path, default=OUT / "failover.jsonl", help="JSON lines of full runs (appended)")
    ap.add_argument(
        "--switchover",
        action="store_true",
        help="planned failovers (SENTINEL FAILOVER while the primary lives on) instead of kill -9 of the primary",
    )
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    failovers = args.failovers or (3 if args.quick else 20)
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_source(args.model, work)
        for m in (int(x) for x in args.min_replicas.split(",")):
            events, summary = run_setting(m, failovers, work, model, args.switchover)
            lines += [*events, summary]
            print(json.dumps(summary), file=sys.stderr)
    if not args.quick:
        append_run(args.out, {"command": "python bench/failover.py " + " ".join(sys.argv[1:])}, lines)
        render(args.out)
        print(f"wrote {args.out}, failover.md, failover.png", file=sys.stderr)
    settings = {x["min_replicas"]: x for x in lines if x["kind"] == "setting"}
    headline: dict[str, Any] = {
        "failovers": sum(s["failovers"] for s in settings.values()),
        "failed_predicts": sum(s["failed_predicts"] for s in settings.values()),
        "failover_s_p50": statistics.median(x["failover_s"] for x in lines if x["kind"] == "failover"),
        "write_gap_s_max": max(s["write_gap_s_max"] for s in settings.values()),
        "gap_over_failover_s_max": max(s["gap_over_failover_s_max"] for s in settings.values()),
    }
    for m, s in settings.items():
        headline[f"lost_acked_min{m}"] = s["lost_acked_writes"]
        headline[f"acked_min{m}"] = s["acked_writes"]
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
