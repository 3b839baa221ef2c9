"""Several jobs training together, one update of each per step (``JointTrainer``), over the run groups they are in."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from patchserve.trainer.progress import TrainingStopped
from patchserve.trainer.runs import RunGroup, Update

if TYPE_CHECKING:
    from patchserve.trainer.train import PatchTraining


class JointTrainer:
    """Trains several jobs together, one update of each per ``step()``.

    Run groups whose models share a ``joint_key()`` (packed runs over one ``training_bert``, at one dropout) put their
    rows through one forward; the rest run their own. One backward then gives every run its own gradients: a row
    touches only its own run's parameters. Each job keeps its own steps, optimizers, schedule, early stopping,
    progress and stop: a job that finishes, fails or is stopped leaves at the end of a step without disturbing the
    others, and a job added between steps joins at the next one."""

    def __init__(self, trainings: Sequence[PatchTraining] = ()) -> None:
        self.trainings: list[PatchTraining] = list(trainings)

    def add(self, training: PatchTraining) -> None:
        self.trainings.append(training)

    def __len__(self) -> int:
        return len(self.trainings)

    def step(self) -> list[tuple[PatchTraining, Exception | None]]:
        """One update of every job; returns the jobs that left, each with None (every run trained: call
        ``finish()``) or what ended it (TrainingStopped when its ``should_stop`` said so, or the error)."""
        ended: dict[int, tuple[PatchTraining, Exception | None]] = {}
        live: list[tuple[int, RunGroup, Update]] = []
        for i, t in enumerate(self.trainings):
            try:
                current = t.run_group()
                if current is None:
                    ended[i] = (t, None)
                    continue
                if t.should_stop():
                    raise TrainingStopped(current.step, current.total)
                live.append((i, current, current.next_update()))
            except Exception as exc:
                ended[i] = (t, exc)
        together: dict[Hashable, list[tuple[int, RunGroup, Update]]] = {}
        for item in live:
            together.setdefault(item[1].model.joint_key(), []).append(item)
        losses: dict[int, list[torch.Tensor]] = {}
        for items in together.values():
            try:
                rows = [(group.model, u.batch, u.run_of_row) for _, group, u in items]
                outputs = items[0][1].model.forward_together(rows)
            except Exception as exc:  # a shared forward: every job in it fails alike
                ended.update({i: (self.trainings[i], exc) for i, _, _ in items})
                continue
            for (i, group, u), logits in zip(items, outputs, strict=True):
                try:
                    losses[i] = group.losses(logits, u)
                except Exception as exc:
                    ended[i] = (self.trainings[i], exc)
        if losses:
            flat = [loss for job_losses in losses.values() for loss in job_losses]
            try:
                (flat[0] if len(flat) == 1 else torch.stack(flat).sum()).backward()  # each run's own gradient
            except Exception as exc:
                ended.update({i: (self.trainings[i], exc) for i in losses})
        for i, group, u in live:
            if i in ended:
                continue
            try:
                group.apply(u, losses[i])
            except Exception as exc:
                ended[i] = (self.trainings[i], exc)
        for t, error in ended.values():
            if error is not None:
                t.close()
        self.trainings = [t for i, t in enumerate(self.trainings) if i not in ended]
        return list(ended.values())
