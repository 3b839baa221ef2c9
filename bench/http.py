"""Throughput and latency over HTTP, as a user meets them: real `patchserve serve` processes, load from wrk, against
the engine's own rows/s on the same model and rows.

    python bench/http.py --quick                  # concurrency 64, 1 input, 1 vs 1,000 tasks; last line: JSON
    python bench/http.py --quick --model FREE     # the same with a model that costs almost nothing
    python bench/http.py                          # the grid -> docs/benchmarks/http.{jsonl,md,png}
    python bench/http.py --model FREE --out docs/benchmarks/http-free.jsonl   # its grid
    python bench/http.py --render                 # rewrite the table and plot from the JSON lines

One server per --workers value (0: one process does everything; N: an engine process and N front ends) and batch bound
(--max-batch-rows x --max-batch-tokens x --overlap-batches off/on), all started at once on a disk registry holding
--tasks' largest count of distinct tasks, with enough slots for all of them, so the figures are steady state, not slot
churn (every task is asked once before timing). wrk (bench/common.py says why wrk) keeps C connections busy, each
request POST /tasks/{task}/predict with 1 or 8 real sentences of the shared sets, the task drawn uniformly from the
first T tasks. Cells (servers x C x T x inputs) run in an order that rotates every repeat, so drift hits all alike;
figures are medians over the repeats.

--model FREE is the default encoder's real tokenizer over a random BERT of one layer, hidden 32 (built here): the
model costs almost nothing, so the cell measures the front end's ceiling. It stands in for a device that is not the
limit, so its servers get a GPU server's defaults: one front end per core (--quick) and the engine the cores the front
ends leave (but the CPU's batch row bound: on the CPU its batches cost what their rows cost, as a GPU's do not).

Per cell: requests/s and rows/s (inputs/s) over HTTP, p50/p95/p99 latency, failures (any non-200), the server's
batches (mean rows, the engine's rows/s inside the server from its /metrics), and the engine alone: this process runs
the same model on batches of each --max-batch-rows value's rows drawn the same way (same texts, same tasks), back to
back, interleaved with the cells. ``ratio`` = HTTP rows/s over the engine's rows/s alone; the server's overhead is its
inverse minus 1 (what parsing, tokenising, queueing and answering add to the forward passes).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http


import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import httpx

from bench.common import (
    DATA,
    FREE_MODEL,
    OUT,
    append_run,
    batch_rows_axis,
    fill_registry,
    latest_run,
    model_source,
    pyplot,
    run_wrk,
    sentences,
    server_figures,
    wrk_script,
)
from patchserve.local import free_port, patchserve_process, wait_ready
from patchserve.patches.encoder import Encoder, load_encoder
from patchserve.patches.format import Patch
from patchserve.patches.synthetic import random_patch
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.rows import RowBlock
from patchserve.server.engine.runner import Runner
from patchserve.server.settings import available_cpus, default_workers

SETUP = ("workers", "max_batch_rows", "max_batch_tokens", "overlap")  # what one server is started with
KEYS = (*SETUP, "concurrency", "tasks", "inputs")
OLD_SETUP = {"max_batch_rows": 32, "max_batch_tokens": 8192, "overlap": "off"}  # runs before 2026-11-28 ran only these


def setup_of(cell: dict[str, Any]) -> tuple:
    """The server a cell ran on: front ends, batch bounds, overlap."""
    return tuple(cell.get(k, OLD_SETUP.get(k)) for k in SETUP)


def setup_label(setup: tuple) -> str:
    workers, rows, tokens, overlap = setup
    procs = "one process" if workers == 0 else f"{workers} front end{'s' if workers > 1 else ''}"
    return f"{procs}, batches of {rows} rows / {tokens:,} tokens" + (", overlapped" if overlap == "on" else "")


def cell_requests(texts: list[str], tasks: int, inputs: int, rng: random.Random) -> list[tuple[str, dict]]:
    return [
        (f"/tasks/task{rng.randrange(tasks)}/predict", {"inputs": [rng.choice(texts) for _ in range(inputs)]})
        for _ in range(4000)
    ]


async def touch_all(base: str, tasks: int, text: str) -> None:
    """One request per task, so every task is resident before timing."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with sem:
                r = await client.post(f"/tasks/task{i}/predict", json={"inputs": [text]})
                r.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(tasks)))


def measure(base: str, script: Path, concurrency: int, seconds: float, threads: int = 1) -> dict[str, Any]:
    """wrk on one cell, with the server's batch totals before and after."""
    before = server_figures(httpx.get(f"{base}/metrics").text)
    load = run_wrk(base, script, concurrency, seconds, threads)
    after = server_figures(httpx.get(f"{base}/metrics").text)
    delta = {k: after[k] - before[k] for k in before}
    return {**load, **{f"server_{k}": v for k, v in delta.items()}}


class EngineAlone:
    """The engine in this process on the servers' model and tasks: rows/s on full batches, back to back."""

    def __init__(self, model: str, patches: list[Patch], texts: list[str], batch_rows: int, device: str, dtype: str):
        encoder: Encoder = load_encoder(model)
        self.tokenizer = encoder.tokenizer
        self.runner = Runner(encoder, device=device, dtype=dtype, slots=len(patches), max_rows=batch_rows)
        self.patches, self.texts, self.batch_rows = patches, texts, batch_rows
        self.last_rows = 0  # rows of the last rows_per_s run
        self.last_cpu_s = 0.0  # the CPU time this process spent in it (every thread), building its batches excluded
        for i in range(0, len(patches), 128):  # every task resident, as in the servers
            self.runner.run([Row([101, 102], [0, 0], p) for p in patches[i : i + 128]])

    def _batch(self, rows: int, tasks: int, rng: random.Random) -> RowBlock:
        texts = [rng.choice(self.texts) for _ in range(rows)]
        enc = self.tokenizer(texts, truncation=True, max_length=512)
        types = enc.get("token_type_ids") or [[0] * len(ids) for ids in enc["input_ids"]]
        tasks_of = [self.patches[rng.randrange(tasks)] for _ in texts]
        return RowBlock.from_rows([Row(ids, t, p) for ids, t, p in zip(enc["input_ids"], types, tasks_of, strict=True)])

    def run(self, block: RowBlock) -> None:
        """One batch through the runner, as the batcher runs it (arrays in, one array out)."""
        self.runner.finish(self.runner.launch(block))

    def ms_one_row(self, tasks: int, rng: random.Random, n: int = 40) -> float:
        """Median ms of a batch of one row: what a lone request costs the engine."""
        times = []
        for batch in [self._batch(1, tasks, rng) for _ in range(n)]:
            t0 = time.perf_counter()
            self.run(batch)
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    def rows_per_s(self, tasks: int, rng: random.Random, seconds: float = 2.0) -> float:
        batches = [self._batch(self.batch_rows, tasks, rng) for _ in range(64)]
        self.run(batches[0])
        rows, t0, c0 = 0, time.perf_counter(), time.process_time()
        for batch in itertools.cycle(batches):
            self.run(batch)
            rows += len(batch)
            if time.perf_counter() - t0 >= seconds:
                self.last_rows, self.last_cpu_s = rows, time.process_time() - c0
                return rows / (time.perf_counter() - t0)
        raise AssertionError("unreachable")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, {os.cpu_count()} CPU cores"
    return f"CPU, {os.cpu_count()} cores"


def summarise(
    runs: list[dict[str, Any]], alone: dict[tuple[int, int], list[float]], one_row: dict[tuple[int, int], list[float]]
) -> list[dict[str, Any]]:
    """Medians per cell over its repeats; the engine alone's by (tasks, batch rows)."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault(tuple(r[k] for k in KEYS), []).append(r)
    out = []
    for key, rs in sorted(cells.items()):
        cell = dict(zip(KEYS, key, strict=True))
        med = {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "p95_ms", "p99_ms")}
        rows_s = med["rps"] * cell["inputs"]
        engine_alone = statistics.median(alone[cell["tasks"], cell["max_batch_rows"]])
        in_server = [r["server_batch_rows"] / r["server_batch_seconds"] for r in rs if r["server_batch_seconds"] > 0]
        out.append(
            {
                **cell,
                "repeats": len(rs),
                "rps": round(med["rps"], 1),
                "rows_per_s": round(rows_s, 1),
                "engine_alone_rows_per_s": round(engine_alone, 1),
                "engine_alone_ms_1_row": round(statistics.median(one_row[cell["tasks"], cell["max_batch_rows"]]), 2),
                "ratio": round(rows_s / engine_alone, 3),
                "server_overhead": round(engine_alone / rows_s - 1, 3),
                "engine_in_server_rows_per_s": round(statistics.median(in_server), 1) if in_server else None,
                "mean_batch_rows": round(
                    sum(r["server_batch_rows"] for r in rs) / max(1, sum(r["server_batches"] for r in rs)), 1
                ),
                "p50_ms": round(med["p50_ms"], 2),
                "p95_ms": round(med["p95_ms"], 2),
                "p99_ms": round(med["p99_ms"], 2),
                "failed": sum(r["errors"] for r in rs),
                "requests": sum(r["requests"] for r in rs),
                "slot_misses": sum(r["server_slot_misses"] for r in rs),
            }
        )
    return out


def headline(cells: list[dict[str, Any]], setup: tuple, concurrency: int, inputs: int) -> dict[str, Any]:
    mine = {
        c["tasks"]: c for c in cells if (setup_of(c), c["concurrency"], c["inputs"]) == (setup, concurrency, inputs)
    }
    one, most = mine[min(mine)], mine[max(mine)]
    return {
        "rps_1_task": one["rps"],
        f"rps_{most['tasks']}_tasks": most["rps"],
        f"ratio_{most['tasks']}_vs_1": round(most["rps"] / one["rps"], 3),
        "p99_ms": most["p99_ms"],
        "server_overhead": most["server_overhead"],
        "http_vs_engine": most["ratio"],
        "failed": sum(c["failed"] for c in cells),
        **dict(zip(SETUP, setup, strict=True)),
    }


def _best_setup(cells: list[dict[str, Any]], concurrency: int, inputs: int) -> tuple:
    top = max(cells, key=lambda c: c["rows_per_s"] if (c["concurrency"], c["inputs"]) == (concurrency, inputs) else -1)
    return setup_of(top)


def _latency_lines(cells: list[dict[str, Any]], setup: tuple) -> list[str]:
    """Concurrency 1, 1 input: p50 against the engine's own time for one row."""
    lone = [c for c in cells if (setup_of(c), c["concurrency"], c["inputs"]) == (setup, 1, 1)]
    if not lone or "engine_alone_ms_1_row" not in lone[0]:
        return []
    c = max(lone, key=lambda c: c["tasks"])
    return [
        f"- Concurrency 1, 1 input, {c['tasks']:,} tasks, {setup_label(setup)}: p50 **{c['p50_ms']} ms** against the "
        f"engine's {c['engine_alone_ms_1_row']} ms for one row alone ({c['p50_ms'] - c['engine_alone_ms_1_row']:+.2f} "
        "ms: HTTP, tokenizing, IPC and answering)."
    ]


def _wrk_threads(meta: dict[str, Any]) -> str:
    """The load generator's own cores (one wrk thread each), where the run recorded them."""
    n = meta.get("wrk_threads")
    return "" if n is None else f" on {n} thread{'s' if n > 1 else ''} (cores of the same machine)"


def render(jsonl: Path) -> None:
    meta, lines = latest_run(jsonl)
    cells = [c for c in lines if c["kind"] == "cell"]
    conc, one_input = max(c["concurrency"] for c in cells), min(c["inputs"] for c in cells)
    best = _best_setup(cells, conc, one_input)
    head = headline(cells, best, conc, one_input)
    ratio_key = next(k for k in head if k.startswith("ratio_"))
    most_tasks = max(c["tasks"] for c in cells)
    most_rps = head[f"rps_{most_tasks}_tasks"]
    md = [
        "# HTTP throughput and latency over many tasks",
        "",
        f"Written by `{meta['command']}` on {meta['machine']} ({meta['device']}), {meta['date']} (torch "
        f"{meta['torch']}, commit {meta['commit']}); server: {meta['server']}. Load: wrk{_wrk_threads(meta)}, closed "
        f"loop, each connection one request at a time; {meta['seconds']:g} s per cell, medians over "
        f"{meta['repeats']} repeats (cells interleaved). workers 0 = one process does everything; N = an engine "
        "process and N front ends.",
        "",
        "rows/s = inputs/s. engine alone = the same model on batches of the server's row bound, same texts and "
        "tasks, run back to back in the benchmark's own process between cells. ratio = HTTP rows/s / engine alone; "
        "overhead = its inverse - 1. in server = the rows the server ran / the seconds its forward passes took (its "
        "/metrics).",
        "",
        "## Headline",
        "",
        f"- Best server at concurrency {conc}, {one_input} input: **{setup_label(best)}**; {most_tasks:,} tasks: "
        f"**{most_rps:,.0f} req/s**, "
        f"{head[ratio_key]:.2f}x the 1-task throughput, {head['http_vs_engine']:.0%} of the engine alone, p99 "
        f"{head['p99_ms']} ms, {head['failed']} failed in the whole run.",
        *_latency_lines(cells, best),
        "",
        "| workers | batch: rows / tokens | overlap | concurrency | tasks | inputs | req/s | rows/s | engine alone "
        "| ratio | overhead | in server | mean batch | p50 ms | p95 ms | p99 ms | engine 1 row ms | failed |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sorted(cells, key=lambda c: (c["inputs"], c["concurrency"], c["tasks"], setup_of(c))):
        w, rows, tokens, overlap = setup_of(c)
        md.append(
            f"| {w} | {rows} / {tokens:,} | {overlap} | {c['concurrency']} | {c['tasks']:,} | {c['inputs']} | "
            f"{c['rps']:,.1f} | "
            f"{c['rows_per_s']:,.1f} | {c['engine_alone_rows_per_s']:,.0f} | {c['ratio']:.2f} | "
            f"{c['server_overhead']:+.0%} | {c['engine_in_server_rows_per_s'] or 0:,.0f} | {c['mean_batch_rows']} | "
            f"{c['p50_ms']} | {c['p95_ms']} | {c['p99_ms']} | {c.get('engine_alone_ms_1_row', '')} | {c['failed']} |"
        )
    if meta.get("notes"):
        md += ["", meta["notes"]]
    jsonl.with_suffix(".md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    inputs = sorted({c["inputs"] for c in cells})
    fig, axes = plt.subplots(2, len(inputs), figsize=(5 * len(inputs), 6.5), squeeze=False)
    most = max(c["tasks"] for c in cells)
    for j, k in enumerate(inputs):
        setups = sorted({setup_of(c) for c in cells})
        for setup in setups:
            mine = sorted(
                (c for c in cells if c["inputs"] == k and c["tasks"] == most and setup_of(c) == setup),
                key=lambda c: c["concurrency"],
            )
            xs = [c["concurrency"] for c in mine]
            label = setup_label(setup) if len({s[1:] for s in setups}) > 1 else setup_label(setup).split(",")[0]
            axes[0][j].plot(xs, [c["rows_per_s"] for c in mine], marker="o", label=label)
            axes[1][j].plot(xs, [c["p99_ms"] for c in mine], marker="o", label=label)
        alone = [c["engine_alone_rows_per_s"] for c in cells if c["inputs"] == k and c["tasks"] == most]
        axes[0][j].axhline(statistics.median(alone), color="grey", linestyle="--", label="engine alone")
        for ax, label in ((axes[0][j], "rows/s over HTTP"), (axes[1][j], "p99 latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set(xlabel="concurrency (connections)", ylabel=label, title=f"{k} input(s) per request, {most:,} tasks")
            ax.legend(fontsize=8)
    fig.suptitle(f"patchserve over HTTP: {meta['server']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(jsonl.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="concurrency 64, 1 input, 1 and 1,000 tasks, 2 x 5 s")
    ap.add_argument(
        "--workers",
        default=None,
        help="front ends (comma-separated; 0 = one process). Default: 0, "
        "then 1, 2, 4, ... up to the CPU count; --quick: the server's default",
    )
    ap.add_argument("--concurrency", default="1,8,64", help="open connections (comma-separated)")
    ap.add_argument("--tasks", default="1,1000", help="tasks the traffic spreads over (comma-separated)")
    ap.add_argument("--inputs", default="1,8", help="inputs per request (comma-separated)")
    ap.add_argument("--seconds", type=float, default=10.0, help="load per cell and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="default", help="encoder: default, a folder, or FREE (see above)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--max-batch-rows",
        default=None,
        help="the servers' row bound per batch, and the engine alone's batch (comma-separated: a grid axis, one "
        "server each). Default: serve's for the device (32 on the CPU, 256 on a GPU)",
    )
    ap.add_argument(
        "--max-batch-tokens",
        default="8192",
        help="the servers' token bound per batch (comma-separated: a grid axis). Default: serve's, 8192",
    )
    ap.add_argument(
        "--overlap-batches",
        default="off",
        help="serve's --overlap-batches: off, on, or off,on (a grid axis). Default: off, serve's",
    )
    ap.add_argument(
        "--engine-threads",
        type=int,
        help="the engine process's CPU threads (default: the server's; with FREE, the cores the front ends leave, "
        "as a GPU server's engine gets)",
    )
    ap.add_argument(
        "--max-queue-rows",
        type=int,
        help="the servers' queue bound (default: the server's); raise it where concurrency x inputs exceeds it, or "
        "the excess is answered 503 by design and counts as failed",
    )
    ap.add_argument(
        "--warmup-seconds",
        type=float,
        default=1.0,
        help="load per shape on each server before timing (a GPU server's first batches capture and allocate)",
    )
    ap.add_argument(
        "--wrk-threads",
        type=int,
        default=1,
        help="wrk's threads (one core each): 1 keeps the load off a 2-core machine's server; raise it where one wrk "
        "thread cannot keep the connections busy (a GPU server with many cores)",
    )
    ap.add_argument("--data", type=Path, default=DATA, help="folder of */dev.jsonl sets (the request texts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "http.jsonl", help="JSON lines of full runs (appended)")
    ap.add_argument("--note", default="", help="a note for the table (what else ran on the machine, say)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    cpus = available_cpus()
    # FREE stands in for a device that is not the limit: its servers get a GPU server's defaults (front ends and the
    # engine's threads), whatever device runs it.
    front_end_bound = args.model == FREE_MODEL or args.device.startswith("cuda")
    if args.workers is None:
        args.workers = (
            str(default_workers(front_end_bound))
            if args.quick
            else ",".join(str(w) for w in [0, *itertools.takewhile(lambda w: w <= cpus, (2**i for i in range(8)))])
        )
    if args.quick:
        args.concurrency, args.tasks, args.inputs, args.seconds, args.repeats = "64", "1,1000", "1", 5.0, 2
    workers, concs, task_counts, inputs = (
        [int(x) for x in s.split(",")] for s in (args.workers, args.concurrency, args.tasks, args.inputs)
    )
    n_tasks = max(task_counts)
    texts = sentences(args.data, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-http-"))
    model = model_source(args.model, work)
    encoder = load_encoder(model)
    patches = [random_patch(encoder, f"task{i}", seed=i + 1, scale=0.05) for i in range(n_tasks)]
    del encoder
    registry = f"disk://{work / 'registry'}"
    print(f"registering {n_tasks} tasks: {fill_registry(registry, patches):.1f} s", file=sys.stderr)
    rng = random.Random(args.seed)
    scripts = {
        (t, k): wrk_script(work / f"t{t}-k{k}.lua", cell_requests(texts, t, k, rng))
        for t, k in itertools.product(task_counts, inputs)
    }
    batch_rows = batch_rows_axis(args.max_batch_rows, args.device)
    batch_tokens = [int(x) for x in args.max_batch_tokens.split(",")]
    overlaps = args.overlap_batches.split(",")
    if not set(overlaps) <= {"off", "on"}:
        raise SystemExit(f"--overlap-batches: off, on or off,on, not {args.overlap_batches}")
    setups = list(itertools.product(workers, batch_rows, batch_tokens, overlaps))
    alone_engines = {r: EngineAlone(model, patches, texts, r, args.device, args.dtype) for r in batch_rows}
    alone: dict[tuple[int, int], list[float]] = {(t, r): [] for t in task_counts for r in batch_rows}
    one_row: dict[tuple[int, int], list[float]] = {(t, r): [] for t in task_counts for r in batch_rows}
    cells = list(itertools.product(setups, concs, task_counts, inputs))
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bases = {}
        for setup in setups:
            w, rows, tokens, overlap = setup
            port = free_port()
            serve = ["serve", "--port", str(port), "--model", model, "--device", args.device, "--dtype", args.dtype]
            serve += ["--slots", str(n_tasks), "--registry", registry, "--workers", str(w)]
            serve += ["--max-batch-rows", str(rows), "--max-batch-tokens", str(tokens)]
            serve += ["--overlap-batches"] if overlap == "on" else []
            if args.max_queue_rows is not None:
                serve += ["--max-queue-rows", str(args.max_queue_rows)]
            if w > 0 and args.engine_threads is not None:
                serve += ["--engine-threads", str(args.engine_threads)]
            elif w > 0 and front_end_bound:
                serve += ["--engine-threads", str(max(1, cpus - w))]
            log = work / f"server-w{w}-r{rows}-t{tokens}-{overlap}.log"
            proc = stack.enter_context(patchserve_process(serve, {}, log))
            bases[setup] = f"http://127.0.0.1:{port}"
            wait_ready(bases[setup], proc=proc)
            asyncio.run(touch_all(bases[setup], n_tasks, texts[0]))
            for t, k in scripts:  # a short warm-up of each shape (and of wrk's connections)
                run_wrk(bases[setup], scripts[t, k], max(concs), args.warmup_seconds, args.wrk_threads)
        for rep in range(args.repeats):
            for t, (rows, alone_engine) in itertools.product(task_counts, alone_engines.items()):
                alone[t, rows].append(alone_engine.rows_per_s(t, rng))
                one_row[t, rows].append(alone_engine.ms_one_row(t, rng))
            shift = rep * (len(cells) // args.repeats or 1)
            for setup, c, t, k in cells[shift:] + cells[:shift]:
                r = dict(zip(SETUP, setup, strict=True)) | {"concurrency": c, "tasks": t, "inputs": k, "repeat": rep}
                r |= measure(bases[setup], scripts[t, k], c, args.seconds, args.wrk_threads)
                print(
                    json.dumps({x: round(v, 2) if isinstance(v, float) else v for x, v in r.items()}), file=sys.stderr
                )
                runs.append(r)
    summary = summarise(runs, alone, one_row)
    head = headline(summary, _best_setup(summary, max(concs), min(inputs)), max(concs), min(inputs))
    if not args.quick:
        meta = {
            "command": "python bench/http.py " + " ".join(sys.argv[1:]),
            "server": f"{args.model} encoder on {args.device} ({args.dtype}), disk registry, {n_tasks:,} tasks in "
            f"{n_tasks:,} slots, batches of up to {'/'.join(map(str, batch_rows))} rows and "
            f"{'/'.join(f'{t:,}' for t in batch_tokens)} tokens" + (", overlap " + "/".join(overlaps)),
            "device": device_name(args.device),
            "seconds": args.seconds,
            "repeats": args.repeats,
            "wrk_threads": args.wrk_threads,
            "headline": head,
            "notes": args.note,
        }
        append_run(args.out, meta, [{"kind": "cell", **c} for c in summary])
        render(args.out)
        print(f"wrote {args.out} and its .md and .png", file=sys.stderr)
    for c in summary:
        print(json.dumps(c), file=sys.stderr)
    print(json.dumps(head))


if __name__ == "__main__":
    main()
