"""The model a group of runs trains: one interface (``RunModel``), two implementations.

``PackedRuns`` holds K runs of one task over the frozen encoder in one padding-free batch
(``patchserve.patches.packed_model``: each row carries its run's biases, each run keeps its own head), and models over
one shared ``training_bert`` encode their rows together. ``PaddedRun`` is one run on a padded copy of the encoder: full
fine-tuning, and encoders the packed model does not cover. The trainer never asks which of the two it holds.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from patchserve.patches.bitfit import bias_parameters, trained_names
from patchserve.patches.lora import LoraSpec, targets_of
from patchserve.patches.model import TaskModel
from patchserve.patches.packed import PackedBert
from patchserve.patches.packed_model import PackedTaskModel, joint_forward, training_dtype
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer.optim import BankAdamW, RunsOptimizer, TorchAdamW

Batch = Mapping[str, torch.Tensor]  # ``patchserve.trainer.features.collate``'s padded batch


class RunModel(ABC):
    """The model of a group of runs (``model``, an ``nn.Module`` on ``device``): every run's trainable parameters,
    the logits of rows (each row of its own run), the runs' checkpoints, and each run as a plain TaskModel once
    trained."""

    model: nn.Module
    kind: str
    device: torch.device

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> RunModel:
        self.model.train(mode)
        return self

    def eval(self) -> RunModel:
        return self.train(False)

    @abstractmethod
    def parameters_of(self, run: int) -> list[torch.Tensor]:
        """What ``run`` trains (its encoder values and its head; views into shared tensors where runs share them)."""

    @abstractmethod
    def optimizer(
        self, lrs: Sequence[float], head_lrs: Sequence[float], config: TrainConfig, schedule: Callable[[int], float]
    ) -> RunsOptimizer:
        """AdamW for every run of this model: run ``r`` at ``lrs[r]`` (its head at ``head_lrs[r]``) times
        ``schedule``, with the config's weight decay and gradient clipping."""

    @abstractmethod
    def logits(self, batch: Batch, run_of_row: torch.Tensor) -> torch.Tensor:
        """Each row's logits under its run's parameters (``run_of_row`` ``[B]``)."""

    @abstractmethod
    def joint_key(self) -> Hashable:
        """Models with equal keys put their rows through one forward: ``forward_together``."""

    @abstractmethod
    def forward_together(self, rows: Sequence[tuple[Any, Batch, torch.Tensor]]) -> list[torch.Tensor]:
        """The logits of ``(model, batch, run_of_row)`` of several models with this one's ``joint_key``, in one
        forward where the implementation has one."""

    @abstractmethod
    def snapshot(self, run: int) -> Any:
        """A copy of what ``run`` trains (a checkpoint); ``restore`` puts it back."""

    @abstractmethod
    def restore(self, run: int, state: Any) -> None: ...

    @abstractmethod
    def task_model(self, run: int) -> TaskModel:
        """``run`` as a plain TaskModel (the encoder with its biases, and its head)."""


def _lengths(batch: Batch) -> list[int] | None:
    """Each row's real token count where ``collate`` left it on the host (``lengths``), else None."""
    lengths = batch.get("lengths")
    return None if lengths is None else lengths.tolist()


def lora_spec(encoder: nn.Module, config: TrainConfig) -> LoraSpec | None:
    """The LoRA a config trains on ``encoder`` (None: none)."""
    if not config.lora_rank:
        return None
    return LoraSpec(tuple(targets_of(encoder, list(config.lora_targets))), config.lora_rank, config.lora_alpha)


def set_dropout(module: nn.Module, rate: float) -> None:
    """Every dropout in ``module`` (BERT's attention reads its rate from its ``nn.Dropout`` too) drops ``rate``."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = rate


class PackedRuns(RunModel):
    """K runs of one task in one ``PackedTaskModel`` over the frozen ``base`` (``packed``: a ``training_bert`` shared
    with other jobs' models, so that their rows encode together), each starting from its own head of ``heads`` (and
    LoRA factors of ``lora_start``); the config's biases (and scales, or LoRA) train, at the config's dropout (None:
    the encoder's own rates)."""

    model: PackedTaskModel

    def __init__(
        self,
        base: nn.Module,
        heads: Sequence[nn.Linear],
        kind: str,
        pooling: str,
        config: TrainConfig,
        packed: PackedBert | None = None,
        lora_start: Sequence[dict[str, torch.Tensor]] = (),
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
            half_dtype=training_dtype(next(base.parameters()).device, config.precision),
            lora=lora_spec(base, config),
            lora_start=lora_start,
        )
        self.kind, self.dropout = kind, config.dropout
        self.device = self.model.packed.device

    def parameters_of(self, run: int) -> list[torch.Tensor]:
        return [self.model.bank[run], self.model.head_weight[run], self.model.head_bias[run]]

    def optimizer(
        self, lrs: Sequence[float], head_lrs: Sequence[float], config: TrainConfig, schedule: Callable[[int], float]
    ) -> RunsOptimizer:
        m = self.model
        run_lrs, run_head_lrs = torch.tensor(list(lrs)), torch.tensor(list(head_lrs))
        return BankAdamW(
            [m.bank, m.head_weight, m.head_bias],
            [run_lrs, run_head_lrs, run_head_lrs],
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            schedule=schedule,
        )

    def logits(self, batch: Batch, run_of_row: torch.Tensor) -> torch.Tensor:
        return self.model(
            batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], run_of_row, _lengths(batch)
        )

    def joint_key(self) -> Hashable:
        return self.model.joint_key()

    def forward_together(self, rows: Sequence[tuple[Any, Batch, torch.Tensor]]) -> list[torch.Tensor]:
        return joint_forward(
            [
                (m.model, b["input_ids"], b["attention_mask"], b["token_type_ids"], run, _lengths(b))
                for m, b, run in rows
            ]
        )

    def snapshot(self, run: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters_of(run)]

    @torch.no_grad()
    def restore(self, run: int, state: list[torch.Tensor]) -> None:
        for p, saved in zip(self.parameters_of(run), state, strict=True):
            p.copy_(saved)

    def task_model(self, run: int) -> TaskModel:
        model = self.model.task_model(run)
        if self.dropout is not None:
            set_dropout(model.encoder, self.dropout)  # the rate it trained with, as the padded model has it
        return model


class PaddedRun(RunModel):
    """One run on a padded copy of ``encoder`` with ``head`` on ``device``: the config's biases train (every weight
    with ``full``), at the config's dropout (None: the encoder's own)."""

    model: TaskModel

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

    def parameters_of(self, run: int) -> list[torch.Tensor]:
        assert run == 0, "a padded model holds one run"
        return [*self._params[0], *self._params[1]]

    def optimizer(
        self, lrs: Sequence[float], head_lrs: Sequence[float], config: TrainConfig, schedule: Callable[[int], float]
    ) -> RunsOptimizer:
        (lr,), (head_lr,) = lrs, head_lrs
        encoder, head = self._params
        return TorchAdamW(
            encoder,
            head,
            lr=lr,
            head_lr=head_lr,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            schedule=schedule,
        )

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
