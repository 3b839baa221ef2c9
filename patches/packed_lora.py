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
* per segment (the CPU): a row's tokens are contiguous, so each run of tokens that shares a factor row takes two
  plain products with that row's own factors, added in place to its rows of the output. No gather, no padding, and
  rows without LoRA cost nothing (a batch of BitFit rows on a server with LoRA tasks pays no LoRA product). Host-side
  offsets and one small product per segment: right for the CPU, not for a GPU;
* per token (other devices, CUDA graphs): each token's factors are gathered: static shapes, capturable.

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
#: by every row's A costs more than each segment's own products (2 CPU cores, the default encoder, batch 32, lora on
#: every linear layer, over a BitFit batch: 32 columns stacked 1.25x, per segment 1.29x; 64 columns 1.36x against
#: 1.32x; 2026-11-28). Not measured on a GPU, where the alternative is the per-token gather.
STACKED_MAX_COLUMNS = 32


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
    output) plus each token's row's ``(x A^T) B^T`` for each of the site's modules that has factors resident.

    ``form``: ``"stacked"``, ``"segments"`` or ``"tokens"`` (the module docstring), None without factors or without
    a LoRA row in the batch."""

    def __init__(
        self,
        factors: LoraFactors | None,
        batch: PackedBatch,
        form: str | None = None,
        stacked_max_columns: int | None = None,
    ) -> None:
        """``form`` forces one (tests); by default stacked while factor rows x rank is at most
        ``stacked_max_columns`` (None: ``STACKED_MAX_COLUMNS``), else per segment on the CPU, per token on other
        devices."""
        self.factors = factors
        self.form: str | None = None
        self.index: torch.Tensor | None = None  # stacked and per-token forms: each token's factor row
        self.keep: torch.Tensor | None = None  # stacked form: [N, F*r], 1 where a column is the token's own row's
        self.segments: list[tuple[int, int, int]] = []  # per-segment form: (start, end, factor row)
        if factors is None or not factors.a:
            return
        first = next(iter(factors.a.values()))
        n_rows, rank = int(first.shape[0]), int(first.shape[1])
        if form is None:
            limit = STACKED_MAX_COLUMNS if stacked_max_columns is None else stacked_max_columns
            stacked = n_rows * rank <= limit
            form = "stacked" if stacked else "segments" if batch.ids.device.type == "cpu" else "tokens"
        if form == "segments":
            self.segments = _segments(batch, factors.rows)
            self.form = "segments" if self.segments else None
            return
        self.form = form
        slots = batch.tok_slot
        self.index = slots if factors.rows is None else factors.rows.index_select(0, slots)
        if self.form == "stacked" and n_rows > 1:
            column_row = torch.arange(n_rows, device=first.device).repeat_interleave(rank)
            self.keep = (self.index.unsqueeze(1) == column_row).to(first.dtype)

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.factors is None or self.form is None:
            return y
        layer, site = key.split(".")
        roles = SITE_ROLES[site]
        width = y.shape[1] // len(roles)
        for part, role in enumerate(roles):
            name = f"{layer}.{role}"
            if name not in self.factors.a:
                continue
            a, b = self.factors.a[name].to(x.dtype), self.factors.b[name].to(x.dtype)  # [F, r, in], [F, out, r]
            if self.form == "segments":  # in place, each segment's product added to its rows of y's part
                out = y if len(roles) == 1 else y[:, part * width : (part + 1) * width]
                at, bt = a.transpose(1, 2), b.transpose(1, 2)
                for start, end, row in self.segments:
                    out[start:end].addmm_(x[start:end] @ at[row], bt[row])
                continue
            if self.form == "stacked":  # [N, in] @ [in, F*r], each token's own r columns kept, @ [F*r, out]
                h = x @ a.reshape(-1, a.shape[-1]).t()
                if self.keep is not None:
                    h = h * self.keep.to(x.dtype)
                delta = h @ b.permute(1, 0, 2).reshape(b.shape[1], -1).t()
            else:  # per token: [N, r, in] @ [N, in, 1], then [N, out, r] @ [N, r, 1]
                assert self.index is not None
                a, b = a.index_select(0, self.index), b.index_select(0, self.index)
                delta = torch.bmm(b, torch.bmm(a, x.unsqueeze(2))).squeeze(2)
            y = y + delta if len(roles) == 1 else _add_at(y, delta, part * width)
        return y


def _segments(batch: PackedBatch, rows: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """The batch's runs of tokens that share a factor row: ``(start, end, row)``, rows without LoRA (row 0) left out
    (a trainer's factors, ``rows`` None, have no zero row: row = slot)."""
    factor_row = batch.row_slot if rows is None else rows.index_select(0, batch.row_slot)
    offsets = batch.cu.tolist()
    out: list[tuple[int, int, int]] = []
    for i, row in enumerate(factor_row.tolist()):
        start, end = offsets[i], offsets[i + 1]
        if end <= start or (row == 0 and rows is not None):
            continue
        if out and out[-1][1] == start and out[-1][2] == row:
            out[-1] = (out[-1][0], end, row)
        else:
            out.append((start, end, row))
    return out


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
