"""What the pieces of a front end's hot path cost, on its event loop: a thread-pool hop, and tokenizing a request's
texts inline -- where the server's threshold for tokenizing on the loop (server.inference.INLINE_TOKENIZE_CHARS)
comes from.

    python bench/front_end.py --quick     # fewer repeats; last line: JSON
    python bench/front_end.py             # -> docs/benchmarks/front_end.{jsonl,md,png}

* hop: ``await run_in_threadpool(f)`` for an ``f`` that does nothing, as the server did per request for its catalog
  lookup and its tokenizing: the wall time one costs the request, and the event loop's own CPU time per hop.
* tokenize: ``patchserve.server.predict.encode`` (the default encoder's tokenizer, as the server calls it) on one text
of N characters of real sentences, N = 16 .. 8,192: CPU time per call, inline.
* threshold: tokenizing inline saves the hop (its CPU on the loop, and its wall time in the request) at every
  size; the price is that the loop serves no other request meanwhile. So texts are tokenized inline while that
  holds the loop for at most HOLD_BUDGET_US (1 ms: less than one batch of 32 rows takes on a GPU, so a neighbour
  waits less than its own forward), and in a worker thread above it (where the tokenizer's Rust core runs without
  the GIL). The threshold is the largest N whose inline tokenizing fits the budget, rounded down to a power of two.
  Measured over HTTP on 2 cores (bench/http.py, free model, 2 front ends, concurrency 64, 8 inputs of ~150
  characters, same run, 2 runs each): threshold 2,048 (inline) 864 and 868 req/s, p99 153 and 139 ms; threshold
  256 (a hop per request) 804 and 690 req/s, p99 169 and 174 ms.

Medians over --repeats rounds, the pieces interleaved within each round.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from bench.common import DATA, OUT, append_run, latest_run, pyplot, sentences
from patchserve.patches.encoder import load_tokenizer
from patchserve.server.inference import INLINE_TOKENIZE_CHARS
from patchserve.server.predict import encode, serial_tokenizers

SIZES = (16, 64, 256, 1024, 2048, 4096, 8192)
HOLD_BUDGET_US = 1000.0  # the longest one request's tokenizing may hold its front end's event loop


def _noop() -> None:
    return None


async def hop_costs(n: int) -> tuple[float, float]:
    """(wall µs, loop-thread CPU µs) per hop, over ``n`` hops one after another."""
    await run_in_threadpool(_noop)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        await run_in_threadpool(_noop)
    return (time.perf_counter() - wall) / n * 1e6, (time.thread_time() - cpu) / n * 1e6


def tokenize_cost(tokenizer: Any, text: str, n: int) -> float:
    """CPU µs per ``encode`` of one text, inline."""
    encode(tokenizer, None, [text], None, 512, 8192, "embedding")
    cpu = time.thread_time()
    for _ in range(n):
        encode(tokenizer, None, [text], None, 512, 8192, "embedding")
    return (time.thread_time() - cpu) / n * 1e6


def text_of(chars: int, texts: list[str]) -> str:
    out = ""
    for t in texts:
        if len(out) >= chars:
            break
        out += t + " "
    return out[:chars]


def threshold(costs: dict[int, float], budget_us: float = HOLD_BUDGET_US) -> int:
    fits = [n for n, us in costs.items() if us <= budget_us]
    return 2 ** (max(fits).bit_length() - 1) if fits else 0


def render(jsonl: Path) -> None:
    meta, lines = latest_run(jsonl)
    (row,) = lines
    md = [
        "# The front end's hot path: a thread hop against tokenizing inline",
        "",
        f"Written by `{meta['command']}` on {meta['machine']}, {meta['date']} (commit {meta['commit']}); medians "
        f"over {meta['repeats']} rounds. How to read it: bench/front_end.py's docstring.",
        "",
        f"- a thread-pool hop: **{row['hop_wall_us']:.0f} µs** of a request's time, {row['hop_cpu_us']:.0f} µs of "
        "the event loop's CPU (what tokenizing inline saves)",
        f"- texts of up to **{row['threshold_chars']:,} characters** hold the loop for at most "
        f"{row['hold_budget_us']:,.0f} µs, so they are tokenized on it (the server's setting: "
        f"{row['server_threshold_chars']:,}); longer ones in a worker thread",
        "",
        "| characters | tokenize inline, CPU µs | vs a hop |",
        "|---:|---:|---:|",
    ]
    for n, us in row["tokenize_us"].items():
        md.append(f"| {int(n):,} | {us:.0f} | {us / row['hop_wall_us']:.2f}x |")
    (jsonl.parent / "front_end.md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [int(n) for n in row["tokenize_us"]]
    ax.plot(xs, list(row["tokenize_us"].values()), marker="o", label="tokenize inline (CPU)")
    ax.axhline(row["hop_wall_us"], color="grey", linestyle="--", label="a thread-pool hop (wall)")
    ax.axhline(row["hold_budget_us"], color="black", linestyle="-.", label="the loop-hold budget")
    ax.axvline(row["server_threshold_chars"], color="red", linestyle=":", label="the server's threshold")
    ax.set(xscale="log", yscale="log", xlabel="characters in the request", ylabel="µs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(jsonl.parent / "front_end.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of fewer calls")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=OUT / "front_end.jsonl")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    rounds, calls = (3, 200) if args.quick else (args.repeats, 1000)
    serial_tokenizers()  # as `patchserve serve` tokenizes: on the calling thread, all of it counted by thread_time
    tokenizer = load_tokenizer(args.model)
    texts = sentences(args.data, 0)
    hops: list[tuple[float, float]] = []
    tok: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(rounds):
        hops.append(asyncio.run(hop_costs(calls)))
        for n in SIZES:
            tok[n].append(tokenize_cost(tokenizer, text_of(n, texts), max(20, calls // (1 + n // 256))))
    hop_wall = statistics.median(h[0] for h in hops)
    hop_cpu = statistics.median(h[1] for h in hops)
    costs = {n: statistics.median(v) for n, v in tok.items()}
    row = {
        "kind": "costs",
        "hop_wall_us": round(hop_wall, 1),
        "hop_cpu_us": round(hop_cpu, 1),
        "tokenize_us": {str(n): round(us, 1) for n, us in costs.items()},
        "hold_budget_us": HOLD_BUDGET_US,
        "threshold_chars": threshold(costs),
        "server_threshold_chars": INLINE_TOKENIZE_CHARS,
    }
    if not args.quick:
        append_run(
            args.out, {"command": "python bench/front_end.py " + " ".join(sys.argv[1:]), "repeats": rounds}, [row]
        )
        render(args.out)
        print(f"wrote {args.out}, front_end.md, front_end.png", file=sys.stderr)
    print(json.dumps({k: v for k, v in row.items() if k != "kind"}))


if __name__ == "__main__":
    main()
