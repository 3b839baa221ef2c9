"""LoRA in the packed model: each row's low-rank update, gathered per row, in the same forward as every other row.

A packed layer has four matrix products ("sites"): ``qkv`` (query, key and value stacked), ``o`` (attention output),
``i`` (feed-forward intermediate) and ``f`` (feed-forward output). LoRA factors are kept per targeted module ("role":
``q``, ``k``, ``v``, ``o``, ``i``, ``f``), keyed ``"{layer}.{role}"``: A ``[rows, r, in]`` and B ``[rows, out, r]``,
r the largest rank resident (smaller ranks are zero-padded: exact); a module's low-rank product is added to its part
of its site's output (the query's to the first third of ``qkv``, and so on). Row 0 is all zeros: the row of every
task without LoRA, so a mixed batch is one computation.

Three forms compute a batch's products, all exact:

* stacked (few factor rows: a trainer's runs, a server's first LoRA tasks): every row's A stacked into one
  ``[F*r, in]`` matrix, so the tokens take one plain product ``[N, in] @ [in, F*r]``; each token keeps its own row's
  r columns (the others are multiplied by 0), then ``@ [F*r, out]``. No gather, no padded layout, static shapes;
* per row (the exact attention path, the CPU): the tokens are laid out padded per row (the layout the attention
  already uses), and each row's factors are gathered once: ``[R, T, in] @ [R, in, r]``, then ``@ [R, r, out]``;
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

#: LoRA role -> (site, part): the matrix product it updates and which slice of its output
ROLE_SITE = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "o": ("o", 0), "i": ("i", 0), "f": ("f", 0)}
SITE_ROLES = {"qkv": ("q", "k", "v"), "o": ("o",), "i": ("i",), "f": ("f",)}
#: the stacked form is used up to this many stacked columns (factor rows x rank): beyond it, multiplying every token
#: by every row's A costs more than gathering each row's own (2 CPU cores, the default encoder, 2026-11-28)
STACKED_MAX_COLUMNS = 64


def role_map(packed: PackedBert) -> dict[str, tuple[int, str]]:
    """Each LoRA site's module name -> (layer, role), from the packed model's bias names."""
    return {
        layer.names[role].removesuffix(".bias"): (i, role)
        for i, layer in enumerate(packed.layers)
        for role in ROLE_SITE
    }


def role_dims(packed: PackedBert, role: str) -> tuple[int, int]:
    """``(in, out)`` of a role's product."""
    layer, h = packed.layers[0], packed.hidden
    weight = {"q": layer.wqkv[:h], "k": layer.wqkv[:h], "v": layer.wqkv[:h], "o": layer.wo, "i": layer.wi}.get(
        role, layer.wf
    )
    return int(weight.shape[1]), int(weight.shape[0])


@dataclass
class LoraFactors:
    """Low-rank factors by key ``"{layer}.{role}"``: ``a`` ``[rows, r, in]``, ``b`` ``[rows, out, r]``; ``rows`` maps a
    bank slot to its factor row (None: row = slot, a trainer's runs)."""

    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: torch.Tensor | None = None


class LowRank:
    """The low-rank products of one batch: ``add(key, x, y)`` is ``y`` (site ``key`` = ``"{layer}.{site}"``'s
    output) plus each token's row's ``(x A^T) B^T`` for each of the site's modules that has factors resident."""

    def __init__(self, factors: LoraFactors | None, batch: PackedBatch, max_stacked: int | None = None) -> None:
        self.factors = factors
        self.batch = batch
        self.per_row = batch.pidx is not None and batch.key_mask is not None
        self.index: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None  # stacked form: [N, F*r], 1 where a column is the token's own row's
        self.stacked = False
        if factors is not None and factors.a:
            first = next(iter(factors.a.values()))
            n_rows, rank = int(first.shape[0]), int(first.shape[1])
            self.stacked = n_rows * rank <= (STACKED_MAX_COLUMNS if max_stacked is None else max_stacked)
            if self.stacked:
                self.per_row = False
            slots = batch.row_slot if self.per_row else batch.tok_slot
            self.index = slots if factors.rows is None else factors.rows.index_select(0, slots)
            if self.stacked and n_rows > 1:
                column_row = torch.arange(n_rows, device=first.device).repeat_interleave(rank)
                self.keep = (self.index.unsqueeze(1) == column_row).to(first.dtype)

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.factors is None or self.index is None:
            return y
        layer, site = key.split(".")
        parts = [
            (p, f"{layer}.{role}") for p, role in enumerate(SITE_ROLES[site]) if f"{layer}.{role}" in self.factors.a
        ]
        if not parts:
            return y
        padded = None
        if self.per_row:  # the tokens in the attention's padded layout, once for the site's modules
            pidx, key_mask = self.batch.pidx, self.batch.key_mask
            assert pidx is not None and key_mask is not None
            r, t = key_mask.shape[0], key_mask.shape[-1]
            padded = x.new_zeros(r * t, x.shape[1]).index_copy(0, pidx, x).view(r, t, -1)
        width = y.shape[1] // len(SITE_ROLES[site])
        for part, name in parts:
            delta = self._product(name, x, padded)
            y = y + delta if len(SITE_ROLES[site]) == 1 else _add_at(y, delta, part * width)
        return y

    def _product(self, name: str, x: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        assert self.factors is not None and self.index is not None
        if self.stacked:  # [N, in] @ [in, F*r], each token's own r columns kept, @ [F*r, out]
            a, b = self.factors.a[name], self.factors.b[name]  # [F, r, in], [F, out, r]
            h = x @ a.reshape(-1, a.shape[-1]).to(x.dtype).t()
            if self.keep is not None:
                h = h * self.keep.to(x.dtype)
            return h @ b.permute(1, 0, 2).reshape(b.shape[1], -1).to(x.dtype).t()
        a = self.factors.a[name].index_select(0, self.index).to(x.dtype)
        b = self.factors.b[name].index_select(0, self.index).to(x.dtype)
        if padded is None:  # per token: [N, r, in] @ [N, in, 1], then [N, out, r] @ [N, r, 1]
            return torch.bmm(b, torch.bmm(a, x.unsqueeze(2))).squeeze(2)
        assert self.batch.pidx is not None
        delta = torch.bmm(torch.bmm(padded, a.transpose(1, 2)), b.transpose(1, 2))  # [R, T, out]
        return delta.view(-1, delta.shape[-1]).index_select(0, self.batch.pidx)


def _add_at(y: torch.Tensor, delta: torch.Tensor, start: int) -> torch.Tensor:
    """``y`` with ``delta`` added to its columns from ``start`` (out of place: autograd sees a plain sum)."""
    pad = torch.nn.functional.pad(delta, (start, y.shape[1] - start - delta.shape[1]))
    return y + pad


def fold_products(
    packed: PackedBert, tasks: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """The tasks' LoRA factors by site key ``"{layer}.{site}"``: ``[(task, A, B)]`` with A ``[r, in]`` and B placed in
    the site's output (``[P*out, r]``, zero outside its module's part), for folding vectors through the updated
    weights (``fold_through``)."""
    roles = role_map(packed)
    out: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for k, task in enumerate(tasks):
        for module, (a, b) in factor_pairs(task).items():
            i, role = roles[module]
            site, part = ROLE_SITE[role]
            width = b.shape[0]
            placed = b.new_zeros(len(SITE_ROLES[site]) * width, b.shape[1])
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


def module_factors(packed: PackedBert, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> LoraFactors:
    """A trainer's factors (differentiable): ``pairs`` maps a module to its runs' A ``[K, r, in]`` and B
    ``[K, out, r]``; row = run."""
    roles = role_map(packed)
    factors = LoraFactors()
    for module, (a, b) in pairs.items():
        i, role = roles[module]
        factors.a[f"{i}.{role}"], factors.b[f"{i}.{role}"] = a, b
    return factors


class LoraBank:
    """The LoRA factors of a server's resident tasks (``factors``), one row per slot that holds a LoRA patch. Rows,
    rank and modules grow as patches need them; each growth reallocates and bumps the packed model's ``generation``
    (captured CUDA graphs read the old tensors)."""

    def __init__(self, packed: PackedBert, n_slots: int) -> None:
        self.packed = packed
        self.roles = role_map(packed)
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
        keys = {"{}.{}".format(*self.roles[m]) for m in pairs}
        if not row:
            if not self.free:
                self._grow(2 * self.capacity, self.rank, set(self.factors.a))
            row = self.free.pop()
            self.rows[slot] = row
        if rank > self.rank or not keys <= set(self.factors.a):
            self._grow(self.capacity, max(rank, self.rank), set(self.factors.a) | keys)
        self._clear(row)
        for module, (a, b) in pairs.items():
            key, r = "{}.{}".format(*self.roles[module]), int(a.shape[0])
            at, bt = self.factors.a[key], self.factors.b[key]
            at[row, :r] = a.to(at.device, at.dtype)
            bt[row, :, :r] = b.to(bt.device, bt.dtype)

    def _clear(self, row: int) -> None:
        for key in self.factors.a:
            self.factors.a[key][row].zero_()
            self.factors.b[key][row].zero_()

    def _grow(self, capacity: int, rank: int, keys: set[str]) -> None:
        """Reallocate to ``capacity`` rows of ``rank`` for modules ``keys``, keeping every resident row's factors."""
        a_new, b_new = {}, {}
        device, dtype = self.packed.device, self.packed.dtype
        for key in sorted(keys):
            d_in, d_out = role_dims(self.packed, key.split(".")[1])
            a = torch.zeros(capacity, rank, d_in, device=device, dtype=dtype)
            b = torch.zeros(capacity, d_out, rank, device=device, dtype=dtype)
            if key in self.factors.a:
                a[: self.capacity, : self.rank] = self.factors.a[key]
                b[: self.capacity, :, : self.rank] = self.factors.b[key]
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
