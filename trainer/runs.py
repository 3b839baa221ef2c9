"""A group of runs of one task that train together, an update at a time (``RunGroup``): each run with its own
optimizer, schedule, early stopping and kept checkpoint, on a shared ``RunModel``.

Follows the few-sample practices of Zhang et al. (ICLR 2021): bias-corrected AdamW, linear warm-up then linear
decay, gradient clipping, dev evaluation with early stopping and the best checkpoint kept (a tie goes to the later
checkpoint) -- or on a dev set too small to rank checkpoints, the last one.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from patchserve.patches.train_config import TrainConfig
from patchserve.patches.validation import Label
from patchserve.trainer.evaluation import evaluate_runs
from patchserve.trainer.features import IGNORE, Features, collate
from patchserve.trainer.models import RunModel
from patchserve.trainer.optim import linear_schedule
from patchserve.trainer.progress import ProgressFn, StopFn, TrainingStopped, progress_bar


@dataclass(frozen=True)
class TrainingContext:
    """What a job's run groups need of the job: its rows, its task, and how it reports and stops."""

    task: str
    kind: str
    labels: Sequence[Label]
    metric: str  # the dev metric that ranks checkpoints
    train: list[Features]
    dev: list[Features]
    pad_id: int
    checkpoint: str  # "best" or "last"
    on_progress: ProgressFn | None
    progress_every_s: float
    should_stop: StopFn


def loss_fn(kind: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of a task of ``kind``: mean squared error for regression, else cross-entropy (tagging:
    over the scored tokens)."""
    if kind == "regression":
        return nn.functional.mse_loss(logits.squeeze(-1), labels)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


@dataclass
class Run:
    """One training run's own state (its parameters live in the group's model)."""

    index: int
    seed: int
    lr: float
    head_lr: float
    params: list[torch.Tensor]  # what it trains (views into the group's model)
    rng: random.Random
    order: list[int] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=lambda: {"score": -math.inf, "step": 0, "metrics": {}, "state": None})
    history: list[dict[str, float]] = field(default_factory=list)
    bad_evals: int = 0
    running: torch.Tensor | float = 0.0  # the loss's moving average, on the device (read back when reported)
    last_dev: dict[str, float] | None = None
    last_eval: int = 0
    steps: int = 0
    seconds: float = 0.0
    active: bool = True


@dataclass
class Update:
    """One update's rows of a run group: the runs in it, each run's span of rows, the padded batch, each row's run."""

    active: list[Run]
    spans: list[tuple[int, int]]
    batch: dict[str, torch.Tensor]
    run_of_row: torch.Tensor


class RunGroup:
    """Runs ``specs`` ((learning rate, seed) each) of one job on ``model`` (its run ``i`` is ``specs[i]``), an update
    at a time. Each run keeps its best dev checkpoint -- or with ``checkpoint="last"`` its final one -- which
    ``results()`` puts back in the model. ``config`` is resolved (``TrainConfig.resolved()``)."""

    def __init__(self, ctx: TrainingContext, config: TrainConfig, specs: Sequence[tuple[float, int]], model: RunModel):
        assert config.epochs is not None and config.patience is not None, "pass config.resolved()"
        self.ctx, self.config, self.model = ctx, config, model
        self.total = total = config.planned_steps(len(ctx.train))
        head_lrs = [config.head_lr or lr for lr, _ in specs]
        self.runs = [
            Run(i, seed, lr, head_lr, model.parameters_of(i), random.Random(seed))
            for i, ((lr, seed), head_lr) in enumerate(zip(specs, head_lrs, strict=True))
        ]
        schedule = linear_schedule(total, int(config.warmup_ratio * total))
        self.optimizer = model.optimizer([lr for lr, _ in specs], head_lrs, config, schedule)
        self.eval_every = config.eval_every_for(len(ctx.train))
        one = f"seed={specs[0][1]} lr={specs[0][0]:g}"
        self.bar = progress_bar(total, f"{ctx.task} {len(specs)} runs" if len(specs) > 1 else f"{ctx.task} {one}")
        self.model.train()
        self.step = 0
        self.t0 = self.last_report = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.step >= self.total or not any(r.active for r in self.runs)

    def next_update(self) -> Update:
        """The rows of the next update: a batch from each active run's own shuffled order."""
        rows: list[int] = []
        spans = []
        active = [r for r in self.runs if r.active]
        for r in active:
            if not r.order:
                r.order = list(range(len(self.ctx.train)))
                r.rng.shuffle(r.order)
            idx, r.order = r.order[: self.config.batch_size], r.order[self.config.batch_size :]
            spans.append((len(rows), len(rows) + len(idx)))
            rows += idx
        batch = collate([self.ctx.train[i] for i in rows], self.ctx.pad_id, self.ctx.kind, self.model.device)
        run_of_row = torch.tensor([r.index for r, (a, b) in zip(active, spans, strict=True) for _ in range(b - a)])
        return Update(active, spans, batch, run_of_row)

    def losses(self, logits: torch.Tensor, u: Update) -> list[torch.Tensor]:
        """Each active run's loss on its own rows; clears the runs' gradients for the backward to come."""
        self.optimizer.zero_grad()
        labels = u.batch["labels"]
        return [loss_fn(self.ctx.kind, logits[a:b], labels[a:b]) for a, b in u.spans]

    def apply(self, u: Update, losses: list[torch.Tensor]) -> None:
        """After the backward: step each run's optimizer, evaluate on dev when due (early stopping: a run whose
        patience ran out leaves the batch), report progress. A stop asked during the evaluation raises
        TrainingStopped."""
        step = self.step = self.step + 1
        self.optimizer.step([r.index for r in u.active])
        for r, loss in zip(u.active, losses, strict=True):  # on the device: no update waits for the one before
            value = loss.detach()
            r.running = 0.9 * r.running + 0.1 * value if step > 1 else value
            r.steps = step
        self.bar.update(1)
        evaluated = step % self.eval_every == 0 or step == self.total
        if evaluated:
            self._evaluate(u.active)
        lead = max(self.runs, key=lambda r: r.best["score"])  # a tie: the earlier run
        if evaluated:
            self.bar.set_postfix(loss=f"{float(lead.running):.4f}", dev=f"{lead.best['score']:.4f}", runs=len(u.active))
        # Reported at every evaluation and on a timer in between: the worker's lease heartbeat rides on this.
        on_progress, due = self.ctx.on_progress, time.perf_counter() - self.last_report >= self.ctx.progress_every_s
        if on_progress is not None and (evaluated or due):
            self.last_report = time.perf_counter()
            on_progress(
                {
                    "step": step,
                    "total_steps": self.total,
                    "loss": float(lead.running),
                    "dev": lead.last_dev,
                    "seed": lead.seed,
                    "lr": lead.lr,
                    "runs": len(self.runs),
                    "active_runs": sum(r.active for r in self.runs),
                }
            )

    def _evaluate(self, active: list[Run]) -> None:
        """Score the active runs on dev: keep each one's checkpoint when it is the best so far, and stop the runs
        whose patience ran out."""
        ctx, step = self.ctx, self.step
        try:
            runs = [r.index for r in active]
            scores = evaluate_runs(self.model, ctx.dev, ctx.pad_id, ctx.labels, runs, should_stop=ctx.should_stop)
        except TrainingStopped:
            raise TrainingStopped(step, self.total) from None
        for r, metrics in zip(active, scores, strict=True):
            r.last_dev, score = metrics, metrics[ctx.metric]
            r.history.append({"step": step, "loss": float(r.running), f"dev_{ctx.metric}": score})
            # A tie goes to the later checkpoint: on a small dev set ties are common, and of two checkpoints the dev
            # set cannot tell apart, the one trained longer is the better bet. Only a strict gain resets patience.
            r.bad_evals = 0 if score > r.best["score"] else r.bad_evals + 1
            if score >= r.best["score"]:
                state = None if ctx.checkpoint == "last" else self.model.snapshot(r.index)
                r.best = {"score": score, "step": step, "metrics": metrics, "state": state}
            r.last_eval = step
            if r.bad_evals >= self.config.patience:  # type: ignore[operator]  # early stopping: it leaves the batch
                r.active = False
                r.seconds = time.perf_counter() - self.t0

    def close(self) -> None:
        """Release the progress bar (a training that ends without finishing)."""
        self.bar.close()

    def results(self) -> list[dict[str, Any]]:
        """Each run's history (``"run"``: its index in the model), its kept checkpoint restored."""
        self.bar.close()
        results = []
        for r in self.runs:
            if r.active:
                r.seconds = time.perf_counter() - self.t0
            if self.ctx.checkpoint == "best":
                self.model.restore(r.index, r.best["state"])  # best-checkpoint restore
                kept_dev, kept_step = r.best["metrics"], r.best["step"]
            else:  # the run always ends on an evaluation (the last update, or the one that exhausted the patience)
                assert r.last_dev is not None
                kept_dev, kept_step = r.last_dev, r.last_eval
            results.append(
                {
                    "run": r.index,
                    "seed": r.seed,
                    "lr": r.lr,
                    "head_lr": r.head_lr,
                    "best_dev": kept_dev,
                    "best_step": kept_step,
                    "steps": r.steps,
                    "planned_steps": self.total,
                    "seconds": r.seconds,
                    "history": r.history,
                    "trainable_params": sum(p.numel() for p in r.params),
                    "params": r.params,  # the kept checkpoint's trained parameters (for averaging)
                }
            )
        self.model.eval()
        return results
