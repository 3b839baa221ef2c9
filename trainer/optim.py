"""How a group of runs steps: each run with its own AdamW, learning rates, linear schedule and gradient clipping.

Two implementations of one interface (``RunsOptimizer``). ``BankAdamW`` steps K runs held as rows of a few
``[K, ...]`` tensors (the packed model's flat bank and heads) in a handful of tensor ops per update, whatever K and
however many bias vectors a run trains; ``TorchAdamW`` is torch's own AdamW with a LambdaLR, for a model that holds
one run (the padded one). Both follow the same arithmetic (tests check ``BankAdamW`` against ``TorchAdamW``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as the trainer always used them
EPS = 1e-8


def linear_schedule(total: int, warmup: int) -> Callable[[int], float]:
    """The learning rate's factor at each update: linear warm-up over ``warmup`` updates, then linear decay to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


class RunsOptimizer(Protocol):
    """Steps the runs of one group. Runs leave the group (early stopping) but never rejoin, so every run still in it
    has taken as many steps as the group."""

    def zero_grad(self) -> None:
        """Clear every run's gradients (before the backward that fills them)."""
        ...

    def step(self, runs: Sequence[int]) -> None:
        """Clip each of ``runs``' gradients to its norm bound, then step its AdamW at its scheduled learning rates.
        The other runs do not move."""
        ...


class TorchAdamW:
    """One run: torch's bias-corrected AdamW over ``encoder`` (at ``lr``) and ``head`` (at ``head_lr``) parameters,
    ``schedule`` applied through a LambdaLR, gradients clipped to ``max_grad_norm``."""

    def __init__(
        self,
        encoder: list[nn.Parameter],
        head: list[nn.Parameter],
        *,
        lr: float,
        head_lr: float,
        weight_decay: float,
        max_grad_norm: float,
        schedule: Callable[[int], float],
    ) -> None:
        self.params, self.max_grad_norm = encoder + head, max_grad_norm
        groups: list[dict[str, Any]] = [{"params": encoder}, {"params": head, "lr": head_lr}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=BETAS, eps=EPS)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, runs: Sequence[int]) -> None:
        assert list(runs) == [0], "TorchAdamW holds one run"
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()


class BankAdamW:
    """K runs whose parameters are the rows of ``tensors`` (each ``[K, ...]``, a run's values in row ``r``).
    ``lrs[i]`` (``[K]``) gives each run's learning rate for ``tensors[i]``; each run's gradient over all of its
    rows is clipped to ``max_grad_norm``, as ``clip_grad_norm_`` clips one run's parameters."""

    def __init__(
        self,
        tensors: Sequence[nn.Parameter],
        lrs: Sequence[torch.Tensor],
        *,
        weight_decay: float,
        max_grad_norm: float,
        schedule: Callable[[int], float],
    ) -> None:
        self.tensors = list(tensors)
        self.lrs = [lr.to(t.device, t.dtype).view(-1, *[1] * (t.dim() - 1)) for t, lr in zip(tensors, lrs, strict=True)]
        self.m = [torch.zeros_like(t) for t in tensors]
        self.v = [torch.zeros_like(t) for t in tensors]
        self.weight_decay, self.max_grad_norm, self.schedule = weight_decay, max_grad_norm, schedule
        self.steps = 0
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def zero_grad(self) -> None:
        for t in self.tensors:
            t.grad = None

    @torch.no_grad()
    def step(self, runs: Sequence[int]) -> None:
        if not runs:
            return
        key = tuple(runs)
        index = self._index.get(key)
        if index is None:  # made once per set of active runs (it changes only when a run stops early): a copy to a
            index = self._index[key] = torch.tensor(key, device=self.tensors[0].device)  # GPU waits for its queue
        grads = [torch.zeros_like(t[index]) if t.grad is None else t.grad.index_select(0, index) for t in self.tensors]
        norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads]).sum(0).sqrt()  # [R]: each run's norm
        clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_ scales
        factor = self.schedule(self.steps)
        self.steps += 1
        correction1, correction2 = 1 - BETAS[0] ** self.steps, math.sqrt(1 - BETAS[1] ** self.steps)
        for t, lrs, m, v, grad in zip(self.tensors, self.lrs, self.m, self.v, grads, strict=True):
            grad = grad * clip.view(-1, *[1] * (grad.dim() - 1))
            lr = lrs.index_select(0, index) * factor
            p = t.index_select(0, index).mul_(1 - lr * self.weight_decay)
            m_rows = m.index_select(0, index).lerp_(grad, 1 - BETAS[0])
            v_rows = v.index_select(0, index).mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
            p.sub_(lr / correction1 * m_rows / (v_rows.sqrt() / correction2 + EPS))
            t.index_copy_(0, index, p)
            m.index_copy_(0, index, m_rows)
            v.index_copy_(0, index, v_rows)
