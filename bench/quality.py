"""The trainer's quality bar: BitFit (all biases), BitFit (query + intermediate) and full fine-tuning of the same
encoder, with default settings, on the shared evaluation data; mean +- std over seeds and time per run.

    python bench/quality.py                                   # every set, 3 seeds, all three modes
    python bench/quality.py --sets trec --seeds 0 --modes bitfit full --device cuda
    python bench/quality.py --sets trec --modes bitfit --set dropout=0 --out /tmp/candidate   # try a setting
    python bench/quality.py --device cuda --joint             # a set's BitFit runs in one batch (a GPU's lever)
    python bench/quality.py --quick                           # TREC, 1,000 rows, 150 updates; last line: JSON
    python bench/quality.py --render                          # rewrite quality.md and quality.png from the runs

Each finished run is appended to docs/quality-runs.jsonl with the settings it was trained with (so an interrupted
benchmark resumes where it stopped); docs/quality.md and its figure docs/quality.png (each machine's panel names it)
are rewritten from all recorded runs after each one, with only runs at today's defaults in them. ``--quick`` is a
check that the whole pipeline runs on this machine, 2.5 minutes on 2 CPU cores: BitFit, full fine-tuning and
the floor on 1,000 TREC training rows, 150 updates a run, recorded in a temporary folder, never in docs/; its
scores are not the table's.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository on sys.path instead of bench/, where http.py (the HTTP
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmark) would shadow the standard library's http

import argparse
import json
import math
import random
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, fields, replace
from typing import Any

import torch

from bench.baselines import BASELINES, logreg
from bench.common import cpu_name, pyplot
from patchserve.patches import packed_model
from patchserve.patches.data import DataFile, Dataset, Splits, load_splits
from patchserve.patches.encoder import Encoder, load_encoder, resolve_device
from patchserve.patches.packed import packed_unsupported
from patchserve.patches.packed_model import training_bert, training_dtype
from patchserve.patches.train_config import RETIRED_OPTIONS, SELECTION_METRICS, TrainConfig
from patchserve.trainer.joint import JointTrainer
from patchserve.trainer.progress import progress_logger
from patchserve.trainer.train import PatchTraining, TrainResult, train_patch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
SETS = ("rotten_tomatoes", "trec", "stsb", "banking77", "brown_pos")
SET_KINDS = {
    "rotten_tomatoes": "classification",
    "trec": "classification",
    "stsb": "regression",
    "banking77": "classification",
    "brown_pos": "token-classification",
}
MODES = {
    "bitfit": {"bias_subset": "all"},
    "bitfit-qi": {"bias_subset": "query-intermediate"},
    "full": {"full": True},
    "lora": {"lora_rank": 8},  # the opt-in lora patch: rank 8 on its default targets (every linear layer)
}
MODE_NAMES = {
    "bitfit": "BitFit (all)",
    "bitfit-qi": "BitFit (q+m2)",
    "full": "full FT",
    "lora": "LoRA (r=8)",
    "logreg": "floor",
}
# --quick: a check that the pipeline runs here, not a measurement the table could use
QUICK_SET, QUICK_ROWS, QUICK_UPDATES = "trec", 1000, 150


# Selection changed on 2026-11-23 in a way the recorded settings do not show; both tables say so.
TIE_NOTE = (
    "Checkpoint ties: since 2026-11-23 a dev score equal to the best so far keeps the later checkpoint (it was the "
    "earlier one). Runs recorded before that date were selected the old way; on these dev sets (500-3,000 rows, "
    "scores in steps of 0.03-0.2 points) what that changes has not been measured yet."
)


FLOOR_NOTE = (
    "floor: what the encoder gives with nothing of it trained (bench/baselines.py, `--modes logreg`, one run: it is "
    "deterministic): logistic regression on its mean-pooled unit vectors, C chosen on dev; for STS-B the cosine of "
    "the two sentences' vectors; for tagging, each word's unit vector (the encoder's output at its first subword). "
    "A machine named in brackets is where the floor was measured, when not this table's."
)


PAIRED_NOTE = (
    "Candidates paired with the runs without them (today's defaults, or the same other changes), seed by seed on "
    "the same machine, so what a seed decides (the head's start, the rows' order, dropout) cancels out:"
)
AVERAGED_NOTE = (
    "Averaged restarts (`--set restarts=N --set restarts_merge=average`, `patchserve train --restarts N "
    "--restarts-merge average`): one job trains N runs from the same head initialisation (seeds differing in row "
    "order and dropout) and keeps their parameters' average as its patch (a model soup); each record keeps every "
    "restart's own dev and test score, so the average is compared with its own restarts:"
)


def load_runs(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def settings(config: TrainConfig) -> dict[str, Any]:
    """What a run was trained with: every training setting but the task, seed and device; the mode's defaults
    filled in."""
    return {k: v for k, v in asdict(config.resolved()).items() if k not in ("task", "seed", "device")}


def default_settings(mode: str) -> dict[str, Any]:
    return settings(TrainConfig(task="quality", **MODES[mode]))  # type: ignore[arg-type]


def as_trained(run_settings: dict[str, Any], train_rows: float, dev_rows: float, kind: str) -> dict[str, Any]:
    """Settings as they acted on a run of a task of ``kind`` with these row counts: an unset ``restarts`` is what it
    resolves to there (1 on every full set, 3 on small data), an unset ``checkpoint`` likewise ("last" on a tiny dev
    set), an unset ``head_init`` likewise (label names for a classifier on small data), and an unset ``metric`` is
    the kind's default. Runs recorded before a setting existed ran as its old behaviour:
    no ``checkpoint`` kept the best, no ``metric`` used the kind's default, no ``restarts_merge`` kept the best
    restart, no ``scales`` trained biases only, no ``head_init`` started a random head, no ``precision`` ran as
    ``auto`` (float32 then, also on a GPU: the record's own ``precision`` says what arithmetic a run used). Where
    one run trained, ``restarts_merge`` did nothing and is left out. An option since retired (``RETIRED_OPTIONS``:
    the contrastive stage, distillation) at its "off" value changed nothing and is left out too, as is the
    distillation's temperature without a teacher or at its default (2.0). Runs recorded before LoRA trained none:
    no rank. Without a rank, LoRA's targets and alpha act on nothing and count as today's defaults. An unset
    ``dropout`` is what it resolves to there (LoRA's from SMALL_DATA_ROWS rows on, else the encoder's own,
    ``ENCODER_DROPOUT``); the lora runs recorded before LoRA's own dropout say 0.1 in their records. An unset
    ``min_steps`` is what it resolves to there (900 for LoRA on small data, else 600); runs recorded before it
    resolved by the data say 600 in their records."""
    out = {"scales": "none", "head_init": "random", "precision": "auto", "lora_rank": None} | run_settings
    resolver = replace(RESOLVER, lora_rank=out["lora_rank"], full=bool(out.get("full")))  # the run's mode
    if out.get("dropout") is None:
        out["dropout"] = resolver.dropout_for(train_rows) or ENCODER_DROPOUT
    if out.get("min_steps") is None:
        out["min_steps"] = resolver.min_steps_for(train_rows)
    if out["lora_rank"] is None:
        out |= {"lora_targets": RESOLVER.lora_targets, "lora_alpha": RESOLVER.lora_alpha}
    if not out.get("distill") or out.get("distill_temperature") == 2.0:  # without a teacher, or its old default
        out.pop("distill_temperature", None)
    for name, off in RETIRED_OPTIONS.items():
        if name in out and out[name] == off:
            del out[name]
    if "restarts_merge" not in out:
        out["restarts_merge"] = "best"
    elif out["restarts_merge"] is None:
        out["restarts_merge"] = replace(RESOLVER, restarts=out.get("restarts")).restarts_merge_for(train_rows)  # type: ignore[arg-type]
    if out.get("restarts") is None:
        out["restarts"] = RESOLVER.restarts_for(train_rows)  # type: ignore[arg-type]
    if out["restarts"] == 1:  # one run: nothing to merge
        del out["restarts_merge"]
    if "checkpoint" not in out:
        out["checkpoint"] = "best"
    elif out["checkpoint"] is None:
        out["checkpoint"] = RESOLVER.checkpoint_for(dev_rows)  # type: ignore[arg-type]
    if out["head_init"] is None:
        out["head_init"] = resolver.head_init_for(out.get("kind") or kind, train_rows)  # type: ignore[arg-type]
    if out.get("metric") is None:
        out.pop("metric", None)
    return out


def epochs_acted_on_nothing(s: dict[str, Any], train_rows: float) -> bool:
    """Whether a run's ``epochs`` changed nothing in it: ``min_steps`` set its length (its epochs came to fewer
    updates), it kept its last checkpoint, and its patience outlasted every evaluation, so the evaluations' spacing
    (the one other thing epochs sets) decided nothing. Small data, where min_steps stretches every run: such runs
    train alike whatever epochs said."""
    epochs, min_steps, batch = s.get("epochs"), s.get("min_steps"), s.get("batch_size")
    if not (epochs and min_steps and batch and math.isfinite(train_rows)) or s.get("max_steps"):
        return False
    planned = replace(RESOLVER, epochs=epochs, min_steps=min_steps, batch_size=batch, eval_every=s.get("eval_every"))
    rows = int(train_rows)
    if s.get("checkpoint") != "last" or planned.planned_steps(rows) != min_steps:
        return False
    return s.get("patience") is not None and s["patience"] >= math.ceil(min_steps / planned.eval_every_for(rows))


#: the default encoder's own dropout (all-MiniLM-L6-v2: 0.1 on its hidden states and attention), what a run with no
#: ``dropout`` set trained at
ENCODER_DROPOUT = 0.1
RESOLVER = TrainConfig(task="quality")  # resolves an unset restarts / checkpoint exactly as the trainer does


def run_shape(run: dict) -> tuple[float, float, str]:
    """(training rows, dev rows, task kind) of a recorded run: few-sample runs carve 10% of their rows as dev; the
    quality table's sets are all large."""
    kind = SET_KINDS.get(run.get("set", ""), "classification")
    if "rows" in run:
        dev = max(1, round(0.1 * run["rows"]))
        return run["rows"] - dev, dev, kind
    return float(run.get("train_rows") or math.inf), float(run.get("dev_rows") or math.inf), kind


def is_current(run: dict) -> bool:
    """A run counts towards the table only if it was trained with today's defaults for its mode (a baseline's run
    always counts: it has no settings of ours)."""
    if run["mode"] in BASELINES:
        return True
    if "settings" not in run:
        return False
    today, mine = _today_and_mine(run)
    return today == mine


def _today_and_mine(run: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Today's defaults for a run's mode and its own settings, both as they acted on it (``as_trained``). Where
    min_steps set the run's length under both and their epochs decided nothing else (``epochs_acted_on_nothing``),
    the run counts as trained at today's epochs."""
    shape = run_shape(run)
    today, mine = as_trained(default_settings(run["mode"]), *shape), as_trained(run["settings"], *shape)
    if mine.get("epochs") != today.get("epochs") and all(epochs_acted_on_nothing(s, shape[0]) for s in (mine, today)):
        mine["epochs"] = today["epochs"]
    return today, mine


def setting_changes(run: dict) -> dict[str, Any]:
    """The settings of a run that differ from today's defaults for its mode, as they acted on it (``as_trained``);
    none for a baseline's run or one recorded without settings."""
    if run["mode"] in BASELINES or "settings" not in run:
        return {}
    today, mine = _today_and_mine(run)
    return {k: v for k, v in mine.items() if today.get(k) != v}


#: opt-in settings whose runs are compared seed by seed (draw by draw) with the runs without them (``paired_lines``)
PAIRED_CANDIDATES = (
    "scales=",
    "lr=",
    "min_steps=",
    "restarts=",
    "head_init=",
    "head_lr=",
    "epochs=",
    "lora_alpha=",
    "precision=",
)
TODAY = "today's defaults"


def changes(diff: str) -> list[str]:
    """The settings a ``differences`` string names, one ``key=value`` each (a value may hold ", ": a list)."""
    return [] if diff == TODAY else re.split(r", (?=[a-z_]+=)", diff)


def paired_lines(
    groups: Mapping[tuple[Any, ...], list[dict]],
    name: Callable[..., str],
    scores: Sequence[tuple[str, str]],
    unit: str,
) -> list[str]:
    """Where an opt-in candidate (one of PAIRED_CANDIDATES: scales, a label-name head...) and
    the same settings without it (today's defaults, or the defaults with another change) ran with the same seeds
    (the same draws, on small data) on the same machine: the candidate's gain on each, paired, so what the seed
    decides cancels out. ``groups`` are keyed ``(*cell, differences, machine)``; ``name(*cell)`` names the cell;
    ``scores`` are (shown name, run field) pairs; ``unit`` is what a seed is ("seed", "draw"). A CPU run pairs only
    with one on the same CPU (``cpu``, recorded since 2026-12-03; runs recorded before pair among themselves): one
    machine group holds several CPUs, and a seed's score moves between them."""
    lines = []
    for key, grp in sorted(groups.items()):
        *cell, diff, device = key
        named = changes(diff)
        for candidate in named:
            base = ", ".join(c for c in named if c != candidate) or TODAY
            without = groups.get((*cell, base, device), [])
            if not candidate.startswith(PAIRED_CANDIDATES) or not without:
                continue
            by_seed = {_seed_on_cpu(r): r for r in without}
            ordered = sorted(grp, key=lambda r: r["seed"])
            paired = [(r, by_seed[_seed_on_cpu(r)]) for r in ordered if _seed_on_cpu(r) in by_seed]
            shown = []
            for shown_name, field in scores:
                gains = [100 * (r[field] - b[field]) for r, b in paired if field in r and field in b]
                if gains:
                    each = ", ".join(f"{g:+.1f}" for g in gains)
                    shown.append(f"{shown_name} {statistics.mean(gains):+.1f} (per {unit}: {each})")
            if shown:
                head = f"- {name(*cell)} ({device}): {candidate} against {base}, same {unit}s"
                lines.append(f"{head}: {'; '.join(shown)}")
    return ["", *lines] if lines else []


def _seed_on_cpu(run: dict) -> tuple[int, str | None]:
    """What pairs two runs of one machine group (``paired_lines``): their seed (draw), and the CPU where recorded."""
    return run["seed"], run.get("cpu")


def differences(run: dict) -> str:
    """How a run's settings differ from today's defaults for its mode ("lr=0.001, epochs=10"); for a baseline, what
    it is."""
    if run["mode"] in BASELINES:
        return BASELINES[run["mode"]]
    if "settings" not in run:
        return "unrecorded"
    return ", ".join(f"{k}={v}" for k, v in setting_changes(run).items()) or TODAY


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["lr=6e-3", "dropout=0"]`` -> ``{"lr": 0.006, "dropout": 0}``; values are JSON, else strings."""
    out: dict[str, Any] = {}
    known = {f.name for f in fields(TrainConfig)} - {"task", "seed", "device", "full"}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE with KEY one of {sorted(known)}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def add_run_arguments(ap: argparse.ArgumentParser, records: str, example: str, quick: str) -> None:
    """The arguments the benchmarks here share: the device, where data and records live, the note, candidates,
    ``--quick`` (``quick``: what it trains) and ``--render``."""
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"check that the pipeline runs here: {quick}, recorded in a temporary folder (not docs/); prints one "
        "JSON line of the scores, not comparable with the table's",
    )
    ap.add_argument("--render", action="store_true", help=f"only rewrite {records}.md and .png from --out's runs")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(ROOT / "docs"), help=f"folder of {records}-runs.jsonl and {records}.md")
    ap.add_argument("--data", default=str(DATA), help="folder of SET/{train,dev,test}.jsonl (default: %(default)s)")
    ap.add_argument(
        "--note", default="", help="how the machine was shared, recorded with each run and shown with its table"
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"train with this setting instead of the default (repeatable; e.g. --set {example}); such runs are "
        "recorded with their settings and listed apart from runs at today's defaults",
    )


def already_run(
    runs_file: Path, wanted: dict[str, Any], shape: tuple[float, float, str], device: torch.device, **key: Any
) -> bool:
    """Whether ``runs_file`` holds a run trained as ``wanted`` trains with ``shape`` (training rows, dev rows, task
    kind: ``run_shape``), on this kind of device, with these fields (set, seed..)."""
    goal, goal_arithmetic = as_trained(wanted, *shape), trained_arithmetic(wanted, device)
    return any(
        "settings" in r and as_trained(r["settings"], *shape) == goal and arithmetic(r) == goal_arithmetic
        for r in recorded(runs_file, device, **key)
    )


def arithmetic(run: dict) -> str:
    """The arithmetic a recorded run trained in (its report's ``precision``): "float32" for runs recorded before
    the field."""
    return str(run.get("precision") or "float32")


def trained_arithmetic(run_settings: dict[str, Any], device: torch.device) -> str:
    """The arithmetic a run of the default encoder with these settings trains in on ``device`` (what its report's
    ``precision`` will say): the packed model's half type where ``training_dtype`` gives one, else float32 (full
    fine-tuning trains the plain model in float32 everywhere)."""
    half = not run_settings.get("full") and training_dtype(device, run_settings.get("precision") or "auto")
    return "bfloat16" if half else "float32"


def recorded(runs_file: Path, device: torch.device, **key: Any) -> list[dict]:
    """The runs in ``runs_file`` on this kind of device with these fields (set, seed..), whatever their settings: a
    baseline's are what it chose, not what it was asked."""
    return [
        r for r in load_runs(runs_file) if device_type(r) == device.type and all(r.get(k) == v for k, v in key.items())
    ]


def record_run(
    rec: dict[str, Any], device: torch.device, note: str, runs_file: Path, rewrite: Callable[[list[dict]], None]
) -> None:
    """Add the machine (and the note) to a finished run, append it to ``runs_file``, print it, and ``rewrite`` the
    table from all recorded runs."""
    rec["device"] = device.type
    if device.type == "cuda":
        rec["device_name"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        rec["cpu"] = cpu_name()  # what pairs a candidate's runs with the defaults' (paired_lines)
        if packed_model.cpu_bfloat16_is_faster():  # a machine apart: bfloat16 products
            rec["device_name"] = CPU_BFLOAT16
    if note:
        rec["note"] = note
    with runs_file.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec), flush=True)
    rewrite(load_runs(runs_file))


def _diff(mean: dict[str, float | None], a: str, b: str) -> str:
    x, y = mean[a], mean[b]
    return f"{x - y:+.1f}" if x is not None and y is not None else "-"


def _minutes(runs: list[dict]) -> str:
    """Mean wall minutes per run; runs trained together (``joint``: n runs in one batch, ``--joint``) each count
    their batch's wall time shared out over its n runs."""
    return f"{statistics.mean(r['seconds'] / r.get('joint', 1) / 60 for r in runs):.1f}" if runs else "-"


def device_type(run: dict) -> str:
    """ "cpu" or "cuda" (older records say "cuda:0")."""
    return str(run["device"]).split(":")[0]


#: the machine name of a CPU run recorded on a CPU that multiplies bfloat16 in hardware, where the trainer's default
#: takes the packed model's products in bfloat16 (CPU runs recorded before 2026-12-01 took them in float32 everywhere)
CPU_BFLOAT16 = "bfloat16 products"


def device_of(run: dict) -> str:
    """The machine a run was measured on: device type plus the accelerator's name when recorded ("cuda: NVIDIA
    H100 80GB HBM3"), or for a CPU with bfloat16 products ``CPU_BFLOAT16``; runs on different machines are never
    averaged together."""
    kind = device_type(run)
    return f"{kind}: {run['device_name']}" if run.get("device_name") else kind


def sample(train: Dataset, size: int, seed: int) -> Dataset:
    """``size`` rows of ``train`` drawn with ``seed`` (label set kept whole, as a user's --labels would)."""
    if size >= len(train):
        raise SystemExit(f"{size} rows: {train.source} has only {len(train)} rows")
    rows = random.Random(1000 + seed).sample(train.examples, size)
    return replace(train, examples=rows, source=f"{train.source} ({size} rows, seed {seed})")


def floor_runs(runs: list[dict], device: str) -> dict[str, dict]:
    """The frozen-encoder floor's run of each set (bench/baselines.py), this machine's, else another machine's: the
    floor trains nothing on the device, so its score does not depend on it."""
    found: dict[str, dict] = {}
    for r in sorted((r for r in runs if r["mode"] == "logreg"), key=lambda r: device_of(r) != device):
        found.setdefault(r["set"], r)
    return found


def floor_cells(runs: list[dict], device: str) -> dict[str, str]:
    """The floor's table cell of each set (``floor_runs``): its score, and the machine where it is not this one."""
    return {
        ds: f"{100 * r['test']:.1f}" + ("" if device_of(r) == device else f" ({device_type(r)})")
        for ds, r in floor_runs(runs, device).items()
    }


def _set_rows(runs: list[dict], floors: dict[str, str]) -> list[str]:
    rows = []
    for ds in SETS:
        floor = floors.get(ds, "-")
        mine = [r for r in runs if r["set"] == ds and r["mode"] in MODES]
        if not mine:  # a gap stays visible
            rows.append(f"| {ds} | - | - | - | - | - | {floor} | - | - | - | 0 | - |")
            continue
        cell: dict[str, str] = {}
        mean: dict[str, float | None] = {}
        for mode in MODES:
            vals = [100 * r["test"] for r in mine if r["mode"] == mode]
            mean[mode] = statistics.mean(vals) if vals else None
            std = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cell[mode] = f"{mean[mode]:.1f} ± {std:.1f} (n={len(vals)})" if vals else "-"
        mins = {m: _minutes([r for r in mine if r["mode"] == m]) for m in MODES}
        rows.append(
            f"| {ds} | {mine[0]['metric']} | {cell['bitfit']} | {cell['bitfit-qi']} | {cell['lora']} | {cell['full']} "
            f"| {floor} | {_diff(mean, 'bitfit', 'full')} | {_diff(mean, 'bitfit-qi', 'full')} | "
            f"{_diff(mean, 'lora', 'full')} | {len(mine)} | {mins['bitfit']} / {mins['lora']} / {mins['full']} |"
        )
    return rows


def write_table(all_runs: list[dict], path: Path, command: str) -> None:
    runs = [r for r in all_runs if is_current(r)]
    total = len(SETS) * len(MODES) * 3
    lines = [
        "# Trainer quality: BitFit vs full fine-tuning of the same encoder",
        "",
        "Default encoder (all-MiniLM-L6-v2), default `patchserve train` settings; test score of the selection "
        "metric (accuracy; Spearman x100 for STS-B; token accuracy for brown_pos, whose part-of-speech tags are "
        "not BIO-style) as mean ± std over seeds; minutes per run (wall clock) on the machine named. "
        "One table per machine: runs on different machines are not averaged together. "
        f"`cpu: {CPU_BFLOAT16}` is a CPU where the packed model's default takes the frozen weights' products in "
        "bfloat16 (full fine-tuning stays float32): since 2026-12-01 one with bfloat16 instructions (AVX512-BF16 "
        "or AMX), since 2026-12-02 one where they measure faster than float32's; `cpu` runs took them in float32 "
        "(every CPU run before 2026-12-01, and any on a CPU without them or where they are slower).",
        "",
        f"Reproduce all of it with `python bench/quality.py` ({len(SETS)} sets x {len(MODES)} modes x 3 seeds; "
        "resumable: every finished run is appended to `docs/quality-runs.jsonl` and skipped next time on the same "
        "kind of device; add `--device cuda` on a GPU). One cell: `python bench/quality.py --sets trec --modes "
        "bitfit --seeds 0`. Each run is the same as `patchserve train --task SET --train DATA/SET/train.jsonl --dev "
        "DATA/SET/dev.jsonl --test DATA/SET/test.jsonl --seed N` (plus `--bias-subset query-intermediate`, "
        "`--lora-rank 8` or `--full`), DATA being the folder of evaluation sets (`--data`).",
        "",
        f"Last command: `{command}`.",
    ]
    for device in sorted({device_of(r) for r in runs}, key=lambda d: (d.startswith("cpu"), d)):
        mine = [r for r in runs if device_of(r) == device]
        notes = sorted({r["note"] for r in mine if r.get("note")})
        trained = sum(r["mode"] in MODES for r in mine)
        lines += ["", f"## {device}", "", f"Runs at today's defaults: {trained} of {total} (3 seeds per cell)."]
        lines += [f"{n}." for n in notes]
        lines += [
            "",
            "| data set | metric | BitFit (all) | BitFit (q+m2) | LoRA (r=8) | full FT | floor | BitFit - full | "
            "q+m2 - full | LoRA - full | runs | min/run (bitfit / lora / full) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *_set_rows(mine, floor_cells(runs, device)),
        ]
    lines += [
        "",
        "Target: BitFit ≥ full - 1.0 point; query+intermediate ≥ full - 3 points; LoRA ≥ full - 1.0 point on every "
        "set and ≥ full - 0.3 on Rotten Tomatoes.",
        "",
        FLOOR_NOTE,
        "",
        TIE_NOTE,
        "",
        "What each candidate below bought, and the prototypes that left no rows here, one line each: "
        "[experiments](experiments.md).",
        "",
    ]
    old = [r for r in all_runs if not is_current(r)]
    if old:
        lines += [
            "Other runs: earlier defaults and candidate settings that were tried and not adopted (defaults are "
            "chosen on the dev score, never on test), listed by how they differ from today's defaults:",
            "",
            "| data set | mode | settings that differ | test | dev | runs | min/run | device |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        groups: dict[tuple[str, str, str, str], list[dict]] = {}
        for r in old:
            groups.setdefault((r["set"], r["mode"], differences(r), device_of(r)), []).append(r)
        for key, grp in sorted(groups.items()):
            test, dev = ([100 * r[k] for r in grp] for k in ("test", "dev"))
            lines.append(
                f"| {key[0]} | {key[1]} | {key[2]} | {mean_std(test)} | "
                f"{statistics.mean(dev):.1f} | {len(grp)} | {_minutes(grp)} | {key[3]} |"
            )
        lines += [*_averaged_lines(groups), *_candidate_lines(all_runs), ""]
    path.write_text("\n".join(lines))


def write_plot(all_runs: list[dict], path: Path) -> list[str]:
    """The table's figure: a panel per machine (its title names it) with each set's test score at today's defaults
    by mode (bar: mean over seeds; error bar: std) beside the floor. Returns the panels' titles; none (and no file)
    where no run is current or matplotlib is missing."""
    runs = [r for r in all_runs if is_current(r)]
    devices = sorted({device_of(r) for r in runs if r["mode"] in MODES}, key=lambda d: (d.startswith("cpu"), d))
    plt = pyplot() if devices else None
    if plt is None:
        return []
    fig, axes = plt.subplots(len(devices), 1, figsize=(10, 3.4 * len(devices)), squeeze=False)
    titles = []
    width = 0.16
    for ax, device in zip(axes[:, 0], devices, strict=True):
        floors = floor_runs(runs, device)
        for k, mode in enumerate([*MODES, "logreg"]):
            means, stds = [], []
            for ds in SETS:
                if mode == "logreg":
                    vals = [100 * floors[ds]["test"]] if ds in floors else []
                else:
                    vals = [100 * r["test"] for r in runs if (r["set"], r["mode"], device_of(r)) == (ds, mode, device)]
                means.append(statistics.mean(vals) if vals else math.nan)
                stds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            xs = [i + (k - len(MODES) / 2) * width for i in range(len(SETS))]
            ax.bar(xs, means, width, yerr=stds, capsize=2, label=MODE_NAMES[mode])
        ax.set_xticks(range(len(SETS)), list(SETS))
        ax.set_ylim(70, 100)
        ax.set_ylabel("test score (x100)")
        title = f"{device}: today's defaults, mean ± std over seeds"
        ax.set_title(title, fontsize=10)
        titles.append(title)
    axes[0, 0].legend(ncol=4, fontsize=8, loc="upper left")
    fig.suptitle("BitFit against full fine-tuning of the same encoder (bench/quality.py)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


def last_command(table: Path, default: str) -> str:
    """The "Last command" a table already shows (so that ``--render`` keeps it), else ``default``."""
    if table.is_file():
        for line in table.read_text().splitlines():
            if "Last command: `" in line:
                return line.split("Last command: `", 1)[1].rsplit("`", 1)[0]
    return default


def render_records(
    out: Path,
    name: str,
    table: Callable[[list[dict], Path, str], None],
    plot: Callable[[list[dict], Path], object],
    command: str | None,
    runs: list[dict] | None = None,
) -> list[dict]:
    """Rewrite ``out``'s NAME.md (``table``) and NAME.png (``plot``) from ``runs`` (None: its NAME-runs.jsonl);
    ``command``: the one to show as the last (None: keep the table's own). Returns the runs."""
    runs = load_runs(out / f"{name}-runs.jsonl") if runs is None else runs
    path = out / f"{name}.md"
    table(runs, path, command or last_command(path, f"python bench/{name.replace('-', '_')}.py"))
    plot(runs, out / f"{name}.png")
    return runs


def render(out: Path, command: str | None = None, runs: list[dict] | None = None) -> list[dict]:
    """Rewrite ``out``'s quality.md and quality.png from ``runs`` or its quality-runs.jsonl (``render_records``)."""
    return render_records(out, "quality", write_table, write_plot, command, runs)


def quick_figures(runs: list[dict]) -> dict[str, Any]:
    """``--quick``'s last line: each mode's test score (x100) and minutes, BitFit minus full, and the machine."""
    score = {r["mode"]: round(100 * r["test"], 1) for r in runs}
    minutes = {r["mode"]: round(r["seconds"] / 60, 2) for r in runs}
    out: dict[str, Any] = {"set": runs[0]["set"], "train_rows": runs[0].get("train_rows")}
    out |= {"max_updates": QUICK_UPDATES, "bitfit": score.get("bitfit"), "full": score.get("full")}
    out["floor"] = score.get("logreg")
    if out["bitfit"] is not None and out["full"] is not None:
        out["bitfit_minus_full"] = round(out["bitfit"] - out["full"], 1)
    out |= {"minutes_bitfit": minutes.get("bitfit"), "minutes_full": minutes.get("full"), "device": device_of(runs[0])}
    return out


def best_restart(run: dict) -> dict:
    """The restart a run's best dev score would have kept (a tie: the first, as the trainer breaks it)."""
    return max(run["restarts"], key=lambda r: r["dev"])


def _averaged_lines(groups: dict[tuple[str, str, str, str], list[dict]]) -> list[str]:
    """For jobs that averaged their restarts into one patch (``restarts_merge=average``): the average against what
    the same job's restarts give alone, paired job by job, on dev and test -- against the restart the best dev
    score keeps (``restarts_merge=best``) and against the first restart (a run of its own at the job's seed)."""
    lines = []
    for (ds, mode, diff, device), grp in sorted(groups.items()):
        jobs = sorted((r for r in grp if "merged" in r and "restarts" in r), key=lambda r: r["seed"])
        if not jobs:
            continue
        kept = [best_restart(r) for r in jobs]
        first = [r["restarts"][0] for r in jobs]
        shown = []
        for name, alone in (("the best restart by dev", kept), ("the first restart alone", first)):
            gains = {k: [100 * (r[k] - a[k]) for r, a in zip(jobs, alone, strict=True)] for k in ("dev", "test")}
            cells = [
                f"{k} {statistics.mean(g):+.1f} (per job: {', '.join(f'{x:+.1f}' for x in g)})"
                for k, g in gains.items()
            ]
            shown.append(f"against {name}: {'; '.join(cells)}")
        lines.append(f"- {ds}, {mode} ({diff}, {device}): the restarts' average, same jobs, {'; '.join(shown)}")
    return ["", AVERAGED_NOTE, "", *lines] if lines else []


def _candidate_lines(all_runs: list[dict]) -> list[str]:
    """``paired_lines`` over every trainer run, today's defaults included: each candidate against the same seeds
    without it on the same machine, on dev and test, under a note saying what the lines are."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for r in all_runs:
        if r["mode"] in MODES and "settings" in r:
            groups.setdefault((r["set"], r["mode"], differences(r), device_of(r)), []).append(r)
    scores = (("dev", "dev"), ("test", "test"))
    lines = paired_lines(groups, lambda ds, mode: f"{ds}, {mode}", scores, "seed")
    return ["", PAIRED_NOTE, *lines] if lines else []


def mean_std(values: list[float]) -> str:
    """ "82.0 ± 0.4" (one value: no spread; none: "-"): a table cell of scores x100."""
    if not values:
        return "-"
    return f"{statistics.mean(values):.1f}" + (f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=[*MODES, "logreg"],
        choices=[*MODES, "logreg"],
        help=f"trainer modes, and logreg: the floor ({BASELINES['logreg']}; one run per set)",
    )
    quick = f"BitFit, full fine-tuning and the floor on {QUICK_ROWS:,} {QUICK_SET} training rows, {QUICK_UPDATES} "
    add_run_arguments(ap, "quality", "dropout=0", quick + "updates a run, seed 0 (2.5 minutes on 2 CPU cores)")
    ap.add_argument(
        "--joint",
        action="store_true",
        help="train each set's BitFit runs (every mode and seed asked) together in one batch, as `patchserve worker "
        "--concurrent-jobs` trains jobs: on a GPU, where an update is launch-bound, several runs cost little more "
        "than one (full fine-tuning still trains alone); recorded with joint=n, min/run shares the batch's time out",
    )
    args = ap.parse_args()
    overrides = parse_overrides(args.overrides)
    out = Path(args.out)
    if args.render:
        render(out)
        return
    if args.quick:
        args.sets, args.seeds, args.modes = [QUICK_SET], [0], ["bitfit", "full", "logreg"]
        overrides["max_steps"] = QUICK_UPDATES
        out = Path(tempfile.mkdtemp(prefix="quality-quick-"))
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "quality-runs.jsonl"
    command = "python bench/quality.py " + " ".join(sys.argv[1:])
    encoder = load_encoder("default")
    device = resolve_device(args.device)
    data = Path(args.data)

    def record(rec: dict[str, Any]) -> None:
        record_run(rec, device, args.note, runs_file, lambda runs: render(out, command, runs))

    for ds in args.sets:
        train, dev, test = (DataFile.read(data / ds / f"{split}.jsonl") for split in ("train", "dev", "test"))
        splits = load_splits(train, dev, test)  # as `patchserve train --train … --dev … --test …` reads them
        if args.quick:
            splits = replace(splits, train=sample(splits.train, QUICK_ROWS, 0))
        together: list[tuple[str, int, TrainConfig]] = []
        for mode in args.modes:
            if mode == "logreg":
                if not any(r["set"] == ds and r["mode"] == mode for r in load_runs(runs_file)):
                    t0 = time.perf_counter()
                    floor = logreg(encoder, splits.train, splits.dev, splits.test, device)
                    rec = {
                        "set": ds,
                        "mode": mode,
                        "seed": 0,
                        "metric": SELECTION_METRICS[splits.train.kind][0],  # the kind's default
                        "test": floor.test,
                        "dev": floor.dev,
                    }
                    rec |= {"train_rows": len(splits.train), "dev_rows": len(splits.dev), "settings": floor.settings}
                    rec["seconds"] = time.perf_counter() - t0
                    record(rec)
                continue
            for seed in args.seeds:
                config = TrainConfig(task=ds, seed=seed, device=str(device), **(MODES[mode] | overrides))  # type: ignore[arg-type]
                shape = (len(splits.train), len(splits.dev), splits.train.kind)
                if already_run(runs_file, settings(config), shape, device, set=ds, mode=mode, seed=seed):
                    continue
                if args.joint and not config.full and packed_unsupported(encoder.model) is None:
                    together.append((mode, seed, config))  # trained below, in one batch with the set's other runs
                    continue
                t0 = time.perf_counter()
                progress = progress_logger(prefix=f"{ds} {mode} seed={seed}: ")  # None on a terminal (a bar)
                result = train_patch(encoder, splits.train, splits.dev, config, test=splits.test, on_progress=progress)
                record(run_record(ds, mode, seed, config, result, splits, time.perf_counter() - t0))
        for mode, seed, config, result, seconds in train_jointly(encoder, splits, device, together):
            record(run_record(ds, mode, seed, config, result, splits, seconds) | {"joint": len(together)})
    if args.quick:
        print(json.dumps(quick_figures(load_runs(runs_file)) | {"records": str(out)}))


def run_record(
    ds: str, mode: str, seed: int, config: TrainConfig, result: TrainResult, splits: Splits, seconds: float
) -> dict[str, Any]:
    """What the runs file keeps of a trained run."""
    metric = result.report["metric"]
    return {
        "set": ds,
        "mode": mode,
        "seed": seed,
        "metric": metric,
        "test": result.report["test"][metric],
        "dev": result.report["dev"][metric],
        "test_metrics": result.report["test"],  # every metric of the kind (macro-F1, entity F1...)
        "train_rows": len(splits.train),
        "dev_rows": len(splits.dev),
        "steps": result.report["steps"],
        "best_step": result.report["best_step"],
        "curve": dev_curve(result.report),
        "lr": result.report["lr"],
        "precision": result.report["precision"],  # the arithmetic it trained in (bfloat16: flash attention, CUDA)
        "settings": settings(config),
        "seconds": seconds,
        "trainable_params": result.report["trainable_params"],
    } | restart_scores(result.report, metric)


def dev_curve(report: dict[str, Any]) -> list[list[float]]:
    """The kept run's dev score at each evaluation, as [step, score] pairs: what a patience or a shorter budget would
    have kept can be read off the records without training again."""
    key = f"dev_{report['metric']}"
    return [[h["step"], round(h[key], 4)] for h in report["history"] if key in h]


def restart_scores(report: dict[str, Any], metric: str) -> dict[str, Any]:
    """Where a run trained several restarts: each one's dev and test (and held-out) score, under ``restarts`` (the
    kept one is the best dev), and under ``merged`` each learning rate's average (``restarts_merge=average``), so
    a record shows what the restarts bought on the same runs."""
    if len(report["runs"]) < 2:
        return {}
    splits = [k for k in ("test", "heldout") if k in report["runs"][0]]
    out: dict[str, Any] = {
        "restarts": [
            {"seed": r["seed"], "dev": r["best_dev"][metric]} | {k: r[k][metric] for k in splits}
            for r in report["runs"]
        ]
    }
    if "merged" in report:
        out["merged"] = [{"seeds": m["seeds"]} | {k: m[k][metric] for k in ("dev", *splits)} for m in report["merged"]]
    return out


def train_jointly(
    encoder: Encoder, splits: Splits, device: torch.device, runs: list[tuple[str, int, TrainConfig]]
) -> Iterator[tuple[str, int, TrainConfig, TrainResult, float]]:
    """Train ``runs`` (mode, seed, config: BitFit runs) together, one update of each per step over one shared packed
    encoder, as ``patchserve worker --concurrent-jobs`` trains jobs. Each is yielded as it finishes, with its result
    and the seconds from the batch's start to its end."""
    if not runs:
        return
    shared = training_bert(encoder.model.to(device))
    trainings = [
        PatchTraining(
            encoder,
            splits.train,
            splits.dev,
            c,
            test=splits.test,
            packed_bert=shared,
            on_progress=progress_logger(prefix=f"{c.task} {mode} seed={seed}: "),
        )
        for mode, seed, c in runs
    ]
    by_training = {id(t): run for t, run in zip(trainings, runs, strict=True)}
    trainer = JointTrainer(trainings)
    t0 = time.perf_counter()
    while len(trainer):
        for training, error in trainer.step():
            if error is not None:
                raise error
            yield *by_training[id(training)], training.finish(), time.perf_counter() - t0


if __name__ == "__main__":
    main()
