"""The training report: JSON always, plus a PNG (learning curve + bias-movement heatmap) when matplotlib is there.

The heatmap shows mean |b_trained - b_base| per bias type x layer, like the BitFit paper's Figure 1, so a user
sees at a glance what the task changed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from patches.bitfit import ROLE_ORDER

log = logging.getLogger(__name__)


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
