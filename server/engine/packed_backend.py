"""The packed backend: BERT encoders served padding-free (``patches/packed.py``), every task's folded biases and
head in banks gathered per row, one batch a fixed sequence of device ops that CUDA graphs capture on a GPU."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from patchserve.patches.format import Patch
from patchserve.patches.packed import POOL_MODES, HeadBank, PackedBert
from patchserve.patches.packed_layout import batch_views, exact_attention, fill_layout, layout_size
from patchserve.server.engine.backend import Pending
from patchserve.server.engine.graphs import GraphSet
from patchserve.server.engine.rows import RowBlock, RowOutputs, gather_rows

log = logging.getLogger(__name__)


class PackedBackend:
    """``n_banks`` bank rows (the slots and the base encoder's) over ``model`` on its device and dtype. On CUDA in
    half precision, flash attention over the packed rows and, with ``cuda_graphs``, captured forwards per
    token-count bucket; elsewhere the exact attention path. ``overlap``: a launch on CUDA returns before the device
    has finished (``finish`` waits on an event)."""

    padding_free = True

    def __init__(
        self,
        model: nn.Module,
        n_banks: int,
        *,
        hidden_size: int,
        max_positions: int,
        base_pooling: str,
        fill_slot: int,
        drop_key_bias: bool = True,
        fold_value_bias: bool = True,
        fold_ln_bias: bool = True,
        cuda_graphs: bool = True,
        overlap: bool = False,
        max_rows: int = 256,
        max_tokens: int = 8192,
    ) -> None:
        self.packed = PackedBert(
            model, n_banks, drop_key_bias=drop_key_bias, fold_value_bias=fold_value_bias, fold_ln_bias=fold_ln_bias
        )
        self.device, self.dtype = self.packed.device, self.packed.dtype
        self.head_bank = HeadBank(n_banks, hidden_size, self.device, self.dtype)
        self.base_pooling, self.fill_slot, self.overlap = base_pooling, fill_slot, overlap
        # what a batch needs to know of each bank row's task, as arrays indexed by slot (written in ``load``), so a
        # batch looks it up per row with no Python per patch: its pooling mode, its head's width, whether it tags
        self.slot_mode = np.full(n_banks, POOL_MODES[base_pooling], dtype=np.int64)
        self.slot_width = np.zeros(n_banks, dtype=np.int64)
        self.slot_tags = np.zeros(n_banks, dtype=bool)
        half = self.dtype in (torch.float16, torch.bfloat16)
        self.attention = "flash" if self.device.type == "cuda" and half else "exact"
        self.graphs: GraphSet | None = None
        if self.attention == "flash" and cuda_graphs:
            self.graphs = GraphSet(
                self.packed, self.head_bank, max_rows=max_rows, max_tokens=max_tokens, max_positions=max_positions
            )
            try:
                self.graphs.warm()
            except RuntimeError as exc:
                self._drop_graphs(exc)
        elif self.device.type == "cuda":
            why = "turned off" if half else f"flash attention needs half precision, not {self.dtype}"
            log.info("runner: no CUDA graphs (%s)", why)
        log.info(
            "runner: packed engine (%s attention, %d bias vectors per layer, CUDA graphs %s)",
            self.attention,
            self.packed.vectors_per_layer,
            "on" if self.graphs else "off",
        )

    def _drop_graphs(self, exc: Exception) -> None:
        log.warning("CUDA graphs off, running the packed forward eagerly: capture failed (%s)", exc)
        self.graphs = None

    @property
    def slot_bytes(self) -> int:
        """Device bytes one resident task takes: its rows of the bias banks and of the heads."""
        return self.packed.bank_bytes_per_slot + self.head_bank.weight[0].nbytes + self.head_bank.bias[0].nbytes

    def load(self, items: Sequence[tuple[int, Patch]]) -> None:
        """Fold every patch's biases in one pass and write them and the heads into their slots."""
        self.packed.write_slots([slot for slot, _ in items], [p.values for _, p in items])
        for slot, patch in items:
            self.head_bank.write(slot, patch.head_weight, patch.head_bias)
            self.slot_mode[slot] = POOL_MODES[patch.meta.pooling]
            self.slot_width[slot] = patch.head_weight.shape[0]
            self.slot_tags[slot] = patch.meta.kind == "token-classification"

    def launch(self, block: RowBlock, row_slots: np.ndarray, patch_ids: list[str]) -> Pending:
        """One forward of ``block``: pooled vectors and head logits of every row, per-token logits of tagging rows,
        copied to the host in one transfer (waited for here, or with ``overlap`` on CUDA in ``finish``)."""
        lengths = block.lengths
        modes = self.slot_mode[row_slots]
        n_real, n_rows = block.n_tokens, len(block)
        cuda = self.device.type == "cuda"
        bucket = self.graphs.bucket(n_real, n_rows) if self.graphs is not None else None
        graphed = None
        if self.graphs is not None and bucket is not None:
            staging = self.graphs.staging(bucket)
            fill_layout(staging.numpy(), block, row_slots, modes, bucket, self.graphs.rows, self.fill_slot)
            try:
                graphed = self.graphs.run(bucket, staging)
            except RuntimeError as exc:  # a capture this torch/driver cannot do: serve eagerly from now on
                self._drop_graphs(exc)
        if graphed is not None:
            hidden, pooled = graphed
        else:
            flat = torch.empty(layout_size(n_real, n_rows), dtype=torch.int32, pin_memory=cuda)
            fill_layout(flat.numpy(), block, row_slots, modes, n_real, n_rows, self.fill_slot)
            batch = batch_views(flat.to(self.device, non_blocking=True), n_real, n_rows, int(lengths.max()))
            if self.attention == "exact":
                exact_attention(batch, lengths.tolist(), self.packed.n_heads)
            hidden = self.packed.encode(batch, self.attention)
            pooled = self.packed.pool(hidden, batch, self.head_bank)
        pooled = pooled[:n_rows]
        tags = self.slot_tags[row_slots] & ~block.embed  # rows answered with per-token logits
        parts = [pooled.flatten()]
        if tags.any():  # per-token logits of the tagging rows only, from the same bank of heads
            mask = block.token_mask(tags)
            tokens = np.flatnonzero(mask)
            tok_slots = np.repeat(row_slots, lengths)[mask]
            idx = torch.from_numpy(np.stack([tokens, tok_slots])).to(self.device)
            parts.append(self.packed.tag(hidden, idx[0], idx[1], self.head_bank).flatten())
        flat_out = torch.cat(parts).float()
        width = int(pooled.shape[1])
        pending = Pending(patch_ids, block=block, width=width, tags=tags, row_slots=row_slots)
        if not (cuda and self.overlap):  # the batch's one device-to-host copy, waited for here
            pending.host = flat_out.cpu()
            return pending
        pending.host = torch.empty(flat_out.shape, dtype=torch.float32, pin_memory=True)
        pending.host.copy_(flat_out, non_blocking=True)  # the batch's one device-to-host copy, waited for in finish()
        pending.done = torch.cuda.Event()
        pending.done.record()
        return pending

    def finish(self, pending: Pending) -> RowOutputs:
        """Each row's output from the batch's flat host copy, in one gather: its pooled vector (an embedding, or a
        row without a patch), its per-token logits (tagging) or its head's logits. A batch without tagging rows (the
        common case) takes a boolean mask over its ``[rows, width]`` block instead: about a third of the array
        operations, each of which costs several microseconds just after a forward has evicted the host's caches."""
        if pending.done is not None:
            pending.done.synchronize()
        block, host, width, h, tags = pending.block, pending.host, pending.width, self.packed.hidden, pending.tags
        assert host is not None and block is not None and tags is not None
        n_rows = len(block)
        assert pending.row_slots is not None
        n_out = self.slot_width[pending.row_slots]
        pooled = block.embed | (block.keys < 0)
        line = np.where(pooled, h, n_out)
        first = np.where(pooled, 0, h)  # where a row's line starts in its row of the block
        if not tags.any():  # one line a row, in its own row of the block
            cols = np.arange(width)
            keep = (cols >= first[:, None]) & (cols < (first + line)[:, None])
            return RowOutputs(host.numpy().reshape(n_rows, width)[keep], line)
        row = np.arange(n_rows, dtype=np.int64)
        base = row * width + first
        n_lines = np.where(tags, block.lengths, 1)
        tag_width = width - h
        tag_tokens = np.where(tags, block.lengths, 0)
        tag_first = n_rows * width + (np.cumsum(tag_tokens) - tag_tokens) * tag_width
        base = np.where(tags, tag_first, base)
        return gather_rows(host.numpy(), base, n_lines, line, np.full(n_rows, tag_width, dtype=np.int64))
