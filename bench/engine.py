"""Mixed-task engine throughput vs the plain HF model at the same batch shapes, interleaved in one run.

    python bench/engine.py                      # default encoder, CPU, 100 tasks, batch 32
    python bench/engine.py --device cuda --dtype float16 --iters 200

Each iteration draws a batch of random rows (real sentences from ../shared/data when present), each row of a
random task among --tasks. Path A runs the batch through the slotted engine (every row its own task's biases
and head); path B runs the same padded batch through the plain HF encoder with one task's head -- the best a
single-task server could do. The order alternates every iteration so drift hits both alike. Prints the median
time of each and the throughput ratio A/B (>= 0.90 on CPU is the target).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patches.encoder import load_encoder
from patches.model import pool
from server.engine.runner import Row, Runner
from tests.helpers import make_patch


def sentences(n: int, seed: int) -> list[str]:
    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "rotten_tomatoes" / "train.jsonl"
    rng = random.Random(seed)
    if data.is_file():
        lines = [json.loads(x)["text"] for x in data.read_text().split("\n")[:5000] if x]
        return [rng.choice(lines) for _ in range(n)]
    words = [
        "the",
        "a",
        "movie",
        "film",
        "plot",
        "good",
        "bad",
        "actor",
        "story",
        "fun",
        "dull",
        "great",
        "scene",
        "ending",
        "long",
        "short",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-simplify", action="store_true", help="serve b_k and b_v too (no drop / fold)")
    args = ap.parse_args()

    plain_enc = load_encoder(args.model)
    runner = Runner(
        load_encoder(args.model),
        device=args.device,
        dtype=args.dtype,
        slots=args.tasks,
        drop_key_bias=not args.no_simplify,
        fold_value_bias=not args.no_simplify,
    )
    device, dtype = runner.device, runner.dtype
    plain = plain_enc.model.to(device, dtype).eval()
    patches = [
        make_patch(plain_enc, f"task{i}", seed=i, scale=0.05, subset="all" if i % 2 else "query-intermediate")
        for i in range(args.tasks)
    ]
    head_w = patches[0].head_weight.to(device, dtype)
    head_b = patches[0].head_bias.to(device, dtype)
    tok = plain_enc.tokenizer
    rng = random.Random(args.seed)
    texts = sentences(args.batch * (args.iters + args.warmup), args.seed)

    def batch(i: int) -> list[Row]:
        enc = tok(texts[i * args.batch : (i + 1) * args.batch], truncation=True, max_length=128)
        return [
            Row(ids, tt, rng.choice(patches)) for ids, tt in zip(enc["input_ids"], enc["token_type_ids"], strict=True)
        ]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def run_plain(rows: list[Row]) -> None:
        n, t = len(rows), max(len(r.input_ids) for r in rows)
        ids = torch.zeros((n, t), dtype=torch.long)
        types = torch.zeros((n, t), dtype=torch.long)
        mask = torch.zeros((n, t), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r.input_ids)
            ids[i, :k], types[i, :k], mask[i, :k] = torch.tensor(r.input_ids), torch.tensor(r.token_type_ids), 1
        ids, types, mask = ids.to(device), types.to(device), mask.to(device)
        out = plain(input_ids=ids, attention_mask=mask, token_type_ids=types)
        torch.nn.functional.linear(pool("mean", out.last_hidden_state, mask, None), head_w, head_b).float().cpu()

    for p in patches:  # load every task once: the benchmark measures the steady state, not slot loading
        runner.run([Row([101, 102], [0, 0], p)])
    times: dict[str, list[float]] = {"engine": [], "plain": []}
    for i in range(args.warmup + args.iters):
        rows = batch(i)
        order = [("engine", runner.run), ("plain", run_plain)]
        if i % 2:
            order.reverse()
        for name, fn in order:
            sync()
            t0 = time.perf_counter()
            fn(rows)
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    eng, pl = statistics.median(times["engine"]), statistics.median(times["plain"])
    print(
        f"device={device} dtype={dtype} torch_threads={torch.get_num_threads()} tasks={args.tasks} "
        f"batch={args.batch} iters={args.iters} simplify={not args.no_simplify}"
    )
    print(f"plain HF (1 task):      {pl * 1e3:8.2f} ms/batch  {args.batch / pl:8.1f} rows/s")
    print(f"engine ({args.tasks} tasks mixed): {eng * 1e3:8.2f} ms/batch  {args.batch / eng:8.1f} rows/s")
    print(f"throughput ratio engine/plain: {pl / eng:.3f}")


if __name__ == "__main__":
    main()
