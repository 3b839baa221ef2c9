"""The training report: what a job trained, chose and scored (``build``), and the patch it makes of the kept run
(``patch_of``); written as JSON, plus a PNG (learning curve + bias-movement heatmap) when matplotlib is there.

The heatmap shows mean |b_trained - b_base| per bias type x layer, like the BitFit paper's Figure 1, so a user
sees at a glance what the task changed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from patchserve.patches.bitfit import (
    ROLE_ORDER,
    SCALES,
    bias_parameters,
    bias_roles,
    extract_patch,
    ia3_roles,
    ia3_values,
)
from patchserve.patches.data import Dataset
from patchserve.patches.encoder import Encoder
from patchserve.patches.errors import EncoderError
from patchserve.patches.format import LORA_PATCH_TYPE, BaseRef, Patch, PatchMeta
from patchserve.patches.model import TaskModel
from patchserve.patches.validation import Label
from patchserve.trainer.selection import Plan

log = logging.getLogger(__name__)
SHOWN_RUN = ("seed", "lr", "best_dev", "best_step", "steps", "seconds")  # what the report lists of every run


@dataclass(frozen=True)
class Job:
    """What the report says of the job as a whole."""

    encoder: Encoder
    kind: str
    labels: Sequence[Label]
    pooling: str
    metric: str
    max_len: int
    train: Dataset
    dev: Dataset
    test: Dataset | None
    plan: Plan
    forward: str  # "packed" or "padded"
    seconds: float
    precision: str = "float32"  # or "bfloat16" (the packed model: flash attention on a GPU, products on a CPU)


def build(job: Job, kept: dict[str, Any], model: TaskModel, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of a job whose ``kept`` run (a ``RunGroup.results()`` entry, its scores on the scored sets under
    their names) became ``model``; ``runs``: what the report shows of every run."""
    config, encoder = job.plan.config, job.encoder
    report: dict[str, Any] = {
        "task": config.task,
        "kind": job.kind,
        "mode": "full" if config.full else "bitfit",
        "bias_subset": None if config.full else config.bias_subset,
        "scales": None if config.full else config.scales,
        "pooling": job.pooling,
        "labels": job.labels,
        "encoder": {"name": encoder.name, "fingerprint": encoder.fingerprint},
        "train_rows": len(job.train),
        "dev_rows": len(job.dev),
        "test_rows": len(job.test) if job.test else 0,
        **{k: kept[k] for k in ("lr", "head_lr", "seed", "steps", "planned_steps", "best_step", "trainable_params")},
        "total_params": sum(p.numel() for p in model.parameters()),
        "metric": job.metric,
        "dev": kept["best_dev"],
        "selection": {
            "metric": job.metric,
            "restarts": config.restarts,
            "restarts_why": job.plan.restarts_why,
            "restarts_merge": config.restarts_merge,
            "head_init": config.head_init,
            "head_init_why": job.plan.head_init_why,
            "checkpoint": config.checkpoint,
            "checkpoint_why": job.plan.checkpoint_why,
            "learning_rates": config.lr_search or [config.lr],
            "tried": len(runs),
        },
        "seconds": job.seconds,
        "forward": job.forward,
        "precision": job.precision,
        "history": kept["history"],
        "runs": runs,
        "config": asdict(config),
    }
    report |= {name: kept[name] for name in ("test", "heldout") if name in kept}
    report["bias_movement"] = bias_movement(model.encoder, encoder.model)
    if not config.full and config.scales == "ia3":
        report["scale_movement"] = scale_movement(model.encoder)
    return report


def patch_of(job: Job, report: dict[str, Any], model: TaskModel, averaged: bool) -> Patch:
    """The patch of the kept run: its biases (and scales) and head, and what it was trained with."""
    config, encoder = job.plan.config, job.encoder
    metrics = {f"dev_{k}": v for k, v in report["dev"].items()}
    metrics.update({f"test_{k}": v for k, v in report.get("test", {}).items()})
    training = {k: report[k] for k in ("lr", "seed", "steps", "train_rows", "seconds", "trainable_params", "metric")}
    training["restarts"] = config.restarts
    if averaged:
        training["restarts_merge"] = "average"
    if config.head_init == "labels":
        training["head_init"] = "labels"
    meta = PatchMeta(
        task=config.task,
        kind=job.kind,
        labels=list(job.labels) if job.kind != "regression" else [],
        base=BaseRef(encoder.name, encoder.fingerprint),
        bias_subset=config.bias_subset,
        patch_type=LORA_PATCH_TYPE if config.lora_rank else SCALES[config.scales],
        pooling=job.pooling,
        max_seq_length=job.max_len,
        text_pair=job.train.is_pair,
        metrics=metrics,
        training=training,
    )
    return extract_patch(model.encoder.cpu(), model.head.cpu(), meta)


def bias_movement(trained: nn.Module, base: nn.Module) -> dict[str, dict[str, float]]:
    """mean |b_trained - b_base| per bias role and layer (the BitFit paper's Figure 1)."""
    try:
        roles = bias_roles(base)
    except EncoderError:
        return {}
    now, then = bias_parameters(trained), bias_parameters(base)
    out: dict[str, dict[str, float]] = {}
    for name, role in roles.items():
        if name in now:
            delta = (now[name].detach().cpu().float() - then[name].detach().cpu().float()).abs().mean()
            out.setdefault(role.role, {})["-" if role.layer is None else str(role.layer)] = float(delta)
    return out


def scale_movement(trained: nn.Module) -> dict[str, dict[str, float]]:
    """mean |s - 1| of each (IA)^3 scale of a plain model (``apply_values`` set them), by its role (k, v, ff: the
    key, value and feed-forward intermediate) and layer, as ``bias_movement`` gives the biases'."""
    roles = ia3_roles(trained)
    out: dict[str, dict[str, float]] = {}
    for name, scale in ia3_values(trained).items():
        role = roles[name]
        out.setdefault(role.role, {})[str(role.layer)] = float((scale.detach().cpu().float() - 1).abs().mean())
    return out


def write_json(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    tmp.replace(path)


def write_png(path: Path, report: dict[str, Any]) -> bool:
    """Draw the report; False (and a hint) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG report (pip install 'patchserve[plot]')")
        return False
    fig, (ax_curve, ax_heat) = plt.subplots(1, 2, figsize=(13, 4.5))
    hist = report.get("history", [])
    steps = [h["step"] for h in hist]
    dev_key = next((k for k in (hist[0] if hist else {}) if k.startswith("dev_")), None)
    ax_curve.plot(steps, [h["loss"] for h in hist], color="tab:blue", label="train loss (smoothed)")
    ax_curve.set_xlabel("update step")
    ax_curve.set_ylabel("loss", color="tab:blue")
    if dev_key:
        ax_dev = ax_curve.twinx()
        ax_dev.plot(steps, [h[dev_key] for h in hist], color="tab:orange", marker="o", label=dev_key)
        ax_dev.set_ylabel(dev_key, color="tab:orange")
    ax_curve.set_title(f"{report['task']}: {report['mode']} lr={report['lr']:g} seed={report['seed']}")
    movement: dict[str, dict[str, float]] = report.get("bias_movement", {})
    roles = [r for r in ROLE_ORDER if r in movement]
    layers = sorted({k for r in roles for k in movement[r] if k != "-"}, key=int)
    if any("-" in movement[r] for r in roles):
        layers.append("-")  # biases outside the layer stack: embedding LayerNorm, pooler
    if roles and layers:
        grid = [[movement[r].get(layer, float("nan")) for layer in layers] for r in roles]
        im = ax_heat.imshow(grid, aspect="auto", cmap="Blues")
        ax_heat.set_yticks(range(len(roles)), [f"b_{r}" for r in roles])
        ax_heat.set_xticks(range(len(layers)), [x if x != "-" else "emb/pooler" for x in layers])
        ax_heat.set_xlabel("layer")
        fig.colorbar(im, ax=ax_heat, label="mean |b_trained - b_base|")
        ax_heat.set_title("how much each bias moved")
    else:
        ax_heat.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
