"""BankAdamW steps K runs held as rows of shared tensors exactly as torch's AdamW steps each run alone."""

from __future__ import annotations

import torch
from torch import nn

from patchserve.trainer.optim import BankAdamW, TorchAdamW, linear_schedule


def test_bank_adamw_steps_each_run_as_torch_adamw_steps_it_alone():
    """3 runs (own learning rates, head rates, clipping that bites for some runs and not others), one leaving the
    group after 4 updates: every run's values after 12 updates equal torch's AdamW + LambdaLR + clip_grad_norm_ on
    that run alone, to float32 rounding."""
    g = torch.Generator().manual_seed(0)
    k, width, classes, hidden = 3, 40, 3, 8
    lrs, head_lrs = [1e-2, 3e-3, 5e-2], [1e-3, 3e-3, 5e-2]
    bank = nn.Parameter(torch.randn(k, width, generator=g))
    head_w = nn.Parameter(torch.randn(k, classes, hidden, generator=g))
    head_b = nn.Parameter(torch.randn(k, classes, generator=g))
    alone = [
        [nn.Parameter(t[r].detach().clone()) for t in (bank, head_w, head_b)] for r in range(k)
    ]  # each run's own copy
    schedule = linear_schedule(12, 3)
    together = BankAdamW(
        [bank, head_w, head_b],
        [torch.tensor(lrs), torch.tensor(head_lrs), torch.tensor(head_lrs)],
        weight_decay=0.01,
        max_grad_norm=1.0,
        schedule=schedule,
    )
    singles = [
        TorchAdamW(p[:1], p[1:], lr=lr, head_lr=hl, weight_decay=0.01, max_grad_norm=1.0, schedule=schedule)
        for p, lr, hl in zip(alone, lrs, head_lrs, strict=True)
    ]
    for step in range(12):
        active = [0, 1, 2] if step < 4 else [0, 2]  # run 1 stopped early
        together.zero_grad()
        scale = torch.tensor([0.1, 5.0, 1.0])  # run 1's gradients are clipped, run 0's are not
        grads = [
            torch.randn(t.shape, generator=g) * scale.view(-1, *[1] * (t.dim() - 1)) for t in (bank, head_w, head_b)
        ]
        for t, grad in zip((bank, head_w, head_b), grads, strict=True):
            t.grad = grad.clone()
        together.step(active)
        for r in active:
            singles[r].zero_grad()
            for p, grad in zip(alone[r], grads, strict=True):
                p.grad = grad[r].clone()
            singles[r].step([0])
    for r in range(k):
        for t, p in zip((bank, head_w, head_b), alone[r], strict=True):
            torch.testing.assert_close(t[r].detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=f"run {r}")
    assert not torch.equal(bank[1], bank[0])
