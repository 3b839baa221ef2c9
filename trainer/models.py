"""The model a group of runs trains: one interface (``RunModel``), two implementations.

``PackedRuns`` holds K runs of one task over the frozen encoder in one padding-free batch
(``patchserve.patches.packed_model``: each row carries its run's biases, each run keeps its own head), and models over
one shared ``training_bert`` encode their rows together. ``PaddedRun`` is one run on a padded copy of the encoder: full
fine-tuning, and encoders the packed model does not cover. The trainer never asks which of the two it holds.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from patchserve.patches.bitfit import bias_parameters, trained_names
from patchserve.patches.model import TaskModel
from patchserve.patches.packed import PackedBert
from patchserve.patches.packed_model import PackedTaskModel, joint_forward
from patchserve.patches.train_config import TrainConfig

Batch = Mapping[str, torch.Tensor]  # ``patchserve.trainer.features.collate``'s padded batch


class RunModel(Protocol):
    """The model of a group of runs: every run's trainable parameters, the logits of rows (each row of its own run),
    the runs' checkpoints, and each run as a plain TaskModel once trained."""

    kind: str
    device: torch.device

    @property
    def training(self) -> bool: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def parameters_of(self, run: int) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(encoder parameters the run trains, its head's): what its optimizer steps."""
        ...

    def logits(self, batch: Batch, run_of_row: torch.Tensor) -> torch.Tensor:
        """Each row's logits under its run's parameters (``run_of_row`` ``[B]``)."""
        ...

    def joint_key(self) -> Hashable:
        """Models with equal keys put their rows through one forward: ``forward_together``."""
        ...

    def forward_together(self, rows: Sequence[tuple[Any, Batch, torch.Tensor]]) -> list[torch.Tensor]:
        """The logits of ``(model, batch, run_of_row)`` of several models with this one's ``joint_key``, in one
        forward where the implementation has one."""
        ...

    def snapshot(self, run: int) -> Any:
        """A copy of what ``run`` trains (a checkpoint); ``restore`` puts it back."""
        ...

    def restore(self, run: int, state: Any) -> None: ...

    def task_model(self, run: int) -> TaskModel:
        """``run`` as a plain TaskModel (the encoder with its biases, and its head)."""
        ...


def set_dropout(module: nn.Module, rate: float) -> None:
    """Every dropout in ``module`` (BERT's attention reads its rate from its ``nn.Dropout`` too) drops ``rate``."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = rate


class PackedRuns:
    """K runs of one task in one ``PackedTaskModel`` over the frozen ``base`` (``packed``: a ``training_bert`` shared
    with other jobs' models, so that their rows encode together), each starting from its own head of ``heads``;
    the config's biases (and scales) train, at the config's dropout (None: the encoder's own rates)."""

    def __init__(
        self,
        base: nn.Module,
        heads: Sequence[nn.Linear],
        kind: str,
        pooling: str,
        config: TrainConfig,
        packed: PackedBert | None = None,
    ) -> None:
        cfg: Any = getattr(base, "config", None)
        self.model = PackedTaskModel(
            base,
            heads,
            kind,
            pooling,
            trained_names(base, config.bias_subset, config.scales),
            hidden_dropout=config.dropout if config.dropout is not None else float(cfg.hidden_dropout_prob),
            attention_dropout=config.dropout if config.dropout is not None else float(cfg.attention_probs_dropout_prob),
            packed=packed,
        )
        self.kind, self.dropout = kind, config.dropout
        self.device = self.model.packed.device

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> PackedRuns:
        self.model.train(mode)
        return self

    def eval(self) -> PackedRuns:
        return self.train(False)

    def parameters_of(self, run: int) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return self.model.run_parameters(run)

    def logits(self, batch: Batch, run_of_row: torch.Tensor) -> torch.Tensor:
        return self.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], run=run_of_row)

    def joint_key(self) -> Hashable:
        return self.model.joint_key()

    def forward_together(self, rows: Sequence[tuple[Any, Batch, torch.Tensor]]) -> list[torch.Tensor]:
        return joint_forward(
            [(m.model, b["input_ids"], b["attention_mask"], b["token_type_ids"], run) for m, b, run in rows]
        )

    def snapshot(self, run: int) -> list[torch.Tensor]:
        encoder, head = self.parameters_of(run)
        return [p.detach().clone() for p in [*encoder, *head]]

    @torch.no_grad()
    def restore(self, run: int, state: list[torch.Tensor]) -> None:
        encoder, head = self.parameters_of(run)
        for p, saved in zip([*encoder, *head], state, strict=True):
            p.copy_(saved)

    def task_model(self, run: int) -> TaskModel:
        model = self.model.task_model(run)
        if self.dropout is not None:
            set_dropout(model.encoder, self.dropout)  # the rate it trained with, as the padded model has it
        return model


class PaddedRun:
    """One run on a padded copy of ``encoder`` with ``head`` on ``device``: the config's biases train (every weight
    with ``full``), at the config's dropout (None: the encoder's own)."""

    def __init__(
        self, encoder: nn.Module, head: nn.Linear, kind: str, pooling: str, config: TrainConfig, device: torch.device
    ) -> None:
        self.model = TaskModel(copy.deepcopy(encoder), head, kind, pooling).to(device)
        if config.dropout is not None:
            set_dropout(self.model.encoder, config.dropout)
        self.kind, self.device = kind, device
        self.model.requires_grad_(False)
        if config.full:
            trained = list(self.model.encoder.parameters())
        else:
            params = bias_parameters(self.model.encoder)
            trained = [params[n] for n in trained_names(self.model.encoder, config.bias_subset, config.scales)]
        self._params = (trained, list(self.model.head.parameters()))
        for p in [*trained, *self._params[1]]:
            p.requires_grad_(True)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> PaddedRun:
        self.model.train(mode)
        return self

    def eval(self) -> PaddedRun:
        return self.train(False)

    def parameters_of(self, run: int) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        assert run == 0, "a padded model holds one run"
        return self._params

    def logits(self, batch: Batch, run_of_row: torch.Tensor) -> torch.Tensor:
        return self.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])

    def joint_key(self) -> Hashable:
        return ("padded", id(self))  # its own forward: a padded model shares none

    def forward_together(self, rows: Sequence[tuple[Any, Batch, torch.Tensor]]) -> list[torch.Tensor]:
        return [m.logits(b, run) for m, b, run in rows]

    def snapshot(self, run: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def restore(self, run: int, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def task_model(self, run: int) -> TaskModel:
        return self.model
