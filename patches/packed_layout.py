"""A packed batch on the host: one flat int32 array (tokens, positions, slots, rows, offsets, pooling modes) filled
in one pass and sent to the device in one copy (``fill_layout``), then viewed as a ``PackedBatch`` there
(``batch_views``); what the exact attention path adds to a batch (``exact_attention``: its rows grouped by length
on the CPU, padded to the longest elsewhere); and ``to_device``, the copy of a host tensor that does not wait for the
device."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from patchserve.patches.packed import PackedBatch
from patchserve.patches.packed_attention import attention_groups


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``. To a CUDA device through pinned memory without blocking: a plain copy from
    pageable memory waits for every kernel already queued, so a training loop that copied its next batch that way
    would leave the GPU idle while it prepares each step. Torch's pinned-memory cache keeps the host block until the
    copy is done."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class RowArrays(Protocol):
    """Rows as flat arrays (``patchserve.server.engine.rows.RowBlock`` is one): row ``i``'s token ids and types are
    ``tokens[starts[i]:starts[i + 1]]`` and ``types[...]``."""

    tokens: np.ndarray
    types: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray


def layout_size(n_tokens: int, n_rows: int) -> int:
    """Length of the flat int32 layout ``[ids | types | pos | tok_slot | seg] x N, cu [R + 1], row_slot, row_mode``."""
    return 5 * n_tokens + 3 * n_rows + 1


def fill_layout(
    out: np.ndarray,
    rows: RowArrays,
    row_slots: np.ndarray,
    row_modes: np.ndarray,
    n_tokens: int,
    n_rows: int,
    fill_slot: int,
) -> int:
    """Write a batch of ``rows`` into ``out`` (int32, at least ``layout_size``) for an N-token, R-row layout;
    padding tokens and rows get ``fill_slot`` and no row. Returns the number of real tokens."""
    lengths, starts = rows.lengths, rows.starts
    real, b = int(starts[-1]), len(lengths)
    if real > n_tokens or b > n_rows:
        raise ValueError(f"{real} tokens in {b} rows do not fit a layout of {n_tokens} tokens, {n_rows} rows")
    n = n_tokens
    out[: layout_size(n, n_rows)] = 0
    out[0:real] = rows.tokens
    out[n : n + real] = rows.types
    out[2 * n : 2 * n + real] = np.arange(real) - np.repeat(starts[:-1], lengths)
    out[3 * n : 3 * n + real] = np.repeat(row_slots, lengths)
    out[3 * n + real : 4 * n] = fill_slot
    out[4 * n : 4 * n + real] = np.repeat(np.arange(b, dtype=np.int32), lengths)
    out[4 * n + real : 5 * n] = n_rows  # no row
    cu = 5 * n
    out[cu : cu + b + 1] = starts
    out[cu + b + 1 : cu + n_rows + 1] = real
    out[cu + n_rows + 1 : cu + n_rows + 1 + b] = row_slots
    out[cu + n_rows + 1 + b : cu + 2 * n_rows + 1] = fill_slot
    out[cu + 2 * n_rows + 1 : cu + 2 * n_rows + 1 + b] = row_modes
    return real


def batch_views(flat: torch.Tensor, n_tokens: int, n_rows: int, max_len: int) -> PackedBatch:
    """A PackedBatch whose tensors are views of a flat int32 layout (on the device)."""
    n, r = n_tokens, n_rows
    cu = 5 * n
    return PackedBatch(
        ids=flat[0:n],
        types=flat[n : 2 * n],
        pos=flat[2 * n : 3 * n],
        tok_slot=flat[3 * n : 4 * n],
        seg=flat[4 * n : 5 * n],
        cu=flat[cu : cu + r + 1],
        row_slot=flat[cu + r + 1 : cu + 2 * r + 1],
        row_mode=flat[cu + 2 * r + 1 : cu + 3 * r + 1],
        max_len=max_len,
    )


def exact_attention(b: PackedBatch, lengths: list[int], heads: int) -> None:
    """Give ``b`` what the exact attention path needs for rows of ``lengths`` tokens: on the CPU its rows grouped by
    length (``packed_attention.py``: each group padded to its own longest row, not the batch's), elsewhere the
    padded layout (``add_exact_attention``). The same answers either way; on 2 CPU cores a serving batch of 32 rows
    took 0.84-0.92x the padded path's time on the default encoder (docs/benchmarks/engine.md, "Reading the
    figures")."""
    if b.ids.is_cpu:
        b.groups = attention_groups(lengths, heads)
    else:
        add_exact_attention(b, lengths)


def add_exact_attention(b: PackedBatch, lengths: list[int]) -> None:
    """Give ``b`` what the exact (padded-attention) path needs: each token's padded position and the key mask."""
    t = b.max_len  # the longest row
    b.pidx = (b.seg.long() * t + b.pos.long())[: sum(lengths)]
    lens = to_device(torch.tensor(lengths), b.ids.device)
    b.key_mask = (torch.arange(t, device=b.ids.device).unsqueeze(0) < lens.unsqueeze(1)).view(len(lengths), 1, 1, t)
