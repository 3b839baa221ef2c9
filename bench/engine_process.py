"""The engine process's own ceiling: what it serves over ZeroMQ with no front end in the way, against the engine
alone on the same model and rows.

    python bench/engine_process.py --quick                 # free model, CPU, 8 and 1 rows a request; last line: JSON
    python bench/engine_process.py                         # the grid -> docs/benchmarks/engine_process.{jsonl,md,png}
    python bench/engine_process.py --model default --device cuda --dtype float16     # on a GPU

Why: on an H100 (docs/benchmarks/http-gpu.md) the HTTP rows/s at 8 inputs a request did not grow with the front
ends and fell with concurrency: the engine process, not the front ends, was the limit. This isolates it. The
benchmark starts the real engine process (``patchserve.server.supervisor.EngineProcess``, as ``patchserve serve
--workers N`` does) and one ZeroMQ DEALER here sends it pre-tokenised requests of K rows (``--rows``) of random
tasks, keeping ``--outstanding`` rows in flight, closed loop: for every answer, one ``Requests`` message with as many
new requests as it answered (a front end sends the requests made in one turn of its event loop as one message), or
messages of at most ``--per-message`` requests (1: as many front ends with one request each would send them). Per
cell: rows/s through the engine process, and the engine alone -- the same runner in this process on batches of
--max-batch-rows rows of the same texts and tasks, back to back -- with their ratio (1.0: the process adds nothing to
its forward passes).

--model FREE (the default) is a random BERT of one layer, hidden 32, under the default encoder's tokenizer: on two
CPU cores its forward of 32 rows takes about what the default encoder's takes on an H100 in float16 (~1.1 ms), so
the ratio shows what the engine process's own Python costs a GPU server. Cells interleave; medians over --repeats.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
import zmq

from bench.common import (
    DATA,
    FREE_MODEL,
    OUT,
    append_run,
    batch_rows_axis,
    latest_run,
    model_source,
    pyplot,
    sentences,
)
from bench.http import EngineAlone, device_name
from patchserve.patches.encoder import load_encoder
from patchserve.patches.format import Patch
from patchserve.patches.synthetic import random_patch
from patchserve.server.engine.protocol import Answers, Hello, Requests, Results, Row, encode, from_engine
from patchserve.server.engine.remote import MAX_MESSAGE_ROWS
from patchserve.server.engine.rows import pack_requests
from patchserve.server.settings import ServerSettings
from patchserve.server.supervisor import EngineProcess


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pool:
    """Many pre-tokenised rows of random tasks as arrays, from which ``Requests`` messages are cut as a front end
    sends them: every request it had pending, K rows each, in one message."""

    def __init__(self, token_rows: list[list[int]], patch_ids: list[str], rows: int, rng: random.Random) -> None:
        picked = [rng.choice(token_rows) for _ in range(rows)]
        self.lengths = np.fromiter(map(len, picked), dtype="<i4", count=rows)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self.tokens = np.fromiter(itertools.chain.from_iterable(picked), dtype="<i4", count=int(self.starts[-1]))
        self.row_keys = np.asarray([rng.randrange(len(patch_ids)) for _ in range(rows)], dtype="<i4")
        self.keys = patch_ids
        self.rng = rng

    def message(self, first_id: int, requests: int, k: int) -> bytes:
        n = requests * k
        at = self.rng.randrange(len(self.lengths) - n)
        a, b = int(self.starts[at]), int(self.starts[at + n])
        used, row_keys = np.unique(self.row_keys[at : at + n], return_inverse=True)  # only the keys it names
        return encode(
            Requests(
                id=first_id,
                counts=np.full(requests, k, dtype="<i4").tobytes(),
                lengths=self.lengths[at : at + n].tobytes(),
                tokens=self.tokens[a:b].tobytes(),
                types=np.zeros(b - a, dtype="<i4").tobytes(),
                keys=[self.keys[i] for i in used],
                row_keys=row_keys.astype("<i4").tobytes(),
                embed=np.zeros(n, dtype=np.uint8).tobytes(),
            )
        )


class Client:
    """One DEALER on the engine process, closed loop: ``outstanding`` rows in flight, and for every answer one
    message with as many new requests as it answered (what a front end does: the requests its clients send again
    in one turn of its event loop go out together)."""

    def __init__(self, address: str, pool: Pool) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.connect(address)
        self.sock.send(encode(Hello()))
        from_engine.decode(self.sock.recv())
        self.pool = pool
        self.next_id = 0
        self.last_rows = 0
        self.sizes: dict[int, int] = {}  # message id -> its requests not answered yet

    def _send(self, requests: int, k: int) -> None:
        self.sock.send(self.pool.message(self.next_id, requests, k))
        self.sizes[self.next_id] = requests
        self.next_id += requests

    def _answered(self) -> int:
        """Requests answered by the next message (``Results``, or several in ``Answers``), which must be results (a
        failure or ``Missing`` would make the figures meaningless)."""
        answer = from_engine.decode(self.sock.recv())
        done = 0
        for results in answer.items if isinstance(answer, Answers) else [answer]:
            if not isinstance(results, Results) or results.refused:
                raise RuntimeError(f"the engine answered {type(results).__name__}: {getattr(results, 'message', '')}")
            self.sizes[results.id] -= results.count
            if not self.sizes[results.id]:
                del self.sizes[results.id]
            done += results.count
        return done

    def ask(self, payload: bytes) -> None:
        self.sock.send(payload)
        from_engine.decode(self.sock.recv())

    def _send_all(self, requests: int, k: int, per_message: int) -> None:
        for start in range(0, requests, per_message):
            self._send(min(per_message, requests - start), k)

    def rows_per_s(self, k: int, outstanding: int, seconds: float, per_message: int = 0) -> float:
        """Rows/s with ``outstanding`` rows in flight in requests of ``k`` rows, sent in messages of at most
        ``per_message`` requests (0: as many as were answered, up to a front end's MAX_MESSAGE_ROWS)."""
        per_message = min(per_message or MAX_MESSAGE_ROWS, max(1, MAX_MESSAGE_ROWS // k))
        self._send_all(max(1, outstanding // k), k, per_message)
        done = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            answered = self._answered()
            done += answered
            self._send_all(answered, k, per_message)
        elapsed, timed = time.perf_counter() - t0, done
        while self.sizes:  # drain, so the next cell starts on an empty queue
            done += self._answered()
        self.last_rows = done * k  # every row answered in the cell, the drain's included
        return timed * k / elapsed

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _bound(cell: dict[str, Any]) -> str:
    """A cell's batch bound; runs before 2026-11-28 recorded it in their meta line only."""
    return f"{cell['max_batch_rows']} / {cell['max_batch_tokens']:,}" if "max_batch_rows" in cell else "-"


def _per_message(cell: dict[str, Any]) -> str:
    """A cell's requests a message; runs before 2026-12-05 always sent every answered request in one message."""
    return str(cell.get("requests_per_message") or "all")


def render(jsonl: Path) -> None:
    meta, cells = latest_run(jsonl)
    md = [
        "# The engine process's ceiling",
        "",
        f"Written by `{meta['command']}` on {meta['machine']} ({meta['device']}), {meta['date']} (torch "
        f"{meta['torch']}, commit {meta['commit']}); {meta['engine']}. One DEALER sends pre-tokenised requests of K "
        "rows, closed loop with the given rows in flight, the requests answered going out again in messages of at "
        "most the given requests (all: one message, as one busy front end sends them); "
        f"{meta['seconds']:g} s per cell, medians over "
        f"{meta['repeats']} repeats (cells interleaved). engine alone = the same runner in the benchmark's process on "
        "full batches, back to back. ratio = engine process / engine alone. CPU: the CPU time (every thread) a row "
        "costs the engine process, and the benchmark's process running the engine alone; CPU ratio = alone / process "
        "(what a shared machine's noise moves least).",
        "",
        "| batch: rows / tokens | rows a request | rows in flight | requests a message | engine process rows/s "
        "| engine alone rows/s | ratio | CPU µs a row: process / alone | CPU ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        cpu = "| |"
        if "cpu_us_per_row" in c:  # older runs did not record CPU time
            cpu = f"| {c['cpu_us_per_row']:.0f} / {c['engine_alone_cpu_us_per_row']:.0f} | {c['cpu_ratio']:.2f} |"
        md.append(
            f"| {_bound(c)} | {c['rows']} | {c['outstanding']} | {_per_message(c)} | {c['rows_per_s']:,.0f} | "
            f"{c['engine_alone_rows_per_s']:,.0f} | "
            f"{c['ratio']:.2f} {cpu}"
        )
    if meta.get("notes"):
        md += ["", meta["notes"]]
    jsonl.with_suffix(".md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    several = len({_bound(c) for c in cells}) > 1
    messages = len({_per_message(c) for c in cells}) > 1
    for k, bound, m in sorted({(c["rows"], _bound(c), _per_message(c)) for c in cells}):
        mine = sorted(
            (c for c in cells if (c["rows"], _bound(c), _per_message(c)) == (k, bound, m)),
            key=lambda c: c["outstanding"],
        )
        label = f"{k} row{'s' if k != 1 else ''} a request" + (f", batches {bound}" if several else "")
        label += f", {m} request{'s' if m != '1' else ''} a message" if messages else ""
        ax.plot([c["outstanding"] for c in mine], [c["ratio"] for c in mine], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="rows in flight", ylabel="engine process / engine alone", ylim=(0, 1.05))
    ax.set_title(meta["engine"], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(jsonl.with_suffix(".png"), dpi=100)


Bound = tuple[int, int]  # an engine's batch bound: (max rows, max tokens)
Cell = tuple[Bound, int, int, int]  # (bound, rows a request, rows in flight, requests a message; 0: all answered)


def start_engine(args: argparse.Namespace, model: str, address: Path, bound: Bound, queue: int) -> EngineProcess:
    settings = ServerSettings(
        model=model,
        device=args.device,
        dtype=args.dtype,
        slots=max(args.tasks, 1),
        max_batch_rows=bound[0],
        max_batch_tokens=bound[1],
        max_queue_rows=queue,
        workers=1,
        **({} if args.engine_threads is None else {"engine_threads": args.engine_threads}),
    )
    engine = EngineProcess(settings, f"ipc://{address}")
    engine.start()
    engine.wait_ready()
    return engine


def summarise(
    cell: Cell, runs: list[float], cpu: list[float], alone: list[float], alone_cpu: list[float]
) -> dict[str, Any]:
    """One cell's medians over its repeats, against the engine alone on batches of the cell's row bound."""
    (max_rows, max_tokens), k, n, m = cell
    engine_alone, alone_us, rows_per_s = statistics.median(alone), statistics.median(alone_cpu), statistics.median(runs)
    return {
        "max_batch_rows": max_rows,
        "max_batch_tokens": max_tokens,
        "rows": k,
        "outstanding": n,
        "requests_per_message": m,
        "rows_per_s": round(rows_per_s, 1),
        "engine_alone_rows_per_s": round(engine_alone, 1),
        "ratio": round(rows_per_s / engine_alone, 3),
        "cpu_us_per_row": round(statistics.median(cpu), 1),
        "engine_alone_cpu_us_per_row": round(alone_us, 1),
        "cpu_ratio": round(alone_us / statistics.median(cpu), 3),
    }


def headline(
    summary: list[dict[str, Any]], bounds: list[Bound], ks: list[int], deepest: int, per_message: list[int]
) -> dict[str, Any]:
    """The deepest queue's figures per rows a request (and per bound and requests a message, named in the keys when
    there are several)."""
    head: dict[str, Any] = {}
    for (r, t), m in itertools.product(bounds, per_message):
        tag = (f"_{r}x{t}" if len(bounds) > 1 else "") + (f"_{m or 'all'}_a_message" if len(per_message) > 1 else "")
        at = {
            c["rows"]: c
            for c in summary
            if (c["max_batch_rows"], c["max_batch_tokens"], c["outstanding"], c["requests_per_message"])
            == (r, t, deepest, m)
        }
        head[f"engine_alone_rows_per_s{tag}"] = at[ks[0]]["engine_alone_rows_per_s"]
        head[f"engine_alone_cpu_us_per_row{tag}"] = at[ks[0]]["engine_alone_cpu_us_per_row"]
        for key in ("ratio", "cpu_ratio", "cpu_us_per_row", "rows_per_s"):
            head |= {f"{key}_{k}_rows_{deepest}{tag}": at[k][key] for k in ks}
    return head


def measure(
    args: argparse.Namespace,
    model: str,
    work: Path,
    bounds: list[Bound],
    ks: list[int],
    outstanding: list[int],
    per_message: list[int],
    patches: list[Patch],
    pool: Pool,
    texts: list[str],
    rng: random.Random,
) -> list[dict[str, Any]]:
    """Every cell, interleaved over --repeats, with one engine process per bound (all up at once)."""
    engines: dict[Bound, EngineProcess] = {}
    clients: dict[tuple[Bound, int], Client] = {}
    cells: list[Cell] = list(itertools.product(bounds, ks, outstanding, per_message))
    runs: dict[Cell, list[float]] = {c: [] for c in cells}
    cpu: dict[Cell, list[float]] = {c: [] for c in cells}
    try:
        for b in bounds:
            engines[b] = start_engine(args, model, work / f"engine-{b[0]}-{b[1]}", b, max(outstanding) * 2)
            clients |= {(b, k): Client(engines[b].address, pool) for k in ks}
            first = clients[b, ks[0]]
            for j, p in enumerate(patches):  # every patch sent once (as a front end does): every task resident
                first.ask(encode(pack_requests(10**7 + j, [[Row([101, 102], [0, 0], p)]], {p.patch_id: p.data})))
            for k in ks:  # warm-up of each shape
                clients[b, k].rows_per_s(k, max(outstanding), 1.0)
        batch_rows = sorted({r for r, _ in bounds})
        alone_engines = {r: EngineAlone(model, patches, texts, r, args.device, args.dtype) for r in batch_rows}
        alone: dict[int, list[float]] = {r: [] for r in batch_rows}
        alone_cpu: dict[int, list[float]] = {r: [] for r in batch_rows}
        for rep in range(args.repeats):
            for r, alone_engine in alone_engines.items():
                alone[r].append(alone_engine.rows_per_s(args.tasks, rng))
                alone_cpu[r].append(alone_engine.last_cpu_s / alone_engine.last_rows * 1e6)
            shift = rep % len(cells)
            for cell in cells[shift:] + cells[:shift]:
                b, k, n, m = cell
                process = engines[b].process
                assert process is not None and process.pid is not None
                c0 = cpu_seconds(process.pid)
                runs[cell].append(clients[b, k].rows_per_s(k, n, args.seconds, m))
                cpu[cell].append((cpu_seconds(process.pid) - c0) / clients[b, k].last_rows * 1e6)
                line = {"max_batch_rows": b[0], "max_batch_tokens": b[1], "rows": k, "outstanding": n}
                line |= {"requests_per_message": m, "rows_per_s": round(runs[cell][-1])}
                print(json.dumps(line), file=sys.stderr)
    finally:
        for c in clients.values():
            c.close()
        for engine in engines.values():
            engine.stop()
    return [summarise(c, runs[c], cpu[c], alone[c[0][0]], alone_cpu[c[0][0]]) for c in cells]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 and 1 rows a request, 2,048 and 256 in flight, 2 x 3 s")
    ap.add_argument("--model", default=FREE_MODEL, help="encoder: FREE (see above), default, or a folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,8", help="rows a request (comma-separated)")
    ap.add_argument("--outstanding", default="64,256,2048", help="rows in flight (comma-separated)")
    ap.add_argument(
        "--per-message",
        default="0",
        help="requests a message at most (comma-separated: a grid axis). 0: every request answered goes out again in "
        "one message, as one busy front end sends them; 1: each its own, as many front ends with one request each",
    )
    ap.add_argument("--tasks", type=int, default=200, help="tasks the rows spread over (all resident)")
    ap.add_argument(
        "--max-batch-rows",
        default=None,
        help="the engine's row bound per batch, and the alone run's batch (comma-separated: a grid axis, one engine "
        "process each). Default: serve's for the device (32 on the CPU, 256 on a GPU)",
    )
    ap.add_argument(
        "--max-batch-tokens",
        default="8192",
        help="the engine's token bound per batch (comma-separated: a grid axis). Default: serve's, 8192",
    )
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the engine process and of the engine alone (default: every core, as serve does)",
    )
    ap.add_argument("--seconds", type=float, default=5.0, help="load per cell and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DATA, help="folder of */dev.jsonl sets (the texts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "engine_process.jsonl", help="JSON lines of full runs")
    ap.add_argument("--note", default="", help="a note for the table")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    if args.quick:
        args.rows, args.outstanding, args.seconds, args.repeats = "8,1", "2048,256", 3.0, 2
    ks = [int(x) for x in args.rows.split(",")]
    outstanding = [int(x) for x in args.outstanding.split(",")]
    per_message = [int(x) for x in args.per_message.split(",")]
    batch_rows = batch_rows_axis(args.max_batch_rows, args.device)
    bounds = list(itertools.product(batch_rows, [int(x) for x in args.max_batch_tokens.split(",")]))
    work = Path(tempfile.mkdtemp(prefix="bench-engine-process-"))
    model = model_source(args.model, work)
    encoder = load_encoder(model)
    patches = [random_patch(encoder, f"task{i}", seed=i + 1, scale=0.05) for i in range(args.tasks)]
    texts = sentences(args.data, args.seed)
    rng = random.Random(args.seed)
    token_rows = encoder.tokenizer(texts[:4000], truncation=True, max_length=128)["input_ids"]
    del encoder
    pool = Pool(token_rows, [p.patch_id for p in patches], 50_000, rng)
    if args.engine_threads is not None:
        torch.set_num_threads(args.engine_threads)
    summary = measure(args, model, work, bounds, ks, outstanding, per_message, patches, pool, texts, rng)
    if not args.quick:
        meta = {
            "command": "python bench/engine_process.py " + " ".join(sys.argv[1:]),
            "engine": f"{args.model} encoder on {args.device} ({args.dtype}), {args.tasks} tasks, batches of up to "
            + " / ".join(f"{r} rows and {t:,} tokens" for r, t in bounds),
            "device": device_name(args.device),
            "seconds": args.seconds,
            "repeats": args.repeats,
            "notes": args.note,
        }
        append_run(args.out, meta, [{"kind": "cell", **c} for c in summary])
        render(args.out)
        print(f"wrote {args.out} and its .md and .png", file=sys.stderr)
    for c in summary:
        print(json.dumps(c), file=sys.stderr)
    print(json.dumps(headline(summary, bounds, ks, max(outstanding), per_message)))


if __name__ == "__main__":
    main()
