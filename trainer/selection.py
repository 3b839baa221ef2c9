"""What a job trains and keeps: the settings its data decides (restarts, checkpoint, head start), and which of its
runs becomes the patch -- the best on dev, or the average of its restarts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from patchserve.patches.train_config import SMALL_DATA_ROWS, SMALL_DEV_ROWS, TrainConfig


@dataclass(frozen=True)
class Plan:
    """The settings a job's data decided, each with the reason the report gives for it."""

    config: TrainConfig  # resolved: the mode's defaults and the choices below filled in
    restarts_why: str
    checkpoint_why: str
    head_init_why: str

    @property
    def specs(self) -> list[tuple[float, int]]:
        """(learning rate, seed) of every run: each learning rate's restarts, in order."""
        c = self.config
        assert c.lr is not None and c.restarts is not None
        return [(lr, c.seed + r) for lr in (c.lr_search or [c.lr]) for r in range(c.restarts)]


def plan(config: TrainConfig, kind: str, train_rows: int, dev_rows: int) -> Plan:
    """``config`` resolved for a task of ``kind`` on these row counts, with why each automatic choice fell as it did."""
    restarts = config.restarts_for(train_rows)
    merge = config.restarts_merge_for(train_rows)
    restarts_why = (
        f"set: restarts={restarts}"
        if config.restarts is not None
        else f"automatic: {train_rows} training rows are {'under' if restarts > 1 else 'at least'} "
        f"{SMALL_DATA_ROWS}, so {restarts} seed(s)"
    )
    if restarts > 1:
        restarts_why += f", {'averaged into one patch' if merge == 'average' else 'the best dev score kept'}"
    checkpoint = config.checkpoint_for(dev_rows)
    checkpoint_why = (
        f"set: checkpoint={checkpoint}"
        if config.checkpoint is not None
        else f"automatic: a dev set of {dev_rows} rows "
        + (
            f"(under {SMALL_DEV_ROWS}) cannot rank checkpoints, so the last one is kept"
            if checkpoint == "last"
            else "ranks checkpoints, so the best one is kept"
        )
    )
    head_init, head_init_why = config.head_init_why(kind, train_rows)
    resolved = replace(
        config.resolved(),
        restarts=restarts,
        checkpoint=checkpoint,
        restarts_merge=merge,
        head_init=head_init,
        dropout=config.dropout_for(train_rows),
        min_steps=config.min_steps_for(train_rows),
    )
    return Plan(resolved, restarts_why, checkpoint_why, head_init_why)


def best(candidates: Sequence[dict[str, Any]], metric: str) -> int:
    """The index of the candidate with the best dev score of ``metric`` (a tie: the earlier one, i.e. the seed or
    learning rate asked for)."""
    return max(range(len(candidates)), key=lambda i: candidates[i]["best_dev"][metric])


@torch.no_grad()
def average_restarts(runs: Sequence[dict[str, Any]], restarts: int) -> list[int]:
    """Average each learning rate's ``restarts`` runs (ordered learning rate first, then seed) into its first run's
    parameters, which they overwrite; the indices of those first runs."""
    firsts = list(range(0, len(runs), restarts))
    for first in firsts:
        group = runs[first : first + restarts]
        for kept, *others in zip(*(r["params"] for r in group), strict=True):
            kept.copy_(torch.stack([kept, *others]).mean(0))
    return firsts
