"""The runner: the only code that touches the device.

It owns the encoder's engine, the slot manager and each slot's head. The engine is the packed one
(``patches/packed.py``: padding-free, folded bias banks, heads in one bank, CUDA graphs on a GPU) for
BERT encoders, and the slotted Hugging Face model (``slotted.py``) for any other architecture.

``run(rows)`` takes already-tokenised rows of any mix of tasks and returns one float32 CPU tensor per row: logits
``[n_out]`` (or ``[n_tokens, n_out]`` for tagging), or, for a row that asks for an embedding, its pooled vector
``[hidden]`` under its task's patch. A row without a patch runs on the base encoder: one extra bank row that always
holds the base biases, never handed out as a task slot. Call it from one thread only (the batcher's worker thread).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from patches.encoder import Encoder, resolve_device
from patches.format import Patch
from patches.model import pool
from patches.packed import (
    POOL_MODES,
    HeadBank,
    PackedBert,
    add_exact_attention,
    batch_views,
    fill_layout,
    layout_size,
    packed_unsupported,
)
from server.engine.graphs import GraphSet
from server.engine.protocol import BASE_KEY
from server.engine.slots import SlotManager
from server.engine.slotted import SlottedLinear, install_slots, write_slot

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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

    @property
    def tags(self) -> bool:
        """True when the row's answer is per-token logits (a tagging patch asked for logits)."""
        return self.output == "logits" and self.patch is not None and self.patch.meta.kind == "token-classification"


@dataclass
class Pending:
    """A launched batch: its outputs, or where they will land once ``done`` has happened."""

    patch_ids: list[str]
    outputs: list[torch.Tensor] | None = None  # ready (the slotted engine runs synchronously)
    rows: list[Row] = field(default_factory=list)
    host: torch.Tensor | None = None  # flat float32 outputs on the host (pinned on CUDA)
    width: int = 0  # hidden + head width of the pooled table
    done: torch.cuda.Event | None = None


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


ENGINES = ("auto", "packed", "slotted")


class Runner:
    def __init__(
        self,
        encoder: Encoder,
        *,
        device: str = "auto",
        dtype: str = "auto",
        slots: int | None = None,
        engine: str = "auto",
        drop_key_bias: bool = True,
        fold_value_bias: bool = True,
        fold_ln_bias: bool = True,
        cuda_graphs: bool = True,
        overlap_batches: bool = False,
        max_rows: int = 256,
        max_tokens: int = 8192,
        on_load: Callable[[float], None] | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.encoder = encoder
        n_slots = slots or default_slot_count(encoder, self.device, self.dtype)
        model = encoder.model.to(self.device, self.dtype).eval()
        self.base_slot = n_slots  # bank row n_slots keeps the base biases for base-encoder rows
        self.base_pooling = encoder.default_pooling
        self.model = model
        self.slots = SlotManager(n_slots)
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pad_id = int(encoder.tokenizer.pad_token_id or 0)
        self.uses_token_types = "token_type_ids" in encoder.tokenizer.model_input_names
        self.on_load = on_load
        self.overlap = overlap_batches
        self.packed: PackedBert | None = None
        self.graphs: GraphSet | None = None
        reason = packed_unsupported(model) if engine != "slotted" else "the slotted engine was asked for"
        if engine == "packed" and reason is not None:
            raise ValueError(f"the packed engine cannot run {encoder.name}: {reason}")
        if reason is None:
            self.packed = PackedBert(
                model,
                n_slots + 1,
                drop_key_bias=drop_key_bias,
                fold_value_bias=fold_value_bias,
                fold_ln_bias=fold_ln_bias,
            )
            self.head_bank = HeadBank(n_slots + 1, encoder.hidden_size, self.device, self.dtype)
            half = self.dtype in (torch.float16, torch.bfloat16)
            self.attention = "flash" if self.device.type == "cuda" and half else "exact"
            if self.attention == "flash" and cuda_graphs:
                self.graphs = GraphSet(
                    self.packed,
                    self.head_bank,
                    max_rows=max_rows,
                    max_tokens=max_tokens,
                    max_positions=encoder.max_positions,
                )
                try:
                    self.graphs.warm()
                except RuntimeError as exc:
                    self._drop_graphs(exc)
            elif self.device.type == "cuda":
                log.info(
                    "runner: no CUDA graphs (%s)",
                    "turned off" if half else f"flash attention needs half precision, not {self.dtype}",
                )
            log.info(
                "runner: packed engine (%s attention, %d bias vectors per layer, CUDA graphs %s)",
                self.attention,
                self.packed.vectors_per_layer,
                "on" if self.graphs else "off",
            )
        else:
            log.info("runner: slotted Hugging Face engine (%s)", reason)
            self.index, self.sites = install_slots(
                model, n_slots + 1, drop_key_bias=drop_key_bias, fold_value_bias=fold_value_bias
            )
        log.info("runner: %s on %s (%s), %d slots", encoder.name, self.device, self.dtype, n_slots)

    @property
    def slot_bytes(self) -> int:
        """Device bytes one resident task takes: its rows of the bias banks and of the heads (the slotted engine
        keeps each head as its own tensor, so there its bias banks alone)."""
        if self.packed is not None:
            heads = self.head_bank.weight[0].nbytes + self.head_bank.bias[0].nbytes
            return self.packed.bank_bytes_per_slot + heads
        scales = [m.scale for m in self.model.modules() if isinstance(m, SlottedLinear) and m.scale is not None]
        banks = [site.bank for site in self.sites.values() if site.bank is not None]
        return sum(bank[0].nbytes for bank in [*banks, *scales])

    def _drop_graphs(self, exc: Exception) -> None:
        log.warning("CUDA graphs off, running the packed forward eagerly: capture failed (%s)", exc)
        self.graphs = None

    @property
    def asynchronous(self) -> bool:
        """True when the batcher should launch the next batch before finishing the last: ``overlap_batches``. On a
        GPU the packed engine's ``launch`` then returns before the device has finished."""
        return self.overlap

    def _load(self, items: Sequence[tuple[int, Patch]]) -> None:
        """Write patches into the slots just acquired for them; the packed engine folds them all in one pass. If
        that fails, their slots are forgotten (free again: none of them holds a whole patch)."""
        if not items:
            return
        t0 = time.perf_counter()
        try:
            if self.packed is not None:
                self.packed.write_slots([slot for slot, _ in items], [p.values for _, p in items])
                for slot, patch in items:
                    self.head_bank.write(slot, patch.head_weight, patch.head_bias)
            else:
                for slot, patch in items:
                    write_slot(self.sites, slot, patch.biases, patch.scales)
                    w = patch.head_weight.to(self.device, self.dtype)
                    b = patch.head_bias.to(self.device, self.dtype)
                    self.heads[slot] = (w, b)
        except BaseException:
            for _, patch in items:
                self.slots.forget(patch.patch_id)
            raise
        if self.on_load is not None:
            each = (time.perf_counter() - t0) / len(items)
            for _ in items:
                self.on_load(each)

    @torch.inference_mode()
    def preload(self, patches: Iterable[Patch], chunk: int = 256) -> int:
        """Load ``patches`` into free slots before serving, ``chunk`` at a time, until they or the free slots run
        out (nothing is evicted); returns how many slots are then in use. Call before the batcher starts (the
        runner is single-threaded); ``patches`` may be a generator, so only a chunk is held at a time."""
        source = iter(patches)
        while free := self.slots.capacity - len(self.slots):
            part = {p.patch_id: p for p in itertools.islice(source, min(chunk, free))}
            if not part:
                break
            slot_of, to_load = self.slots.acquire(list(part))
            try:
                self._load([(slot, part[pid]) for pid, slot in to_load])
            finally:
                self.slots.release(list(slot_of))
        return len(self.slots)

    def run(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Outputs of ``rows`` (launch, then wait for them)."""
        return self.finish(self.launch(rows))

    @torch.inference_mode()
    def launch(self, rows: Sequence[Row]) -> Pending:
        """Start ``rows`` on the device and return without waiting for it (on a GPU, the host can prepare the next
        batch meanwhile); ``finish`` waits and returns the outputs. Slots stay pinned until then."""
        patches = {r.patch.patch_id: r.patch for r in rows if r.patch is not None}
        slot_of, to_load = self.slots.acquire(list(patches))
        try:
            self._load([(slot, patches[pid]) for pid, slot in to_load])
            slot_of = slot_of | {BASE_KEY: self.base_slot}
            if self.packed is not None:
                return self._launch_packed(rows, slot_of, list(patches))
            return Pending(list(patches), outputs=self._forward(rows, slot_of))
        except BaseException:
            self.slots.release(list(patches))
            raise

    @torch.inference_mode()
    def finish(self, pending: Pending) -> list[torch.Tensor]:
        try:
            if pending.outputs is not None:
                return pending.outputs
            if pending.done is not None:
                pending.done.synchronize()
            return self._decode(pending)
        finally:
            self.slots.release(pending.patch_ids)

    def _launch_packed(self, rows: Sequence[Row], slot_of: dict[str, int], patch_ids: list[str]) -> Pending:
        assert self.packed is not None
        ids = [r.input_ids for r in rows]
        types = [r.token_type_ids for r in rows]
        lengths = [len(x) for x in ids]
        row_slots = [slot_of[r.key] for r in rows]
        modes = [POOL_MODES[self.base_pooling if r.patch is None else r.patch.meta.pooling] for r in rows]
        n_real, n_rows = sum(lengths), len(rows)
        cuda = self.device.type == "cuda"
        bucket = self.graphs.bucket(n_real, n_rows) if self.graphs is not None else None
        graphed = None
        if self.graphs is not None and bucket is not None:
            staging = self.graphs.staging(bucket)
            fill_layout(staging.numpy(), ids, types, row_slots, modes, bucket, self.graphs.rows, self.base_slot)
            try:
                graphed = self.graphs.run(bucket, staging)
            except RuntimeError as exc:  # a capture this torch/driver cannot do: serve eagerly from now on
                self._drop_graphs(exc)
        if graphed is not None:
            hidden, pooled = graphed
        else:
            flat = torch.empty(layout_size(n_real, n_rows), dtype=torch.int32, pin_memory=cuda)
            fill_layout(flat.numpy(), ids, types, row_slots, modes, n_real, n_rows, self.base_slot)
            batch = batch_views(flat.to(self.device, non_blocking=True), n_real, n_rows, max(lengths))
            if self.attention == "exact":
                add_exact_attention(batch, lengths)
            hidden = self.packed.encode(batch, self.attention)
            pooled = self.packed.pool(hidden, batch, self.head_bank)
        pooled = pooled[:n_rows]
        tagging = [i for i, r in enumerate(rows) if r.tags]
        parts = [pooled.flatten()]
        if tagging:  # per-token logits of the tagging rows only, from the same bank of heads
            starts = [0, *itertools.accumulate(lengths)]
            tokens = [t for i in tagging for t in range(starts[i], starts[i + 1])]
            tok_slots = [row_slots[i] for i in tagging for _ in range(lengths[i])]
            idx = torch.tensor([tokens, tok_slots], dtype=torch.long).to(self.device)
            parts.append(self.packed.tag(hidden, idx[0], idx[1], self.head_bank).flatten())
        flat_out = torch.cat(parts).float()
        if not (cuda and self.overlap):  # the batch's one device-to-host copy, waited for here
            return Pending(patch_ids, rows=list(rows), host=flat_out.cpu(), width=int(pooled.shape[1]))
        host = torch.empty(flat_out.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(flat_out, non_blocking=True)  # the batch's one device-to-host copy, waited for in finish()
        done = torch.cuda.Event()
        done.record()
        return Pending(patch_ids, rows=list(rows), host=host, width=int(pooled.shape[1]), done=done)

    def _decode(self, p: Pending) -> list[torch.Tensor]:
        assert self.packed is not None and p.host is not None
        rows, host, width, h = p.rows, p.host, p.width, self.packed.hidden
        n_rows = len(rows)
        table = host[: n_rows * width].view(n_rows, width)
        results: list[torch.Tensor] = []
        tag_at, tag_width = n_rows * width, width - h
        for i, r in enumerate(rows):
            if r.output == "embedding" or r.patch is None:
                results.append(table[i, :h].clone())
            elif r.tags:
                n_out, k = r.patch.head_weight.shape[0], len(r.input_ids)
                block = host[tag_at : tag_at + k * tag_width].view(k, tag_width)
                results.append(block[:, :n_out].clone())
                tag_at += k * tag_width
            else:
                results.append(table[i, h : h + r.patch.head_weight.shape[0]].clone())
        return results

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
            if rows[members[0]].tags:
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
