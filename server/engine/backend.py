"""What the runner asks of an engine backend: load patches into slots, launch a batch of rows, finish it.

Two backends implement it: the packed engine (``packed_backend.PackedBackend``: padding-free, folded bias banks,
heads in one bank, CUDA graphs on a GPU) for BERT encoders, and the slotted Hugging Face model
(``slotted.SlottedBackend``) for any other architecture. The runner keeps the slots and the dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from patchserve.patches.format import Patch
from patchserve.server.engine.rows import RowBlock, RowOutputs


@dataclass
class Pending:
    """A launched batch: its outputs, or where they will land once ``done`` has happened."""

    patch_ids: list[str]  # the patches whose slots stay pinned until the batch is finished
    outputs: RowOutputs | None = None  # ready (the slotted engine runs synchronously)
    block: RowBlock | None = None
    tags: np.ndarray | None = None  # bool [rows]: the rows answered with per-token logits
    row_slots: np.ndarray | None = None  # int [rows]: each row's slot (pinned until the batch is finished)
    host: torch.Tensor | None = None  # flat float32 outputs on the host (pinned on CUDA)
    width: int = 0  # hidden + head width of the pooled table
    done: torch.cuda.Event | None = None

    def ready(self) -> bool:
        """The device has finished the batch (``finish`` would not wait); a batch without an event has."""
        return self.done is None or self.done.query()


class Backend(Protocol):
    """An engine over the frozen encoder with one bank row per slot (and one more for the base encoder)."""

    #: a batch costs its real tokens (True: no padding reaches a matrix product), or its padded ones
    padding_free: bool

    @property
    def slot_bytes(self) -> int:
        """Device bytes one resident task takes."""
        ...

    def load(self, items: Sequence[tuple[int, Patch]]) -> None:
        """Write each patch into its slot (bias banks and head)."""
        ...

    def launch(self, block: RowBlock, row_slots: np.ndarray, patch_ids: list[str]) -> Pending:
        """Start the rows of ``block`` (each with its slot) on the device; on a GPU it may return before the device
        finishes."""
        ...

    def finish(self, pending: Pending) -> RowOutputs:
        """Wait for a launched batch and return its rows' float32 outputs."""
        ...
