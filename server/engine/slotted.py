"""Slotted layers: the frozen encoder's biased modules, rewritten so every row of a batch gets its own task's bias.

Each biased ``nn.Linear`` / ``nn.LayerNorm`` becomes a module that computes the shared, bias-free op once for the
whole batch and then adds ``bank[rows]`` -- a gather from a ``[slots, dim]`` table by the batch's per-row slot
index. Nothing is copied per request and the batch shape never depends on the task mix.

Two exact simplifications (ARCHITECTURE.md, "The one idea"), applied when the architecture's roles are known:

* key bias b_k adds q.b_k to every score of a query row; softmax is shift-invariant, so it is dropped;
* value bias b_v passes through attention unchanged (the weights of a row sum to 1), so it folds into the
  attention-output bias: b_o' = b_o + W_o b_v, computed once when a patch is loaded into a slot.

A ``bitfit-ia3`` patch's (IA)^3 scales are per-row multiplies on slotted Linears too, once such a patch is loaded: the
key and value projections' outputs (after their bias, so both simplifications stay exact: b_o' = b_o + W_o (s_v b_v)),
and the feed-forward intermediate's output as the *input* of the output projection that reads it (W (s h) is the
scaled intermediate's product).

A ``lora`` patch's factors are per-row low-rank products on the slotted Linears it targets: ``[S, r, in]`` and
``[S, out, r]`` banks on each targeted Linear (allocated at the first LoRA patch that targets it, grown to the largest
rank), gathered per row and applied as two batched products. The value-bias fold passes through the attention
output's update too: b_o' = b_o + (W_o + B A) (s_v b_v).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from patchserve.patches.bitfit import bias_roles, ia3_roles
from patchserve.patches.errors import EncoderError, PatchKeysError
from patchserve.patches.format import Patch
from patchserve.patches.lora import factor_pairs
from patchserve.patches.model import pool
from patchserve.server.engine.backend import Pending
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.rows import RowBlock, RowOutputs


class SlotIndex:
    """The per-row slot index of the batch being run, shared by every slotted module. rows: [B] long."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def gather(self, bank: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """bank [S, D] -> [B, 1, ..., 1, D], broadcastable against ``like`` [B, ..., D]."""
        if self.rows is None:
            raise RuntimeError("slot index not set: run the encoder through the Runner")
        picked = bank.index_select(0, self.rows)  # [B, D]
        return picked.view(picked.shape[0], *([1] * (like.dim() - 2)), picked.shape[1])


class SlottedLinear(nn.Module):
    """y = x W^T + bank[row]. ``bank`` None means no bias at all (the dropped key bias, the folded value bias).

    Where it is an (IA)^3 site (``scale_name``), ``scale`` [S, D] multiplies its output per row (after the bias), or
    its input (``scale_input``: the feed-forward intermediate's scale, on the projection that reads it), once a
    patch with (IA)^3 scales is loaded."""

    def __init__(self, linear: nn.Linear, index: SlotIndex, bank: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = linear.weight
        self.index = index
        self.bank = bank  # [S, out] or None
        self.scale_name: str | None = None  # the (IA)^3 site it serves, as patches name it
        self.scale_input = False
        self.scale: torch.Tensor | None = None  # [S, out] (or [S, in] for an input scale) once loaded
        self.lora_a: torch.Tensor | None = None  # [S, r, in] and [S, out, r] once a LoRA patch targets it
        self.lora_b: torch.Tensor | None = None

    def add_scale_bank(self, n_slots: int) -> None:
        """Every slot gets its own scale, ones to begin with (the slots loaded so far keep the unscaled module)."""
        if self.scale is None:
            width = self.weight.shape[1 if self.scale_input else 0]
            self.scale = self.weight.new_ones(n_slots, width)

    @torch.no_grad()
    def write_factors(self, slot: int, n_slots: int, factors: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Set ``slot``'s LoRA factors (A ``[r, in]``, B ``[out, r]``), or zeros (None) where it has banks."""
        if factors is None and self.lora_a is None:
            return
        rank = 0 if factors is None else int(factors[0].shape[0])
        if self.lora_a is None or self.lora_b is None or rank > self.lora_a.shape[1]:
            out_f, in_f = self.weight.shape
            a, b = self.weight.new_zeros(n_slots, rank, in_f), self.weight.new_zeros(n_slots, out_f, rank)
            if self.lora_a is not None and self.lora_b is not None:  # keep the slots loaded so far (zero-padded rank)
                a[:, : self.lora_a.shape[1]] = self.lora_a
                b[:, :, : self.lora_b.shape[2]] = self.lora_b
            self.lora_a, self.lora_b = a, b
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if factors is not None:
            self.lora_a[slot, :rank] = factors[0].to(self.weight.device, self.weight.dtype)
            self.lora_b[slot, :, :rank] = factors[1].to(self.weight.device, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None and self.scale_input:
            x = x * self.index.gather(self.scale, x)
        y = F.linear(x, self.weight)  # [B, ..., out]
        if self.lora_a is not None and self.lora_b is not None and x.dim() == 3:  # each row's (x A^T) B^T
            rows = self.index.rows
            assert rows is not None
            a, b = self.lora_a.index_select(0, rows), self.lora_b.index_select(0, rows)
            y = y + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
        if self.bank is not None:
            y = y + self.index.gather(self.bank, y)
        if self.scale is not None and not self.scale_input:
            y = y * self.index.gather(self.scale, y)
        return y


class SlottedLayerNorm(nn.Module):
    """LayerNorm without its bias, then the row's task bias added by gather."""

    def __init__(self, ln: nn.LayerNorm, index: SlotIndex, bank: torch.Tensor) -> None:
        super().__init__()
        self.weight = ln.weight
        self.normalized_shape = ln.normalized_shape
        self.eps = ln.eps
        self.index = index
        self.bank = bank  # [S, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)
        return y + self.index.gather(self.bank, y)


@dataclass
class BiasSite:
    """One biased module of the encoder and how its bias is served."""

    name: str  # the bias parameter's name, e.g. encoder.layer.0.attention.output.dense.bias
    module: nn.Module  # the slotted replacement
    bank: torch.Tensor | None  # its [S, D] bank, shared with the module; None when dropped/folded away
    base: torch.Tensor  # base bias [D] on the device (the value for tasks that do not train it)
    served: bool = True  # False: dropped (b_k) or folded away (b_v)
    fold_from: str | None = None  # for b_o: the b_v whose W_o-product it absorbs
    fold_weight: torch.Tensor | None = field(default=None, repr=False)  # W_o [out, in]


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    return mod, leaf


def install_slots(
    model: nn.Module, n_slots: int, *, drop_key_bias: bool = True, fold_value_bias: bool = True
) -> tuple[SlotIndex, dict[str, BiasSite]]:
    """Replace every biased Linear/LayerNorm of ``model`` (in place) with a slotted one; every slot starts as base.

    Returns the shared index and the sites by bias parameter name.
    """
    try:
        roles = bias_roles(model)
    except EncoderError:
        roles = {}  # unknown architecture: serve every bias, no simplifications
    if not roles:
        drop_key_bias = fold_value_bias = False
    by_role_layer = {(r.role, r.layer): n for n, r in roles.items()}
    ia3 = ia3_roles(model) if roles else {}
    index = SlotIndex()
    sites: dict[str, BiasSite] = {}
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.LayerNorm)]
    for mod_name, mod in targets:
        if mod.bias is None:
            continue
        name = f"{mod_name}.bias"
        base = mod.bias.detach().clone()
        role = roles.get(name)
        dropped = role is not None and ((drop_key_bias and role.role == "k") or (fold_value_bias and role.role == "v"))
        bank = None if dropped else base.unsqueeze(0).repeat(n_slots, 1).contiguous()  # [S, D]
        new: nn.Module
        if isinstance(mod, nn.LayerNorm):
            assert bank is not None
            new = SlottedLayerNorm(mod, index, bank)
        else:
            new = SlottedLinear(mod, index, bank)
        parent, leaf = _parent(model, mod_name)
        setattr(parent, leaf, new)
        site = BiasSite(name, new, bank, base, served=not dropped)
        if fold_value_bias and role is not None and role.role == "m1":
            site.fold_from = by_role_layer.get(("v", role.layer))
            site.fold_weight = mod.weight.detach()
        sites[name] = site
    for ia3_name, ia3_role in ia3.items():  # the key's and value's Linear, the Linear that reads the intermediate
        linear_role = "m3" if ia3_role.role == "ff" else ia3_role.role
        bias_name = by_role_layer.get((linear_role, ia3_role.layer))
        linear = sites[bias_name].module if bias_name is not None else None
        if isinstance(linear, SlottedLinear):
            linear.scale_name, linear.scale_input = ia3_name, ia3_role.role == "ff"
    for site in sites.values():  # every slot starts as the base model, folded b_v included
        if site.fold_from is not None and site.bank is not None:
            with torch.no_grad():
                site.bank.copy_(_folded(site, sites, site.base, None).expand_as(site.bank))
    return index, sites


def _folded(
    site: BiasSite,
    sites: Mapping[str, BiasSite],
    b_o: torch.Tensor,
    b_v: torch.Tensor | None,
    s_v: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """b_o' = b_o + (W_o + B A) (s_v b_v) (base b_v where the task has none; ``s_v`` the value's (IA)^3 scale, if
    any; ``lora`` the attention output's factors, if any), in float32, cast to the bank's dtype."""
    assert site.fold_from is not None and site.fold_weight is not None
    v = (sites[site.fold_from].base if b_v is None else b_v).float()
    if s_v is not None:
        v = v * s_v.float()
    folded = b_o.float() + site.fold_weight.float() @ v
    if lora is not None:
        a, b = lora
        folded = folded + b.to(v.device).float() @ (a.to(v.device).float() @ v)
    return folded.to(site.base.dtype)


@torch.no_grad()
def write_slot(
    sites: Mapping[str, BiasSite],
    slot: int,
    biases: Mapping[str, torch.Tensor],
    scales: Mapping[str, torch.Tensor] | None = None,
    lora: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Load a task's biases (and (IA)^3 scales, or LoRA factors) into ``slot`` of every bank (base values where it
    has none)."""
    modules = [s.module for s in sites.values()]
    linears = {m.scale_name: m for m in modules if isinstance(m, SlottedLinear) and m.scale_name is not None}
    scales = scales or {}
    unknown = sorted(set(scales) - set(linears))
    if unknown:
        raise PatchKeysError(f"this engine has no (IA)^3 site for the scales {unknown[:5]}")
    has_ia3 = bool(scales)
    n_slots = next(s.bank for s in sites.values() if s.bank is not None).shape[0]
    factors = factor_pairs(lora or {})
    by_module = {s.name.removesuffix(".bias"): s.module for s in sites.values()}
    unknown = sorted(set(factors) - {n for n, m in by_module.items() if isinstance(m, SlottedLinear)})
    if unknown:
        raise PatchKeysError(f"this engine has no linear layer for the LoRA factors of {unknown[:5]}")
    for module_name, module in by_module.items():
        if isinstance(module, SlottedLinear):
            module.write_factors(slot, n_slots, factors.get(module_name))
    for name, linear in linears.items():
        if has_ia3:
            linear.add_scale_bank(n_slots)
        if linear.scale is not None:
            value = scales.get(name)
            if value is None:
                linear.scale[slot].fill_(1.0)
            else:
                linear.scale[slot].copy_(value.to(linear.scale.device, linear.scale.dtype))
    for site in sites.values():
        if not site.served or site.bank is None:
            continue
        value = biases.get(site.name)
        value = site.base if value is None else value.to(site.base.device, site.base.dtype)
        if site.fold_from is not None:
            b_v = biases.get(site.fold_from)
            v_linear = sites[site.fold_from].module
            s_v = v_linear.scale[slot] if isinstance(v_linear, SlottedLinear) and v_linear.scale is not None else None
            b_v = None if b_v is None else b_v.to(site.base.device)
            value = _folded(site, sites, value, b_v, s_v, factors.get(site.name.removesuffix(".bias")))
        site.bank[slot].copy_(value)


class SlottedBackend:
    """``n_banks`` bank rows (the slots and the base encoder's) in the slotted layers of ``model`` (an HF encoder on
    its device, rewritten in place), each slot's head as its own tensors. A batch is padded and run synchronously;
    rows of one slot and one output share the pooling and the head."""

    padding_free = False

    def __init__(
        self,
        model: nn.Module,
        n_banks: int,
        *,
        base_pooling: str,
        pad_id: int,
        uses_token_types: bool,
        drop_key_bias: bool = True,
        fold_value_bias: bool = True,
    ) -> None:
        self.model, self.base_pooling, self.pad_id = model, base_pooling, pad_id
        self.uses_token_types = uses_token_types
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.index, self.sites = install_slots(
            model, n_banks, drop_key_bias=drop_key_bias, fold_value_bias=fold_value_bias
        )
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def slot_bytes(self) -> int:
        """Device bytes one resident task takes: its rows of the bias (and scale) banks; each head is its own."""
        scales = [m.scale for m in self.model.modules() if isinstance(m, SlottedLinear) and m.scale is not None]
        banks = [site.bank for site in self.sites.values() if site.bank is not None]
        return sum(bank[0].nbytes for bank in [*banks, *scales])

    def load(self, items: Sequence[tuple[int, Patch]]) -> None:
        for slot, patch in items:
            write_slot(self.sites, slot, patch.biases, patch.scales, patch.lora)
            self.heads[slot] = (
                patch.head_weight.to(self.device, self.dtype),
                patch.head_bias.to(self.device, self.dtype),
            )

    def launch(self, block: RowBlock, row_slots: np.ndarray, patch_ids: list[str]) -> Pending:
        outputs = [o.flatten().numpy() for o in self._forward(block.rows(), row_slots.tolist())]
        sizes = np.fromiter(map(len, outputs), dtype=np.int64, count=len(outputs))
        return Pending(patch_ids, outputs=RowOutputs(np.concatenate(outputs), sizes))

    def finish(self, pending: Pending) -> RowOutputs:
        assert pending.outputs is not None
        return pending.outputs

    def _forward(self, rows: Sequence[Row], slots: Sequence[int]) -> list[torch.Tensor]:
        n, t = len(rows), max(len(r.input_ids) for r in rows)
        ids = torch.full((n, t), self.pad_id, dtype=torch.long)
        types = torch.zeros((n, t), dtype=torch.long)
        mask = torch.zeros((n, t), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r.input_ids)
            ids[i, :k] = torch.tensor(r.input_ids)
            types[i, :k] = torch.tensor(r.token_type_ids)
            mask[i, :k] = 1
        ids, types, mask = ids.to(self.device), types.to(self.device), mask.to(self.device)
        self.index.rows = torch.tensor(list(slots), dtype=torch.long, device=self.device)  # [B]
        kwargs = {"token_type_ids": types} if self.uses_token_types else {}
        out = self.model(input_ids=ids, attention_mask=mask, **kwargs)
        hidden = out.last_hidden_state  # [B, T, H]
        pooler = getattr(out, "pooler_output", None)  # [B, H] or None
        results: list[torch.Tensor | None] = [None] * n
        groups: dict[tuple[int, str], list[int]] = {}  # rows of one slot and one output share the work
        for i, (s, r) in enumerate(zip(slots, rows, strict=True)):
            groups.setdefault((s, r.output), []).append(i)
        for (slot, output), members in groups.items():
            patch = rows[members[0]].patch
            sel = torch.tensor(members, device=self.device)
            if rows[members[0]].tags:
                w, b = self.heads[slot]
                logits = F.linear(hidden.index_select(0, sel), w, b)  # [n, T, C]
                for j, i in enumerate(members):
                    results[i] = logits[j, : len(rows[i].input_ids)].float().cpu()
                continue
            pooled = pool(
                self.base_pooling if patch is None else patch.meta.pooling,
                hidden.index_select(0, sel),
                mask.index_select(0, sel),
                None if pooler is None else pooler.index_select(0, sel),
            )  # [n, H]
            if output == "logits":
                w, b = self.heads[slot]
                pooled = F.linear(pooled, w, b)  # [n, C]
            values = pooled.float().cpu()
            for j, i in enumerate(members):
                results[i] = values[j]
        self.index.rows = None
        return [r for r in results if r is not None]
