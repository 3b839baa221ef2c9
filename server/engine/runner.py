"""The runner: the only code that touches the device. It keeps the slots and dispatches batches to its backend.

The backend is the packed engine (``packed_backend.py``: padding-free, folded bias banks, heads in one bank, CUDA
graphs on a GPU) for BERT encoders, and the slotted Hugging Face model (``slotted.py``) for any other architecture.

``launch(block)`` / ``finish`` take already-tokenised rows of any mix of tasks as a ``RowBlock`` and return their
outputs as one array (``RowOutputs``); ``run(rows)`` does both and returns one float32 CPU tensor per row: logits
``[n_out]`` (or ``[n_tokens, n_out]`` for tagging), or, for a row that asks for an embedding, its pooled vector
``[hidden]`` under its task's patch. A row without a patch runs on the base encoder: one extra bank row that always
holds the base biases, never handed out as a task slot. Call it from one thread only (the batcher's worker thread).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from patchserve.patches.encoder import Encoder, resolve_device
from patchserve.patches.format import Patch
from patchserve.patches.packed import packed_unsupported
from patchserve.server.engine.backend import Backend, Pending
from patchserve.server.engine.packed_backend import PackedBackend
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.rows import RowBlock, RowOutputs
from patchserve.server.engine.slots import SlotManager
from patchserve.server.engine.slotted import SlottedBackend
from patchserve.server.settings import available_memory

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ENGINES = ("auto", "packed", "slotted")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def default_slot_count(encoder: Encoder, device: torch.device, dtype: torch.dtype) -> int:
    """As many slots as 1% of the available host memory holds on the CPU (256..4096: a slot costs memory, never
    time, and a task kept resident costs no fold on its next request: +13% zipf(1.1) traffic over 10,000 tasks
    with 4096 slots against 256, docs/experiments.md); as 5% of the free memory on a GPU (64..4096)."""
    per_slot = sum(s[0] for s in encoder.spec.bias_shapes.values()) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda":
        return max(256, min(4096, int(0.01 * available_memory() / max(per_slot, 1))))
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
        self.slots = SlotManager(n_slots)
        self.on_load = on_load
        self.asynchronous = overlap_batches  # the batcher launches the next batch before finishing the last
        reason = packed_unsupported(model) if engine != "slotted" else "the slotted engine was asked for"
        if engine == "packed" and reason is not None:
            raise ValueError(f"the packed engine cannot run {encoder.name}: {reason}")
        self.backend: Backend
        if reason is None:
            self.backend = PackedBackend(
                model,
                n_slots + 1,
                hidden_size=encoder.hidden_size,
                max_positions=encoder.max_positions,
                base_pooling=encoder.default_pooling,
                fill_slot=self.base_slot,
                drop_key_bias=drop_key_bias,
                fold_value_bias=fold_value_bias,
                fold_ln_bias=fold_ln_bias,
                cuda_graphs=cuda_graphs,
                overlap=overlap_batches,
                max_rows=max_rows,
                max_tokens=max_tokens,
            )
        else:
            log.info("runner: slotted Hugging Face engine (%s)", reason)
            self.backend = SlottedBackend(
                model,
                n_slots + 1,
                base_pooling=encoder.default_pooling,
                pad_id=int(encoder.tokenizer.pad_token_id or 0),
                uses_token_types="token_type_ids" in encoder.tokenizer.model_input_names,
                drop_key_bias=drop_key_bias,
                fold_value_bias=fold_value_bias,
            )
        log.info("runner: %s on %s (%s), %d slots", encoder.name, self.device, self.dtype, n_slots)

    @property
    def path(self) -> str:
        """Which engine serves: 'packed' or 'slotted'."""
        return "packed" if isinstance(self.backend, PackedBackend) else "slotted"

    @property
    def slot_bytes(self) -> int:
        """Device bytes one resident task takes (the backend's banks and heads)."""
        return self.backend.slot_bytes

    @property
    def padding_free(self) -> bool:
        """A batch costs its real tokens (the packed engine), not its padded ones."""
        return self.backend.padding_free

    def _load(self, items: Sequence[tuple[int, Patch]]) -> None:
        """Write patches into the slots just acquired for them. If that fails, their slots are forgotten (free
        again: none of them holds a whole patch)."""
        if not items:
            return
        t0 = time.perf_counter()
        try:
            self.backend.load(items)
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

    def run(self, rows: Sequence[Row] | RowBlock) -> list[torch.Tensor]:
        """Outputs of ``rows`` (launch, then wait for them), one float32 tensor per row."""
        block = rows if isinstance(rows, RowBlock) else RowBlock.from_rows(rows)
        outputs = self.finish(self.launch(block))
        return [torch.from_numpy(o) for o in outputs.split(block.lengths.tolist(), block.tags().tolist())]

    @torch.inference_mode()
    def launch(self, block: RowBlock) -> Pending:
        """Start the rows of ``block`` on the device and return without waiting for it (on a GPU, the host can
        prepare the next batch meanwhile); ``finish`` waits and returns the outputs. Slots stay pinned until
        then."""
        patches, keys = block.used_patches()
        if len(patches) != len(block.patches):
            block = RowBlock(block.tokens, block.types, block.lengths, keys, patches, block.embed)
        ids = [p.patch_id for p in patches]
        slot_of, to_load = self.slots.acquire(ids)
        try:
            by_id = dict(zip(ids, patches, strict=True))
            self._load([(slot, by_id[pid]) for pid, slot in to_load])
            row_slots = block.per_patch([slot_of[pid] for pid in ids], self.base_slot)
            return self.backend.launch(block, row_slots, ids)
        except BaseException:
            self.slots.release(ids)
            raise

    def finish(self, pending: Pending) -> RowOutputs:  # host arrays only: no torch mode to enter
        try:
            return self.backend.finish(pending)
        finally:
            self.slots.release(pending.patch_ids)
