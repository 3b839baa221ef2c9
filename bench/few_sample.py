"""How the trainer does on small data, the way a user with a few hundred labelled rows runs it: `patchserve train
--train FILE` with no --dev, so the dev split is carved from the training rows (10%), and `min_steps` stretches the
run (Zhang et al., ICLR 2021: train small data long enough). Scored on the set's full test split.

    python bench/few_sample.py                                    # rotten_tomatoes and trec, 256 rows, 5 seeds
    python bench/few_sample.py --sets trec --sizes 64 256 --seeds 0 1 --set eval_every=3   # try a setting
    python bench/few_sample.py --modes logreg setfit              # what users would run instead, on the same draws
    python bench/few_sample.py --quick                            # TREC draw 0, 200 updates; last line: JSON
    python bench/few_sample.py --render                           # rewrite few-sample.md and .png from the runs

The baselines (bench/baselines.py): `logreg`, the frozen encoder's floor, and `setfit`, SetFit from PyPI with its
default settings and the default encoder as its body (`pip install -e ".[baselines]"`; scripts/test installs it).

Seed s draws its rows from the set's train.jsonl (seeded sample) and trains with seed s. Each finished run is
appended to docs/few-sample-runs.jsonl with its settings (an interrupted benchmark resumes where it stopped);
docs/few-sample.md is rewritten from all recorded runs after each one, one row per set, size and settings, and so
is its figure docs/few-sample.png (runs at today's defaults and the baselines, the machine under each bar).
``--quick`` checks that the pipeline runs on this machine (under 2 minutes on 2 CPU cores): BitFit and the floor on
TREC's draw 0, BitFit's seeds at 200 updates instead of 600, recorded in a temporary folder, never in docs/.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import json
import math
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.baselines import BASELINES, BaselineResult, logreg, setfit
from bench.common import pyplot
from bench.quality import (
    MODES,
    SETS,
    add_run_arguments,
    already_run,
    best_restart,
    dev_curve,
    device_of,
    differences,
    is_current,
    load_runs,
    mean_std,
    paired_lines,
    parse_overrides,
    record_run,
    recorded,
    render_records,
    restart_scores,
    run_shape,
    sample,
    settings,
)
from patchserve.patches.data import Dataset, load_dataset, split_dev
from patchserve.patches.encoder import Encoder, default_encoder_path, load_encoder, resolve_device
from patchserve.patches.train_config import SELECTION_METRICS, TrainConfig
from patchserve.trainer.progress import progress_logger
from patchserve.trainer.train import train_patch

ROWS_NOTE = (
    "Older rows: runs with restarts=1 were recorded before 2026-11-23 (one seed, the best dev checkpoint, a dev tie "
    "kept the earlier checkpoint; since then a tie keeps the later one). Today's defaults train 3 seeds under 1,000 "
    "training rows, keep each run's last checkpoint (a dev set under 100 rows cannot rank checkpoints) and, since "
    "2026-11-25, average the seeds into one patch (`restarts_merge=best` rows kept the seed with the best carved dev "
    "score instead). Rows marked `head_init=random` are BitFit's defaults before 2026-11-27, and lora rows marked "
    "`min_steps=600` lora's before 2026-12-04. `restarts` in each run's record lists every seed's dev and test "
    "score, `merged` the average's."
)

EXPERIMENTS_NOTE = (
    "What each candidate bought, and the prototypes that left no rows here, one line each: "
    "[experiments](experiments.md)."
)


def run_baseline(
    mode: str, encoder: Encoder, draw: Dataset, test: Dataset, seed: int, device: torch.device
) -> BaselineResult:
    """A baseline on the rows seed ``seed`` drew: the floor fits on the train part and picks C on the dev part the
    trainer would carve from them; SetFit trains on all of them."""
    if mode == "setfit":
        return setfit(str(default_encoder_path()), draw, test, seed, device)
    train, dev = split_dev(draw, seed=seed)
    return logreg(encoder, train, dev, test, device)


def _mean(values: list[float], fmt: str) -> str:
    return fmt.format(statistics.mean(values)) if values else "-"


def _averaging_lines(groups: dict[tuple[str, int, str, str, str], list[dict]]) -> list[str]:
    """For runs that averaged their restarts (``restarts_merge=average``), the average against the restart the
    same runs' carved dev would have kept instead: paired, so the rows drawn cancel out."""
    lines = []
    for (ds, rows, mode, diff, device), grp in sorted(groups.items()):
        paired = [r for r in grp if "merged" in r and "heldout" in r]
        if not paired:
            continue
        shown = []
        for name, key in (("test", "test"), ("set's dev", "heldout")):
            gains = [100 * (r[key] - best_restart(r)[key]) for r in paired]
            shown.append(f"{name} {statistics.mean(gains):+.1f} (per draw: {', '.join(f'{g:+.1f}' for g in gains)})")
        lines.append(
            f"- {ds}, {rows} rows, {mode} ({diff}, {device}): the average against the best restart by dev, "
            f"same runs: {'; '.join(shown)}"
        )
    return ["", *lines] if lines else []


def _candidate_lines(groups: dict[tuple[str, int, str, str, str], list[dict]]) -> list[str]:
    """``paired_lines`` on the table's groups: each candidate against the same draws without it, scored on the
    set's own dev split and on test."""
    scores = (("set's dev", "heldout"), ("test", "test"))
    return paired_lines(groups, lambda ds, rows, mode: f"{ds}, {rows} rows, {mode}", scores, "draw")


def write_table(runs: list[dict], path: Path, command: str) -> None:
    lines = [
        "# Trainer on small data: a few hundred rows, dev carved from them",
        "",
        "Default encoder (all-MiniLM-L6-v2). Each run: N rows sampled from the set's train split, 10% of them "
        "carved off as dev (what `patchserve train` does without --dev), the rest trained on for at least "
        "`min_steps` updates; test metric (x100) on the set's full test split, mean ± std over seeds. `steps` is "
        "how many updates ran before early stopping (of `planned`), `best` the update whose checkpoint was kept. "
        "Where a run trained several seeds: `first seed alone` is the test score the run's first seed would have "
        "given alone, and `seeds' mean` the mean of its seeds' test scores (not a model: the spread left when "
        "the seed choice is averaged away, i.e. what the 256 rows drawn contribute). `set's dev` scores the kept "
        "patch on the set's own dev split, which no run trains or chooses on: the selection set for comparing "
        "settings, where the carved dev (26 rows at 256) is too small to rank them.",
        "",
        f"Reproduce with `python bench/few_sample.py` (resumable; `--set KEY=VALUE` for a candidate). Last "
        f"command: `{command}`.",
        "",
        "| data set | rows | mode | settings that differ from today's defaults | test | set's dev | dev | "
        "first seed alone | seeds' mean | steps / planned | best | runs | min/run | device |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, int, str, str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["set"], r["rows"], r["mode"], differences(r), device_of(r)), []).append(r)
    for (ds, rows, mode, diff, device), grp in sorted(groups.items()):
        test = mean_std([100 * r["test"] for r in grp])
        several = [r["restarts"] for r in grp if len(r.get("restarts", [])) > 1]
        first = mean_std([100 * seeds[0]["test"] for seeds in several])
        seeds_mean = mean_std([100 * statistics.mean(s["test"] for s in seeds) for seeds in several])
        dev = _mean([100 * r["dev"] for r in grp if r.get("dev") is not None], "{:.1f}")
        heldout = mean_std([100 * r["heldout"] for r in grp if "heldout" in r])
        steps = _mean([r["steps"] for r in grp if "steps" in r], "{:.0f}")
        planned = _mean([r["planned_steps"] for r in grp if "planned_steps" in r], "{:.0f}")
        best = _mean([r["best_step"] for r in grp if "best_step" in r], "{:.0f}")
        minutes = statistics.mean(r["seconds"] / 60 for r in grp)
        lines.append(
            f"| {ds} | {rows} | {mode} | {diff} | {test} | {heldout} | {dev} | {first} | "
            f"{seeds_mean} | {steps} / {planned} | {best} | {len(grp)} | {minutes:.1f} | {device} |"
        )
    notes = sorted({f"{differences(r)}: {r['note']}" for r in runs if r.get("note")})
    lines += ["", *(f"- {n}" for n in notes)] if notes else []
    lines += _averaging_lines(groups)
    lines += _candidate_lines(groups)
    lines += ["", ROWS_NOTE, "", EXPERIMENTS_NOTE]
    path.write_text("\n".join(lines) + "\n")


# --quick: a check that the pipeline runs here, not a measurement the table could use
QUICK_SET, QUICK_ROWS, QUICK_MIN_STEPS = "trec", 256, 200
# the figure's bars, in order
SHOWN = {"logreg": "floor", "bitfit": "BitFit", "lora": "LoRA", "full": "full FT", "setfit": "SetFit"}


def write_plot(runs: list[dict], path: Path) -> list[str]:
    """The table's figure: a panel per set and size; a bar per mode and machine (runs at today's defaults and the
    baselines), its mean test score over the draws, the std as an error bar and each draw a dot; the machine and
    draw count under each bar. Returns the bars' labels; none (and no file) where there is nothing to plot or
    matplotlib is missing."""
    current = [r for r in runs if is_current(r) and r["mode"] in SHOWN]
    panels = sorted({(r["set"], r["rows"]) for r in current})
    plt = pyplot() if panels else None
    if plt is None:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    labels = []
    for ax, (ds, rows) in zip(axes[0], panels, strict=True):
        mine = [r for r in current if (r["set"], r["rows"]) == (ds, rows)]
        bars = sorted({(r["mode"], device_of(r)) for r in mine}, key=lambda b: (list(SHOWN).index(b[0]), b[1]))
        bottom = max(0.0, 5 * math.floor(min(100 * r["test"] for r in mine) / 5) - 5)
        for i, (mode, device) in enumerate(bars):
            vals = [100 * r["test"] for r in mine if (r["mode"], device_of(r)) == (mode, device)]
            mean, std = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
            ax.bar(i, mean, 0.6, yerr=std, capsize=3, color=f"C{list(SHOWN).index(mode)}")
            ax.plot([i] * len(vals), vals, "k.", markersize=4)
            ax.text(i, bottom + 1, f"{mean:.1f}", ha="center", fontsize=9, color="white", fontweight="bold")
            machine = device.removeprefix("cuda: ").replace("NVIDIA ", "")
            labels.append(f"{SHOWN[mode]}\n{machine}\n{len(vals)} draw{'s' * (len(vals) > 1)}")
        ax.set_xticks(range(len(bars)), labels[-len(bars) :], fontsize=7)
        ax.set_ylim(bottom, 100)
        ax.set_ylabel("test accuracy (x100)")
        ax.set_title(f"{ds}, {rows} rows: today's defaults and the baselines, same draws", fontsize=10)
    fig.suptitle("Small data (bench/few_sample.py); the machine under each bar", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def render(out: Path, command: str | None = None, runs: list[dict] | None = None) -> list[dict]:
    """Rewrite ``out``'s few-sample.md and few-sample.png from ``runs`` or its few-sample-runs.jsonl
    (``render_records``)."""
    return render_records(out, "few-sample", write_table, write_plot, command, runs)


def quick_figures(runs: list[dict]) -> dict[str, Any]:
    """``--quick``'s last line: BitFit's test and set's-dev scores, the floor's, BitFit's gain and its minutes."""
    by_mode = {r["mode"]: r for r in runs}
    bitfit, floor = by_mode.get("bitfit"), by_mode.get("logreg")
    out: dict[str, Any] = {"set": runs[0]["set"], "rows": runs[0]["rows"], "min_steps": QUICK_MIN_STEPS}
    out["bitfit"] = round(100 * bitfit["test"], 1) if bitfit else None
    out["bitfit_set_dev"] = round(100 * bitfit["heldout"], 1) if bitfit else None
    out["floor"] = round(100 * floor["test"], 1) if floor else None
    if bitfit and floor:
        out["bitfit_minus_floor"] = round(out["bitfit"] - out["floor"], 1)
    out["minutes_bitfit"] = round(bitfit["seconds"] / 60, 2) if bitfit else None
    return out | {"device": device_of(runs[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["rotten_tomatoes", "trec"], choices=SETS)
    ap.add_argument("--sizes", nargs="+", type=int, default=[256], help="rows sampled from train (dev included)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["bitfit"],
        choices=[*MODES, *BASELINES],
        help="trainer modes, or baselines on the same draws: " + "; ".join(f"{k}: {v}" for k, v in BASELINES.items()),
    )
    quick = f"BitFit and the floor on {QUICK_SET}'s draw 0 of {QUICK_ROWS} rows, BitFit's seeds at {QUICK_MIN_STEPS} "
    add_run_arguments(ap, "few-sample", "eval_every=3", quick + "updates (under 2 minutes on 2 CPU cores)")
    args = ap.parse_args()
    overrides = parse_overrides(args.overrides)
    out = Path(args.out)
    if args.render:
        render(out)
        return
    if args.quick:
        args.sets, args.sizes, args.seeds, args.modes = [QUICK_SET], [QUICK_ROWS], [0], ["bitfit", "logreg"]
        overrides["min_steps"] = QUICK_MIN_STEPS
        out = Path(tempfile.mkdtemp(prefix="few-sample-quick-"))
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "few-sample-runs.jsonl"
    command = "python bench/few_sample.py " + " ".join(sys.argv[1:])
    encoder = load_encoder("default")
    device = resolve_device(args.device)
    for ds in args.sets:
        full = load_dataset(Path(args.data) / ds / "train.jsonl")
        test = load_dataset(Path(args.data) / ds / "test.jsonl", kind=full.kind, labels=full.labels or None)
        set_dev = load_dataset(Path(args.data) / ds / "dev.jsonl", kind=full.kind, labels=full.labels or None)
        for size in args.sizes:
            for mode in args.modes:
                for seed in args.seeds:
                    if mode in BASELINES:
                        if recorded(runs_file, device, set=ds, rows=size, mode=mode, seed=seed):
                            continue
                        t0 = time.perf_counter()
                        result = run_baseline(mode, encoder, sample(full, size, seed), test, seed, device)
                        rec = {"set": ds, "rows": size, "mode": mode, "seed": seed}
                        rec["metric"] = SELECTION_METRICS[full.kind][0]  # the kind's default
                        rec |= {"test": result.test, "dev": result.dev, "settings": result.settings}
                        rec["seconds"] = time.perf_counter() - t0
                        record_run(rec, device, args.note, runs_file, lambda runs: render(out, command, runs))
                        continue
                    config = TrainConfig(task=ds, seed=seed, device=str(device), **(MODES[mode] | overrides))  # type: ignore[arg-type]
                    wanted = settings(config)
                    if already_run(
                        runs_file,
                        wanted,
                        run_shape({"set": ds, "rows": size}),
                        device,
                        set=ds,
                        rows=size,
                        mode=mode,
                        seed=seed,
                    ):
                        continue
                    train, dev = split_dev(sample(full, size, seed), seed=seed)
                    t0 = time.perf_counter()
                    progress = progress_logger(prefix=f"{ds} {size} rows {mode} draw={seed}: ")  # None on a tty
                    report = train_patch(
                        encoder, train, dev, config, test=test, heldout=set_dev, on_progress=progress
                    ).report
                    metric = report["metric"]
                    rec = {
                        "set": ds,
                        "rows": size,
                        "mode": mode,
                        "seed": seed,
                        "metric": metric,
                        "test": report["test"][metric],
                        "dev": report["dev"][metric],
                        "heldout": report["heldout"][metric],  # the set's own dev split
                        "steps": report["steps"],
                        "planned_steps": report["planned_steps"],
                        "best_step": report["best_step"],
                        "curve": dev_curve(report),
                        "settings": wanted,
                        "seconds": time.perf_counter() - t0,
                    }
                    rec |= restart_scores(report, metric)  # each restart's scores, and their average's
                    record_run(rec, device, args.note, runs_file, lambda runs: render(out, command, runs))
    if args.quick:
        print(json.dumps(quick_figures(load_runs(runs_file)) | {"records": str(out)}))


if __name__ == "__main__":
    main()
