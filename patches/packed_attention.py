"""The exact attention of a packed batch on the CPU (a trainer's or the engine's), its rows grouped by length.

The exact path pads every row of a batch to its longest row, so attention, its softmax and its dropout masks cost
every row the square of that length: on Rotten Tomatoes' rows (27 tokens on average, up to 78) a batch of 16 rows did
about 3.4x the attention work its rows need. Here the rows are sorted by length and cut into groups, each padded to
its own longest row (``length_groups`` chooses the cuts: the least products' work, with a fixed cost a group), and
each group attends in three batched products. The tokens reach the groups' padded blocks in one ``index_copy_`` and
leave them in one ``index_select`` whose indices (``attention_groups``, made on the host once a batch) put each
head's values where its group's products read them, so no permuted copy is made forth or back. Exact: every row
attends over its own keys only, as on the padded path."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from patchserve.patches.packed_ops import dropout

#: what one more group costs, in the units of its products' work (rows x longest row^2): about a row of 32 tokens.
#: The work of a group's products grows with that square, a group's own ops (a dozen a layer, forward and backward)
#: cost it a fixed time. Calibrated on Rotten Tomatoes' lengths on 2 CPU cores (AMD EPYC): one layer's attention,
#: forward and backward, with dropout, took 5.1 ms at 1,000 against 8.6 ms padded to the longest row at 16 rows a
#: batch (4.3 groups), 11.2 against 28.0 ms at 48 rows (7.6 groups); 0 (a group per length) 6.4 and 17.1 ms.
GROUP_COST = 1000


def length_groups(lengths: Sequence[int] | np.ndarray, group_cost: float = GROUP_COST) -> list[np.ndarray]:
    """The rows (indices into ``lengths``) of each group, shortest rows first: the cuts of the rows sorted by length
    that minimise the sum over groups of ``group_cost + rows * longest^2`` (dynamic programming over the cuts)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    square = np.asarray(lengths, dtype=np.float64)[order] ** 2
    n = len(order)
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):  # best[j]: the rows before j grouped; the last group is rows cut[j]..j-1
        costs = best[:j] + group_cost + (j - np.arange(j)) * square[j - 1]
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = int(cut[j])
    return groups[::-1]


@dataclass
class AttentionGroups:
    """Where a batch's tokens go for ``grouped_attention``. The groups' padded blocks lie one after another in one
    buffer of ``head_dim``-long units: group g's block is ``[3, heads * rows_g, longest_g, head_dim]`` (queries,
    keys, values; each head's rows together), its output ``[heads * rows_g, longest_g, head_dim]``."""

    into: torch.Tensor  # [N * 3 * heads]: each (token, q/k/v, head)'s unit in the blocks, in qkv's [N, 3, heads] order
    out: torch.Tensor  # [N * heads]: each (token, head)'s unit in the outputs, in [N, heads] order
    shapes: list[tuple[int, int]]  # each group's rows and longest row
    masks: list[torch.Tensor]  # each group's additive key mask [heads * rows, 1, longest]: 0, -inf past a row's end
    heads: int

    @property
    def block_units(self) -> list[int]:
        return [3 * self.heads * rows * longest for rows, longest in self.shapes]


def attention_groups(lengths: Sequence[int], heads: int, device: torch.device | str = "cpu") -> AttentionGroups:
    """The grouped layout of a batch whose rows have ``lengths`` tokens (its tokens packed row after row)."""
    lens = np.asarray(lengths, dtype=np.int64)
    # per row: its group's longest row and row count, its first unit in the blocks and in the outputs
    row_base_in, row_base_out, row_stride = (np.zeros(len(lens), dtype=np.int64) for _ in range(3))
    shapes, masks = [], []
    into_off = out_off = 0
    for rows in length_groups(lens):
        r, t = len(rows), int(lens[rows].max())
        local = np.arange(r) * t  # the group's row j starts at unit j * t of each head's rows
        row_base_in[rows], row_base_out[rows], row_stride[rows] = into_off + local, out_off + local, r * t
        mask = np.where(np.arange(t)[None, :] < lens[rows][:, None], np.float32(0), np.float32(-np.inf))
        masks.append(torch.from_numpy(np.tile(mask, (heads, 1))).view(heads * r, 1, t).to(device))
        shapes.append((r, t))
        into_off += 3 * heads * r * t
        out_off += heads * r * t
    pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # each token's place in its row
    stride = np.repeat(row_stride, lens)[:, None]  # from one head's (or q/k/v's) rows of a group to the next's
    into = (np.repeat(row_base_in, lens) + pos)[:, None] + np.arange(3 * heads)[None, :] * stride
    out = (np.repeat(row_base_out, lens) + pos)[:, None] + np.arange(heads)[None, :] * stride
    return AttentionGroups(
        into=torch.from_numpy(into.reshape(-1)).to(device),
        out=torch.from_numpy(out.reshape(-1)).to(device),
        shapes=shapes,
        masks=masks,
        heads=heads,
    )


def grouped_attention(qkv: torch.Tensor, groups: AttentionGroups, dropout_p: float = 0.0) -> torch.Tensor:
    """Each token's attention output ``[N, H]`` from its queries, keys and values ``qkv`` ``[N, 3H]``, each row
    attending over its own keys, with dropout at rate ``dropout_p`` on the probabilities (``packed_ops.dropout``)."""
    heads, sizes = groups.heads, groups.block_units
    n, d = qkv.shape[0], qkv.shape[1] // (3 * heads)
    units = qkv.new_zeros(sum(sizes), d).index_copy_(0, groups.into, qkv.reshape(n * 3 * heads, d))
    outs = []
    # (split, not a slice per group: its backward is one concatenation, not a zero-filled buffer per group)
    for (rows, longest), mask, block in zip(groups.shapes, groups.masks, units.split(sizes), strict=True):
        q, k, v = block.view(3, heads * rows, longest, d).unbind(0)
        scores = torch.baddbmm(mask.to(qkv.dtype), q, k.transpose(1, 2), alpha=1.0 / math.sqrt(d))
        probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
        outs.append(torch.bmm(probs, v).view(-1, d))
    return torch.cat(outs).index_select(0, groups.out).view(n, heads * d)
