"""The runner: the only code that touches the device.

It owns the slotted encoder, the slot manager and each slot's head. ``run(rows)`` takes already-tokenised rows of
any mix of tasks and returns one float32 CPU tensor per row: logits ``[n_out]`` (or ``[n_tokens, n_out]`` for
tagging), or, for a row that asks for an embedding, its pooled vector ``[hidden]`` under its task's patch. A row
without a patch runs on the base encoder: one extra bank row that always holds the base biases, never handed out
as a task slot. Call it from one thread only (the batcher's worker thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from patches.encoder import Encoder, resolve_device
from patches.format import Patch
from patches.model import pool
from server.engine.slots import SlotManager
from server.engine.slotted import install_slots, write_slot

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


BASE_KEY = "base"  # the key of rows without a patch (the base encoder); patch ids are "sha256:..."
OUTPUTS = ("logits", "embedding")


@dataclass
class Row:
    """One tokenised input for one task (``patch``, resolved when the request arrives: hot swap semantics), or for
    the base encoder (``patch`` None, embeddings only). ``output``: the head's ``logits`` or the pooled
    ``embedding``."""

    input_ids: list[int]
    token_type_ids: list[int]
    patch: Patch | None
    output: str = "logits"

    @property
    def key(self) -> str:
        """Which biases the row runs with: its patch id, or BASE_KEY."""
        return BASE_KEY if self.patch is None else self.patch.patch_id


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def default_slot_count(encoder: Encoder, device: torch.device, dtype: torch.dtype) -> int:
    """256 slots on the CPU; on a GPU as many as 5% of free memory holds (64..4096)."""
    if device.type != "cuda":
        return 256
    per_slot = sum(s[0] for s in encoder.spec.bias_shapes.values()) * torch.empty((), dtype=dtype).element_size()
    free, _total = torch.cuda.mem_get_info(device)
    return max(64, min(4096, int(0.05 * free / max(per_slot, 1))))


class Runner:
    def __init__(
        self,
        encoder: Encoder,
        *,
        device: str = "auto",
        dtype: str = "auto",
        slots: int | None = None,
        drop_key_bias: bool = True,
        fold_value_bias: bool = True,
        on_load: Callable[[float], None] | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.encoder = encoder
        n_slots = slots or default_slot_count(encoder, self.device, self.dtype)
        model = encoder.model.to(self.device, self.dtype).eval()
        self.index, self.sites = install_slots(  # bank row n_slots keeps the base biases for base-encoder rows
            model, n_slots + 1, drop_key_bias=drop_key_bias, fold_value_bias=fold_value_bias
        )
        self.base_slot = n_slots
        self.base_pooling = encoder.default_pooling
        self.model = model
        self.slots = SlotManager(n_slots)
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pad_id = int(encoder.tokenizer.pad_token_id or 0)
        self.uses_token_types = "token_type_ids" in encoder.tokenizer.model_input_names
        self.on_load = on_load
        log.info("runner: %s on %s (%s), %d slots", encoder.name, self.device, self.dtype, n_slots)

    def _load(self, slot: int, patch: Patch) -> None:
        t0 = time.perf_counter()
        write_slot(self.sites, slot, patch.biases)
        w = patch.head_weight.to(self.device, self.dtype)
        b = patch.head_bias.to(self.device, self.dtype)
        self.heads[slot] = (w, b)
        if self.on_load is not None:
            self.on_load(time.perf_counter() - t0)

    @torch.inference_mode()
    def run(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        patches = {r.patch.patch_id: r.patch for r in rows if r.patch is not None}
        slot_of, to_load = self.slots.acquire(list(patches))
        try:
            for pid, slot in to_load:
                try:
                    self._load(slot, patches[pid])
                except BaseException:
                    self.slots.forget(pid)
                    raise
            return self._forward(rows, slot_of | {BASE_KEY: self.base_slot})
        finally:
            self.slots.release(list(patches))

    def _forward(self, rows: Sequence[Row], slot_of: dict[str, int]) -> list[torch.Tensor]:
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
        slots = [slot_of[r.key] for r in rows]
        self.index.rows = torch.tensor(slots, dtype=torch.long, device=self.device)  # [B]
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
            if output == "logits" and patch is not None and patch.meta.kind == "token-classification":
                w, b = self.heads[slot]
                logits = torch.nn.functional.linear(hidden.index_select(0, sel), w, b)  # [n, T, C]
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
                pooled = torch.nn.functional.linear(pooled, w, b)  # [n, C]
            values = pooled.float().cpu()
            for j, i in enumerate(members):
                results[i] = values[j]
        self.index.rows = None
        return [r for r in results if r is not None]
