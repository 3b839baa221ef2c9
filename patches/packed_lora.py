"""LoRA in the packed model: each row's low-rank update, gathered per row, in the same forward as every other row.

A packed layer has four matrix products ("sites"): ``qkv`` (query, key and value stacked), ``o`` (attention output),
``i`` (feed-forward intermediate) and ``f`` (feed-forward output). A LoRA patch's factors for a site are kept as one
A ``[rows, P*r, in]`` and one B ``[rows, out, P*r]``, P the site's parts (3 for ``qkv``, B block-diagonal over them, so
one pair of batched products serves all three), r the largest rank resident (smaller ranks are zero-padded: exact).
Row 0 is all zeros: the row of every task without LoRA, so a mixed batch is one computation.

Two forms compute a batch's products, both exact:

* per row (the exact attention path, the CPU): the tokens are laid out padded per row (the layout the attention
  already uses), and each row's factors are gathered once: ``[R, T, in] @ [R, in, P*r]``, then ``@ [R, P*r, out]``;
* per token (flash attention, CUDA graphs): each token's factors are gathered: static shapes, capturable.

A server's ``LoraBank`` gives LoRA rows only to slots that hold a LoRA patch (``rows``: slot -> row), so a server of
BitFit patches allocates and computes nothing for LoRA until the first LoRA patch arrives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from patchserve.patches.lora import factor_pairs

if TYPE_CHECKING:
    from patchserve.patches.packed import PackedBatch, PackedBert

#: LoRA role -> (site, part)
ROLE_SITE = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "o": ("o", 0), "i": ("i", 0), "f": ("f", 0)}
PARTS = {"qkv": 3, "o": 1, "i": 1, "f": 1}


def site_map(packed: PackedBert) -> dict[str, tuple[int, str, int]]:
    """Each LoRA site's module name -> (layer, site, part), from the packed model's bias names."""
    out: dict[str, tuple[int, str, int]] = {}
    for i, layer in enumerate(packed.layers):
        for role, (site, part) in ROLE_SITE.items():
            out[layer.names[role].removesuffix(".bias")] = (i, site, part)
    return out


def site_dims(packed: PackedBert, site: str) -> tuple[int, int]:
    """``(in, out)`` of one part of a site's product."""
    layer = packed.layers[0]
    weight = {"qkv": layer.wqkv[: packed.hidden], "o": layer.wo, "i": layer.wi, "f": layer.wf}[site]
    return int(weight.shape[1]), int(weight.shape[0])


@dataclass
class LoraFactors:
    """Low-rank factors by site key ``"{layer}.{site}"``: ``a`` ``[rows, P*r, in]``, ``b`` ``[rows, out*P, P*r]``;
    ``rows`` maps a bank slot to its factor row (None: row = slot, a trainer's runs)."""

    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: torch.Tensor | None = None


class LowRank:
    """The low-rank products of one batch: ``add(key, x, y)`` is ``y`` plus each token's row's ``(x A^T) B^T`` for
    site ``key`` (``y`` itself where no factors are resident for it)."""

    def __init__(self, factors: LoraFactors | None, batch: PackedBatch) -> None:
        self.factors = factors
        self.batch = batch
        self.per_row = batch.pidx is not None and batch.key_mask is not None
        self.index: torch.Tensor | None = None
        if factors is not None and factors.a:
            slots = batch.row_slot if self.per_row else batch.tok_slot
            self.index = slots if factors.rows is None else factors.rows.index_select(0, slots)

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.factors is None or self.index is None or key not in self.factors.a:
            return y
        a = self.factors.a[key].index_select(0, self.index).to(x.dtype)
        b = self.factors.b[key].index_select(0, self.index).to(x.dtype)
        if not self.per_row:  # per token: [N, K, in] @ [N, in, 1], then [N, out, K] @ [N, K, 1]
            return y + torch.bmm(b, torch.bmm(a, x.unsqueeze(2))).squeeze(2)
        pidx, key_mask = self.batch.pidx, self.batch.key_mask
        assert pidx is not None and key_mask is not None
        r, t = key_mask.shape[0], key_mask.shape[-1]
        padded = x.new_zeros(r * t, x.shape[1]).index_copy(0, pidx, x).view(r, t, -1)
        delta = torch.bmm(torch.bmm(padded, a.transpose(1, 2)), b.transpose(1, 2))  # [R, T, out]
        return y + delta.view(r * t, -1).index_select(0, pidx)


def fold_products(
    packed: PackedBert, tasks: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """The tasks' LoRA factors by site key: ``[(task, A, B)]`` with A ``[r, in]`` and B placed in the site's output
    (``[P*out, r]``), for folding vectors through the updated weights (``fold_through``)."""
    sites = site_map(packed)
    out: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for k, task in enumerate(tasks):
        for module, (a, b) in factor_pairs(task).items():
            i, site, part = sites[module]
            width = b.shape[0]
            placed = b.new_zeros(PARTS[site] * width, b.shape[1])
            placed[part * width : (part + 1) * width] = b
            device = packed.device
            out.setdefault(f"{i}.{site}", []).append((k, a.to(device, torch.float32), placed.to(device, torch.float32)))
    return out


def fold_through(
    products: Mapping[str, list[tuple[int, torch.Tensor, torch.Tensor]]], key: str, vecs: torch.Tensor
) -> torch.Tensor:
    """``vecs`` ``[K, in]`` (each task's vector folded through a site) plus, for the tasks with LoRA factors there,
    the vector's low-rank product: what ``vecs @ (W + B A)^T`` adds to ``vecs @ W^T`` (``[K, P*out]``, or 0)."""
    pairs = products.get(key)
    if not pairs:
        return vecs.new_zeros(())
    rows = [torch.zeros(pairs[0][2].shape[0], device=vecs.device, dtype=vecs.dtype)] * vecs.shape[0]
    for k, a, b in pairs:
        rows[k] = rows[k] + b @ (a @ vecs[k])
    return torch.stack(rows)


class LoraBank:
    """The LoRA factors of a server's resident tasks (``factors``), one row per slot that holds a LoRA patch. Rows,
    rank and sites grow as patches need them; each growth reallocates and bumps the packed model's ``generation``
    (captured CUDA graphs read the old tensors)."""

    def __init__(self, packed: PackedBert, n_slots: int) -> None:
        self.packed = packed
        self.sites = site_map(packed)
        self.factors = LoraFactors(rows=torch.zeros(n_slots, dtype=torch.long, device=packed.device))
        self.rank = 0
        self.capacity = 1  # rows, row 0 the zero row
        self.free: list[int] = []

    @property
    def rows(self) -> torch.Tensor:
        assert self.factors.rows is not None
        return self.factors.rows

    @property
    def resident(self) -> int:
        """How many slots hold a LoRA patch."""
        return int((self.rows > 0).sum())

    @torch.no_grad()
    def write(self, slot: int, task: Mapping[str, torch.Tensor]) -> None:
        """Give ``slot`` the task's LoRA factors (a row of its own), or none (its row, if it had one, is freed)."""
        pairs = factor_pairs(task)
        row = int(self.rows[slot])
        if not pairs:
            if row:
                self._clear(row)
                self.free.append(row)
                self.rows[slot] = 0
            return
        rank = max(int(a.shape[0]) for a, _ in pairs.values())
        keys = {f"{i}.{site}" for i, site, _ in (self.sites[m] for m in pairs)}
        if not row:
            if not self.free:
                self._grow(2 * self.capacity, self.rank, set(self.factors.a))
            row = self.free.pop()
            self.rows[slot] = row
        if rank > self.rank or not keys <= set(self.factors.a):
            self._grow(self.capacity, max(rank, self.rank), set(self.factors.a) | keys)
        self._clear(row)
        for module, (a, b) in pairs.items():
            i, site, part = self.sites[module]
            r, width = int(a.shape[0]), int(b.shape[0])
            at, bt = self.factors.a[f"{i}.{site}"], self.factors.b[f"{i}.{site}"]
            at[row, part * self.rank : part * self.rank + r] = a.to(at.device, at.dtype)
            bt[row, part * width : (part + 1) * width, part * self.rank : part * self.rank + r] = b.to(
                at.device, at.dtype
            )

    def _clear(self, row: int) -> None:
        for key in self.factors.a:
            self.factors.a[key][row].zero_()
            self.factors.b[key][row].zero_()

    def _grow(self, capacity: int, rank: int, keys: set[str]) -> None:
        """Reallocate to ``capacity`` rows of ``rank`` for sites ``keys``, keeping every resident row's factors."""
        a_new, b_new = {}, {}
        for key in sorted(keys):
            site = key.split(".")[1]
            parts = PARTS[site]
            d_in, d_out = site_dims(self.packed, site)
            a = torch.zeros(capacity, parts * rank, d_in, device=self.packed.device, dtype=self.packed.dtype)
            b = torch.zeros(capacity, parts * d_out, parts * rank, device=self.packed.device, dtype=self.packed.dtype)
            if key in self.factors.a:  # each part's block moves to its place at the new rank
                old_a, old_b, n = self.factors.a[key], self.factors.b[key], self.capacity
                for p in range(parts):
                    src, dst = slice(p * self.rank, (p + 1) * self.rank), slice(p * rank, p * rank + self.rank)
                    a[:n, dst] = old_a[:, src]
                    b[:n, :, dst] = old_b[:, :, src]
            a_new[key], b_new[key] = a, b
        self.free += range(self.capacity, capacity)
        self.free.sort(reverse=True)
        self.factors.a, self.factors.b = a_new, b_new
        self.capacity, self.rank = capacity, rank
        self.packed.generation += 1

    @property
    def bytes_per_row(self) -> int:
        """Device bytes one LoRA task's factors take."""
        return sum(t[0].numel() * t.element_size() for t in [*self.factors.a.values(), *self.factors.b.values()])


def site_factors(packed: PackedBert, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> LoraFactors:
    """A trainer's factors by site (differentiable): ``pairs`` maps a module to its runs' A ``[K, r, in]`` and B
    ``[K, out, r]`` (one rank); the parts of a site without factors are zero blocks."""
    sites = site_map(packed)
    by_site: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in pairs.items():
        i, site, part = sites[module]
        by_site.setdefault(f"{i}.{site}", {})[part] = ab
    factors = LoraFactors()
    for key, parts in by_site.items():
        n = PARTS[key.split(".")[1]]
        a0, b0 = next(iter(parts.values()))
        k, rank, d_in, d_out = a0.shape[0], a0.shape[1], a0.shape[2], b0.shape[1]
        zeros_a, zeros_b = a0.new_zeros(k, rank, d_in), b0.new_zeros(k, d_out, rank)
        factors.a[key] = torch.cat([parts[p][0] if p in parts else zeros_a for p in range(n)], dim=1)
        rows = [
            torch.cat([parts[p][1] if p in parts and q == p else zeros_b for q in range(n)], dim=2) for p in range(n)
        ]
        factors.b[key] = torch.cat(rows, dim=1)  # block-diagonal over the parts
    return factors
