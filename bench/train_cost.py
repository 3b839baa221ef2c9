"""What a BitFit update and a default BitFit run cost against full fine-tuning of the same encoder on the same rows.

    python bench/train_cost.py --quick     # 1 repeat, runs on 1,000 rows; last line: JSON
    python bench/train_cost.py             # 3 repeats -> docs/benchmarks/train_cost.{jsonl,md,png}
    python bench/train_cost.py --no-runs --no-jobs   # the updates only

Updates. Each mode runs in its own process (so its peak memory is its own), the modes alternating, ``--repeats``
times, over the same batches of Rotten Tomatoes rows: ``packed`` (BitFit on the packed model, as the trainer runs
it: patches/packed_model.py), ``padded`` (BitFit on the plain padded model, as it ran before) and ``full`` (every
weight). Each is the trainer's own step: collate, forward, loss, backward, gradient clipping, AdamW. Per run: the
median seconds per update, and the memory the updates add on top of the loaded model (peak resident set size
during the updates minus before them on the CPU; peak allocated bytes on CUDA). ``update_ratio`` is BitFit
(packed) / full and ``speedup_packed`` padded / packed. ``packed-ia3`` is the packed model training a ``bitfit-ia3``
patch (biases plus (IA)^3 scales, ``--scales ia3``): ``ia3_vs_packed`` is its update's time over BitFit's.
``ops_update_MODE`` counts one update's ATen ops on the CPU, its host-side launches (kernels, graph launches, copies)
on CUDA, where an update of a small model is bound by launching them. Where the packed model's default is bfloat16
(a CUDA GPU: autocast with flash attention; a CPU whose bfloat16 products measure faster: the frozen weights' products),
``packed-float32`` is the same update in float32 throughout (``--precision float32``), and ``half_speedup`` its time
over the default's (CUDA rows before 2026-12-02 call it ``flash_speedup``).

Runs. A default ``train_patch`` of each mode (BitFit packed, BitFit padded, full) on the first ``--run-rows`` rows
of the training set with ``--dev-rows`` dev rows, each in its own process: its wall time, steps and dev accuracy.
``ratio_run`` is BitFit / full: at most 1 means a patch costs no more than a full fine-tune. ``restarts3`` (with
``--run-modes``) is the BitFit run with 3 restarts trained together in one batch, the best kept: ``restarts_ratio``
is its time over the one run's. ``float32`` (with ``--run-modes``) is the BitFit run in float32 throughout
(``--precision float32``) where the default is not: ``run_half_speedup`` is its time over the default run's.

Jobs. ``--concurrent-jobs K`` default BitFit jobs (each on its own ``--job-rows`` slice of the training set, its own
seed, at most ``--job-max-steps`` updates), trained one at a time and then together in one batch, as
``patchserve worker --concurrent-jobs K`` trains them (``patchserve.trainer.joint.JointTrainer``), each way in its own
process: ``jobs_per_hour_1`` and ``jobs_per_hour_k``, and their ratio ``jobs_speedup``.
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

from bench.common import count_ops, machine
from patchserve.patches.data import load_dataset
from patchserve.patches.encoder import load_encoder, resolve_device
from patchserve.patches.packed_model import training_dtype
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer.features import collate, featurize
from patchserve.trainer.models import PackedRuns, PaddedRun, RunModel
from patchserve.trainer.runs import loss_fn
from patchserve.trainer.train import train_patch

OUT = ROOT / "docs" / "benchmarks"
MODES = ("packed", "padded", "full", "packed-ia3", "packed-float32")  # packed-float32: where packed is not float32
RUN_MODES = ("run-bitfit", "run-padded", "run-full", "run-restarts3", "run-float32")
JOB_MODES = ("jobs-1", "jobs-k")
DATA = ROOT.parent / "shared" / "data" / "rotten_tomatoes"


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
    config = TrainConfig(
        task="cost",
        full=args.child == "full",
        scales="ia3" if args.child == "packed-ia3" else "none",
        precision="float32" if args.child == "packed-float32" else "auto",
    )
    head = torch.nn.Linear(encoder.hidden_size, len(labels))
    model: RunModel  # the trainer's own models: packed runs, or one padded run
    if args.child.startswith("packed"):
        model = PackedRuns(encoder.model.to(device), [head], ds.kind, "mean", config)
    else:
        model = PaddedRun(encoder.model, head, ds.kind, "mean", config, device)
    params = model.parameters_of(0)
    optimizer = model.optimizer([1e-3], [1e-3], config, lambda step: 1.0)  # the trainer's own AdamW and clipping
    model.train()
    n = len(feats)
    batches = [[feats[(i * args.batch + j) % n] for j in range(args.batch)] for i in range(args.warmup + args.steps)]
    pad_id = int(encoder.tokenizer.pad_token_id or 0)

    def update(rows: list[Any]) -> None:
        batch = collate(rows, pad_id, ds.kind, device)
        loss = loss_fn(ds.kind, model.logits(batch, torch.zeros(len(rows), dtype=torch.long)), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step([0])

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
        "ops_per_update": count_ops(lambda: update(batches[0]), device),
    }


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One default training run of a mode, in this process: wall time, steps, dev accuracy."""
    from dataclasses import replace

    encoder = load_encoder(args.model)
    train_all = load_dataset(args.data)
    dev_all = load_dataset(args.dev, kind=train_all.kind, labels=train_all.labels or None)
    train = replace(train_all, examples=train_all.examples[: args.run_rows or None])
    dev = replace(dev_all, examples=dev_all.examples[: args.dev_rows or None])
    mode = args.child.removeprefix("run-")
    extra: dict[str, Any] = {"restarts": 3, "restarts_merge": "best"} if mode == "restarts3" else {}
    if mode == "float32":
        extra["precision"] = "float32"
    config = TrainConfig(task="cost", full=mode == "full", device=args.device, max_steps=args.run_max_steps, **extra)
    t0 = time.perf_counter()
    result = train_patch(encoder, train, dev, config, packed=False if mode == "padded" else None)
    seconds = time.perf_counter() - t0
    report = result.report
    return {
        "mode": args.child,
        "seconds": seconds,
        "forward": report["forward"],
        "steps": report["steps"],
        "planned_steps": report["planned_steps"],
        "runs": report["selection"]["tried"],
        "dev_accuracy": report["dev"]["accuracy"],
        "train_rows": report["train_rows"],
        "dev_rows": report["dev_rows"],
        "precision": report["precision"],
    }


def jobs_child(args: argparse.Namespace) -> dict[str, Any]:
    """K default jobs in this process, one at a time (``jobs-1``) or in one batch (``jobs-k``): wall time."""
    from dataclasses import replace

    from patchserve.patches.packed_model import training_bert
    from patchserve.trainer.joint import JointTrainer
    from patchserve.trainer.train import PatchTraining

    encoder = load_encoder(args.model)
    encoder.model.to(resolve_device(args.device))
    shared = training_bert(encoder.model)
    train_all = load_dataset(args.data)
    dev_all = load_dataset(args.dev, kind=train_all.kind, labels=train_all.labels or None)
    dev = replace(dev_all, examples=dev_all.examples[: args.job_dev_rows])
    t0 = time.perf_counter()
    trainings = []
    for i in range(args.concurrent_jobs):
        rows = train_all.examples[i * args.job_rows : (i + 1) * args.job_rows]
        config = TrainConfig(task=f"job{i}", seed=i, device=args.device, max_steps=args.job_max_steps)
        trainings.append(PatchTraining(encoder, replace(train_all, examples=rows), dev, config, packed_bert=shared))
    groups = [trainings] if args.child == "jobs-k" else [[t] for t in trainings]
    accuracy = []
    for group in groups:
        trainer = JointTrainer(group)
        while len(trainer):
            for training, error in trainer.step():
                if error is not None:
                    raise error
                accuracy.append(training.finish().report["dev"]["accuracy"])
    seconds = time.perf_counter() - t0
    return {
        "mode": args.child,
        "seconds": seconds,
        "jobs": args.concurrent_jobs,
        "trained": len(accuracy),
        "jobs_per_hour": 3600 * args.concurrent_jobs / seconds,
        "dev_accuracy": statistics.mean(accuracy),
    }


def _spawn(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--device", args.device]
    cmd += ["--data", args.data, "--dev", args.dev, "--batch", str(args.batch), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--run-rows", str(args.run_rows), "--dev-rows", str(args.dev_rows)]
    cmd += ["--concurrent-jobs", str(args.concurrent_jobs), "--job-rows", str(args.job_rows)]
    cmd += ["--job-dev-rows", str(args.job_dev_rows)]
    cmd += ["--job-max-steps", str(args.job_max_steps)]
    if args.run_max_steps:
        cmd += ["--run-max-steps", str(args.run_max_steps)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    line = out.strip().splitlines()[-1]
    print(f"{mode}: {line}", file=sys.stderr, flush=True)  # each child's figures as it ends: a run cut short keeps them
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="encoder: 'default', a local HF folder or a hub id")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--data",
        default=str(DATA / "train.jsonl"),
        help="a labelled JSONL file (default: the shared Rotten Tomatoes training set)",
    )
    ap.add_argument("--dev", default=str(DATA / "dev.jsonl"), help="the runs' dev set (default: Rotten Tomatoes')")
    ap.add_argument("--run-rows", type=int, default=1000, help="training rows of each default run (first N; 0: all)")
    ap.add_argument("--dev-rows", type=int, default=300, help="dev rows of each default run (first N; 0: all)")
    ap.add_argument("--no-runs", action="store_true", help="time the updates only, not the default runs")
    ap.add_argument(
        "--run-modes",
        default="bitfit,padded,full",
        help="which default runs (comma-separated: bitfit, padded, full, restarts3: BitFit, 3 restarts in a batch; "
        "float32: BitFit in float32 throughout)",
    )
    ap.add_argument("--run-max-steps", type=int, help="cap each default run's updates (default: no cap)")
    ap.add_argument("--no-jobs", action="store_true", help="skip the concurrent jobs' figures")
    ap.add_argument("--concurrent-jobs", type=int, help="jobs trained together (default 8; 4 with --quick)")
    ap.add_argument("--job-rows", type=int, default=256, help="training rows of each job (default 256)")
    ap.add_argument("--job-dev-rows", type=int, default=300, help="dev rows of each job (first N; default 300)")
    ap.add_argument("--job-max-steps", type=int, help="cap each job's updates (default 60; 20 with --quick)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed updates per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--job-repeats", type=int, help="runs of each way of training the jobs (default: --repeats)")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 10 updates; prints one JSON line")
    ap.add_argument("--out", type=Path, default=OUT / "train_cost.jsonl")
    ap.add_argument("--note", default="", help="how the machine was shared: recorded with the line, shown in its table")
    ap.add_argument("--child", choices=MODES + RUN_MODES + JOB_MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work = run_child if args.child in RUN_MODES else jobs_child if args.child in JOB_MODES else child
        print(json.dumps(work(args)))
        return
    if args.quick:
        args.repeats, args.steps = 1, 10
    args.concurrent_jobs = args.concurrent_jobs or (4 if args.quick else 8)
    args.job_max_steps = args.job_max_steps or (20 if args.quick else 60)
    half = training_dtype(resolve_device(args.device)) is not None  # the packed default is not float32 here
    modes = MODES if half else tuple(m for m in MODES if m != "packed-float32")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            runs[mode].append(_spawn(args, mode))
    figures = ("s_per_update", "memory_bytes", "ops_per_update")
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in figures} for m in modes}
    run_modes = [f"run-{m.strip()}" for m in args.run_modes.split(",") if m.strip()]
    if not set(run_modes) <= set(RUN_MODES):
        ap.error(f"--run-modes: each of {', '.join(m.removeprefix('run-') for m in RUN_MODES)}")
    trained = {} if args.no_runs else {m.removeprefix("run-"): _spawn(args, m) for m in run_modes}
    jobs: dict[str, list[dict[str, Any]]] = {m: [] for m in JOB_MODES}
    job_repeats = args.repeats if args.job_repeats is None else args.job_repeats
    for r in range(0 if args.no_jobs else job_repeats):
        for mode in JOB_MODES if r % 2 == 0 else JOB_MODES[::-1]:
            jobs[mode].append(_spawn(args, mode))
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    )
    result = machine() | {  # date, machine, python, torch, patchserve and the commit it measured
        "device": device,
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "trainable_bitfit": runs["packed"][0]["trainable_params"],
        "trainable_full": runs["full"][0]["trainable_params"],
        "ms_update_packed": round(med["packed"]["s_per_update"] * 1e3, 1),
        "ms_update_padded": round(med["padded"]["s_per_update"] * 1e3, 1),
        "ms_per_update_full": round(med["full"]["s_per_update"] * 1e3, 1),
        "speedup_packed": round(med["padded"]["s_per_update"] / med["packed"]["s_per_update"], 2),
        "ms_update_packed_ia3": round(med["packed-ia3"]["s_per_update"] * 1e3, 1),
        # ATen ops (CPU) or host-side launches (CUDA) of one update: on a GPU an update is bound by launching them
        **{f"ops_update_{m.replace('-', '_')}": int(med[m]["ops_per_update"]) for m in modes},
        "ia3_vs_packed": round(med["packed-ia3"]["s_per_update"] / med["packed"]["s_per_update"], 3),
        "update_ratio": round(med["packed"]["s_per_update"] / med["full"]["s_per_update"], 3),
        "update_ratio_padded": round(med["padded"]["s_per_update"] / med["full"]["s_per_update"], 3),
        "memory_mb_packed": round(med["packed"]["memory_bytes"] / 2**20, 1),
        "memory_mb_padded": round(med["padded"]["memory_bytes"] / 2**20, 1),
        "memory_mb_full": round(med["full"]["memory_bytes"] / 2**20, 1),
        "memory_ratio": round(med["packed"]["memory_bytes"] / max(med["full"]["memory_bytes"], 1), 3),
    }
    if "packed-float32" in med:  # the packed update in float32 throughout, against the default's bfloat16
        result["ms_update_packed_float32"] = round(med["packed-float32"]["s_per_update"] * 1e3, 1)
        result["half_speedup"] = round(med["packed-float32"]["s_per_update"] / med["packed"]["s_per_update"], 2)
    if args.note:
        result["note"] = args.note
    if trained:
        first = next(iter(trained.values()))
        result |= {"run_rows": first["train_rows"], "dev_rows": first["dev_rows"]}
        for mode, run in trained.items():
            result |= {
                f"run_s_{mode}": round(run["seconds"], 1),
                f"run_steps_{mode}": run["steps"],
                f"run_dev_accuracy_{mode}": round(run["dev_accuracy"], 4),
            }
        if "bitfit" in trained and "full" in trained:
            result["ratio_run"] = round(trained["bitfit"]["seconds"] / trained["full"]["seconds"], 3)
        if "bitfit" in trained and "padded" in trained:
            result["run_speedup_packed"] = round(trained["padded"]["seconds"] / trained["bitfit"]["seconds"], 2)
        if "bitfit" in trained and "restarts3" in trained:
            result["restarts_ratio"] = round(trained["restarts3"]["seconds"] / trained["bitfit"]["seconds"], 2)
        if "bitfit" in trained and "float32" in trained:
            result["run_half_speedup"] = round(trained["float32"]["seconds"] / trained["bitfit"]["seconds"], 2)
    if not args.no_jobs:
        per_hour = {m: statistics.median(r["jobs_per_hour"] for r in jobs[m]) for m in JOB_MODES}
        result |= {
            "concurrent_jobs": args.concurrent_jobs,
            "job_rows": args.job_rows,
            "job_max_steps": args.job_max_steps,
            "jobs_per_hour_1": round(per_hour["jobs-1"], 1),
            "jobs_per_hour_k": round(per_hour["jobs-k"], 1),
            "jobs_speedup": round(per_hour["jobs-k"] / per_hour["jobs-1"], 2),
            "jobs_dev_accuracy_1": round(statistics.median(r["dev_accuracy"] for r in jobs["jobs-1"]), 4),
            "jobs_dev_accuracy_k": round(statistics.median(r["dev_accuracy"] for r in jobs["jobs-k"]), 4),
        }
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        render(args.out)
    print(json.dumps(result))


WHY = [
    "## Where a BitFit update's time goes",
    "",
    "Padded (the plain model, as the trainer ran before issue 25; torch profiler, default encoder, batch 32, 2 CPU "
    "cores, 2026-11-23; BitFit 537 ms, full 946 ms in that run): the forward's matrix products (~127 ms in both); "
    "the backward's products (BitFit ~127 ms: input gradients only; full ~257 ms: input and weight gradients); "
    "dropout masks (`bernoulli_`, ~113 ms in both); GELU, softmax, LayerNorm and copies (~90 ms in both); and, in "
    "full fine-tuning only, AdamW over 22.7 M parameters (~225 ms). Autograd already skipped everything a bias-only "
    "backward can (no weight gradient, no input saved for one), so padded BitFit sat at 0.66-0.73x a full update: "
    "the elementwise work and two of three products are the same in both.",
    "",
    "Packed (the serving engine's model, `patches/packed_model.py`): no padding token reaches a matrix product, a "
    "dropout mask or an elementwise op, so every one of those costs shrinks by the share of padding in a batch of "
    "Rotten Tomatoes rows (batches padded to their longest row are about half padding). Attention alone is padded "
    "(exactly, with a key mask): on the CPU, since 2026-12-02, per group of rows of similar length rather than to "
    "the batch's longest row (`patches/packed_attention.py`: a layer's attention, forward and backward, 5.1 against "
    "8.6 ms at 16 rows; an update 0.88x at 16 rows, 0.76x at 48). The gradients are the padded model's "
    "(tests/test_packed_training.py).",
    "",
    "Dropout masks (issue 25 item 5, 2026-11-25): on the CPU the packed model draws its masks with "
    "`patches.packed_ops.keep_mask` (torch's generator, 64 bits a draw read as uniform integers, one compare), "
    "~2.5x cheaper than `bernoulli_`, and writes attention out in training so its dropout uses them (which also "
    "skips the math path's fully-masked-row checks). The distribution is the same (tests check the keep rates and "
    "the gradient); rows from 2026-11-25 on include it. Since 2026-12-02 a draw gives four 16-bit integers instead "
    "of two 32-bit ones (0.91 against 1.55 ms for 442,000 elements; the rate quantised to 2^-16).",
    "",
    "On a GPU (issue 60, H100, 2026-11-27): an update of this 6-layer model at batch 32 is bound by launching "
    "kernels, not by arithmetic. The packed update launches 673 host-side ops against the padded model's 373 (its "
    "per-token bias gathers and their backward, the banks folded from the flat bank at every step, autocast's "
    "casts), so it takes 17.9 ms against 13.2 ms padded and 16.7 ms full, though it does far less arithmetic. "
    "bfloat16 with flash attention left the update's time where float32 with the exact attention had it (18.0 ms, "
    "1.0x) and cut the memory it adds from 213 MB to 122 MB. A default BitFit run on all of Rotten Tomatoes took "
    "110.7 s (6,380 updates, dev 83.3) against full fine-tuning's 60.2 s (3,190 updates, dev 85.6), and 8 jobs "
    "together 1.05x the jobs an hour of one at a time: what would pay is fewer launches, a captured step.",
]


def _device(r: dict[str, Any]) -> str:
    """A row's device cell: the device, and how the row was taken where it says (``note``: a --quick run's)."""
    return r["device"] + (f" ({r['note']})" if r.get("note") else "")


def render(jsonl: Path) -> None:
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    lines = [
        "# Training cost: a BitFit update and a default BitFit run against full fine-tuning",
        "",
        "Written by `python bench/train_cost.py` from `train_cost.jsonl`. Same encoder, same batches of Rotten",
        "Tomatoes rows, the trainer's own step; each mode in its own process, alternating; medians over the runs.",
        "BitFit packed: the trainer today (issue 25); padded: the plain padded model it ran before (rows written",
        "before issue 25 have only this one). Memory: what the updates add on top of the loaded model (peak RSS on",
        "the CPU, peak allocated on CUDA). Goals (issue 25, 2 CPU cores): packed >= 1.8x padded per update, and a",
        "default BitFit run no longer than a default full fine-tuning run (`ratio_run` <= 1). On CUDA, rows from",
        "2026-11-27 on train the packed model in bfloat16 with flash attention (issue 60), and on a CPU with",
        "bfloat16 instructions rows from 2026-12-01 on take the frozen weights' products in bfloat16 (from",
        "2026-12-02 on only where they measure faster than float32's at start: not on an Intel Xeon without AMX,",
        "where `ms packed` is then the float32 update); `ms packed",
        "float32` is the same update in float32 throughout (`--precision float32`), as every earlier row ran it.",
        "",
        "## Updates",
        "",
        "| device | batch | trainable (BitFit / full) | ms packed | ms packed float32 | ms padded | ms full "
        "| packed speed-up | BitFit / full | MB packed | MB padded | MB full |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        padded = r.get("ms_update_padded", r.get("ms_per_update_bitfit"))
        mb_padded = r.get("memory_mb_padded", r.get("memory_mb_bitfit"))
        speedup = f"{r['speedup_packed']:.2f}x" if "speedup_packed" in r else "-"
        lines.append(
            f"| {_device(r)} | {r['batch']} | {r['trainable_bitfit']:,} / {r['trainable_full']:,} | "
            f"{r.get('ms_update_packed', '-')} | {r.get('ms_update_packed_float32', '-')} | {padded} | "
            f"{r['ms_per_update_full']} | {speedup} | "
            f"{r['update_ratio']:.2f}x | {r.get('memory_mb_packed', '-')} | {mb_padded} | {r['memory_mb_full']} |"
        )
    with_runs = [r for r in rows if "ratio_run" in r]
    if with_runs:
        lines += [
            "",
            "## Default runs",
            "",
            "A default `train_patch` of each mode on the first rows of the training set (`--run-rows`, `--dev-rows`):",
            "wall time in seconds, updates made, dev accuracy.",
            "",
            "| device | train / dev rows | BitFit packed | BitFit packed, float32 | BitFit padded | full "
            "| BitFit / full | packed speed-up | 3 restarts in a batch / 1 run |",
            "|---|---|---|---|---|---|---:|---:|---:|",
        ]
        for r in with_runs:
            cells = [
                f"{r[f'run_s_{m}']} s, {r[f'run_steps_{m}']} steps, {100 * r[f'run_dev_accuracy_{m}']:.1f}"
                if f"run_s_{m}" in r
                else "-"
                for m in ("bitfit", "float32", "padded", "full")
            ]
            speedup = f"{r['run_speedup_packed']:.2f}x" if "run_speedup_packed" in r else "-"
            restarts = f"{r['restarts_ratio']:.2f}x" if "restarts_ratio" in r else "-"
            lines.append(
                f"| {_device(r)} | {r['run_rows']:,} / {r['dev_rows']:,} | {' | '.join(cells)} | "
                f"{r['ratio_run']:.2f}x | {speedup} | {restarts} |"
            )
    with_jobs = [r for r in rows if "jobs_speedup" in r]
    if with_jobs:
        lines += [
            "",
            "## Concurrent jobs",
            "",
            "`--concurrent-jobs` default BitFit jobs (each its own `--job-rows` slice and seed, at most",
            "`--job-max-steps` updates), one at a time and then in one batch, as `patchserve worker",
            "--concurrent-jobs K` trains them.",
            "Goal (issue 25, H100/H200): 8 concurrent jobs >= 4x the jobs per hour of one at a time.",
            "",
            "| device | jobs | rows / max updates each | jobs/h one at a time | jobs/h together | speed-up "
            "| dev (1 / K) |",
            "|---|---:|---|---:|---:|---:|---|",
        ]
        for r in with_jobs:
            lines.append(
                f"| {_device(r)} | {r['concurrent_jobs']} | {r['job_rows']} / {r['job_max_steps']} | "
                f"{r['jobs_per_hour_1']} | {r['jobs_per_hour_k']} | {r['jobs_speedup']:.2f}x | "
                f"{100 * r['jobs_dev_accuracy_1']:.1f} / {100 * r['jobs_dev_accuracy_k']:.1f} |"
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
    panels = [
        (("ms_update_packed", "ms_update_padded", "ms_per_update_full"), "ms per update"),
        (("memory_mb_packed", "memory_mb_padded", "memory_mb_full"), "MB added by updates"),
    ]
    if "ratio_run" in last:
        panels.append((("run_s_bitfit", "run_s_padded", "run_s_full"), "s per default run"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (keys, unit) in zip(axes, panels, strict=True):
        values = [last.get(k, 0) for k in keys]
        ax.bar(["BitFit packed", "BitFit padded", "full"], values, color=["tab:green", "tab:olive", "tab:blue"])
        ax.set(ylabel=unit, title=f"{unit}: packed {values[0] / max(values[2], 1e-9):.2f}x full")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{_device(last)}, batch {last['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(jsonl.parent / "train_cost.png", dpi=110)


if __name__ == "__main__":
    main()
