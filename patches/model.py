"""The reference task model: a plain HF encoder + pooling + a linear head.

The trainer optimises this module; tests and ``patchserve eval`` use it as the ground truth the server's batched
engine must reproduce row by row.
"""

from __future__ import annotations

import torch
from torch import nn

from patchserve.patches.bitfit import apply_values, head_module
from patchserve.patches.format import Patch


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average of the non-padding token states. hidden [B, T, H], mask [B, T] -> [B, H]."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def pool(
    pooling: str, hidden: torch.Tensor, attention_mask: torch.Tensor, pooler_output: torch.Tensor | None
) -> torch.Tensor:
    """One vector per row: ``mean`` of token states, ``cls`` (first token) or the encoder's ``pooler`` output."""
    if pooling == "mean":
        return mean_pool(hidden, attention_mask)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "pooler":
        if pooler_output is None:
            raise ValueError("pooling 'pooler' needs an encoder with a pooler layer; use 'cls' or 'mean'")
        return pooler_output
    raise ValueError(f"unknown pooling {pooling!r}")


class TaskModel(nn.Module):
    """Encoder + pooling + head. ``forward`` returns logits ``[B, n_out]`` (or ``[B, T, n_out]`` for tagging)."""

    def __init__(self, encoder: nn.Module, head: nn.Linear, kind: str, pooling: str) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.kind = kind
        self.pooling = pooling

    @classmethod
    def from_patch(cls, encoder: nn.Module, patch: Patch) -> TaskModel:
        """Apply a patch's biases (and scales) to ``encoder`` (in place) and attach its head."""
        apply_values(encoder, patch.values)
        head = head_module(patch).to(next(encoder.parameters()).device)
        return cls(encoder, head, patch.meta.kind, patch.meta.pooling)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state  # [B, T, H]
        if self.kind == "token-classification":
            return self.head(hidden)  # [B, T, n_out]
        pooled = pool(self.pooling, hidden, attention_mask, getattr(out, "pooler_output", None))
        return self.head(pooled)  # [B, n_out]
