"""What a BitFit update costs against a full fine-tuning update of the same encoder on the same rows.

    python bench/train_cost.py --quick     # 1 repeat; last line: JSON
    python bench/train_cost.py             # 3 repeats -> docs/benchmarks/train_cost.{jsonl,md,png}

Each mode runs in its own process (so its peak memory is its own), the modes alternating, ``--repeats`` times:
the trainer's own step (``trainer.train``: collate, forward, loss, backward, gradient clipping, AdamW) over the
same batches of Rotten Tomatoes rows. Per run: the median seconds per update, and the memory the updates add
on top of the loaded model (peak resident set size during the updates minus before them on the CPU; peak
allocated bytes on CUDA). The ratios are BitFit / full: below 1 means BitFit is cheaper.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import json
import statistics
import subprocess
import threading
import time
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from patches.data import load_dataset
from patches.encoder import load_encoder, resolve_device
from patches.jobs import TrainConfig
from patches.model import TaskModel
from trainer.train import collate, featurize, loss_fn, trainable_parameters

OUT = ROOT / "docs" / "benchmarks"
MODES = ("bitfit", "full")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """Samples this process's resident set every millisecond while the updates run."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process: warm-up updates, then ``--steps`` timed ones."""
    torch.manual_seed(0)
    device = resolve_device(args.device)
    encoder = load_encoder(args.model)
    ds = load_dataset(args.data)
    labels = sorted({str(e.label) for e in ds.examples})
    feats = featurize(encoder.tokenizer, ds, labels, 128)
    config = TrainConfig(task="cost", full=args.child == "full")
    model = TaskModel(encoder.model, torch.nn.Linear(encoder.hidden_size, len(labels)), ds.kind, "mean").to(device)
    encoder_params, head_params = trainable_parameters(model, config)
    params = encoder_params + head_params
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    n = len(feats)
    batches = [[feats[(i * args.batch + j) % n] for j in range(args.batch)] for i in range(args.warmup + args.steps)]
    pad_id = int(encoder.tokenizer.pad_token_id or 0)

    def update(rows: list[Any]) -> None:
        batch = collate(rows, pad_id, ds.kind, device)
        loss = loss_fn(
            ds.kind, model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]), batch["labels"]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else _rss_bytes()
    times = []
    with PeakRss() as rss:
        for i, rows in enumerate(batches):
            t0 = time.perf_counter()
            update(rows)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss.peak
    return {
        "mode": args.child,
        "trainable_params": sum(p.numel() for p in params),
        "s_per_update": statistics.median(times),
        "memory_bytes": peak - before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="encoder: 'default', a local HF folder or a hub id")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "rotten_tomatoes" / "train.jsonl"),
        help="a labelled JSONL file (default: the shared Rotten Tomatoes training set)",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed updates per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 10 updates; prints one JSON line")
    ap.add_argument("--out", type=Path, default=OUT / "train_cost.jsonl")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.quick:
        args.repeats, args.steps = 1, 10
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--device", args.device]
            cmd += ["--data", args.data, "--batch", str(args.batch), "--steps", str(args.steps)]
            cmd += ["--warmup", str(args.warmup)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("s_per_update", "memory_bytes")} for m in MODES}
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    )
    result = {
        "device": device,
        "torch": torch.__version__,
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "trainable_bitfit": runs["bitfit"][0]["trainable_params"],
        "trainable_full": runs["full"][0]["trainable_params"],
        "ms_per_update_bitfit": round(med["bitfit"]["s_per_update"] * 1e3, 1),
        "ms_per_update_full": round(med["full"]["s_per_update"] * 1e3, 1),
        "update_ratio": round(med["bitfit"]["s_per_update"] / med["full"]["s_per_update"], 3),
        "memory_mb_bitfit": round(med["bitfit"]["memory_bytes"] / 2**20, 1),
        "memory_mb_full": round(med["full"]["memory_bytes"] / 2**20, 1),
        "memory_ratio": round(med["bitfit"]["memory_bytes"] / max(med["full"]["memory_bytes"], 1), 3),
    }
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        render(args.out)
    print(json.dumps(result))


WHY = [
    "## Why BitFit stays above 0.6x here",
    "",
    "Where an update's time goes (torch profiler, default encoder, batch 32, 2 CPU cores, 2026-11-23; BitFit 537 ms, "
    "full 946 ms in that run): the forward's matrix products (~127 ms in both); the backward's products (BitFit "
    "~127 ms: input gradients only; full ~257 ms: input and weight gradients); dropout masks (`bernoulli_`, ~113 ms "
    "in both: a fifth of a BitFit update); GELU, softmax, LayerNorm and copies (~90 ms in both); and, in full "
    "fine-tuning only, AdamW over 22.7 M parameters (`sqrt`, `div`, `lerp`, `fill_`: ~225 ms).",
    "",
    "Autograd already skips everything a bias-only backward can: no weight gradient is computed, no input that only "
    "a weight gradient needs is saved (hence BitFit's 0.68x memory), the frozen embeddings get no gradient, and "
    "LayerNorm's backward skips its gain. What is left is exact work a bias gradient needs: the forward, and the "
    "gradient with respect to every layer's input, all the way down (the lowest trainable bias is the embedding "
    "LayerNorm's). For the matrix products that is 2 of full fine-tuning's 3; the elementwise work is the same in "
    "both; only the optimizer and the weight gradients are saved. So the ratio sits at 0.66-0.73 (run to run on this "
    "shared machine), not at 0.6. Making dropout masks or elementwise ops cheaper speeds both modes and moves the "
    "ratio up, not down; below 2/3 an update must stop being exact (a truncated backward, fewer trained biases).",
]


def render(jsonl: Path) -> None:
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    lines = [
        "# Training cost: a BitFit update against a full fine-tuning update",
        "",
        "Written by `python bench/train_cost.py` from `train_cost.jsonl`. Same encoder, same batches of Rotten",
        "Tomatoes rows, the trainer's own step; each mode in its own process, alternating; medians over the runs.",
        "Memory: what the updates add on top of the loaded model (peak RSS on the CPU, peak allocated on CUDA).",
        "Goal (issue 15): a BitFit update costs <= 0.6x a full one.",
        "",
        "| device | batch | trainable (BitFit / full) | ms/update BitFit | ms/update full | ratio | MB BitFit "
        "| MB full | ratio |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['batch']} | {r['trainable_bitfit']:,} / {r['trainable_full']:,} | "
            f"{r['ms_per_update_bitfit']} | {r['ms_per_update_full']} | {r['update_ratio']:.2f}x | "
            f"{r['memory_mb_bitfit']} | {r['memory_mb_full']} | {r['memory_ratio']:.2f}x |"
        )
    lines += ["", *WHY]
    (jsonl.parent / "train_cost.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[plot]'): no plot", file=sys.stderr)
        return
    last = rows[-1]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, (key, unit) in zip(
        axes, [("ms_per_update", "ms per update"), ("memory_mb", "MB added by updates")], strict=True
    ):
        values = [last[f"{key}_bitfit"], last[f"{key}_full"]]
        ax.bar(["BitFit", "full"], values, color=["tab:green", "tab:blue"])
        ax.set(ylabel=unit, title=f"{unit}: {values[0] / max(values[1], 1e-9):.2f}x")
    fig.suptitle(f"{last['device']}, batch {last['batch']}")
    fig.tight_layout()
    fig.savefig(jsonl.parent / "train_cost.png", dpi=110)


if __name__ == "__main__":
    main()
