"""A patch as a registry holds it, read without its tensors.

A registry's bytes were checked when they were registered, and a reader checks them against their recorded content id
(``Registry.get``), so what a reader needs at once is the metadata, the id, the bytes and the tensors' shapes (to
check the patch fits the running encoder): all in the safetensors header. The tensors are parsed and checked on first
use. A front end that serves through the engine process only forwards a patch's bytes, so it never parses them: a
task's first request costs a header read, and the host tier holds a small patch in a fifth of the memory.
"""

from __future__ import annotations

import functools
from functools import cached_property

import torch

from patchserve.patches.format import DEFAULT_MAX_PATCH_BYTES, Patch, PatchMeta, read_meta


@functools.lru_cache(maxsize=256)
def _shared_shapes(layout: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, tuple[int, ...]]:
    """One shape map for every patch of one layout (the tasks of one encoder and kind share it): a held patch then
    costs its bytes and metadata, not a copy of its tensor names (about 2 KB of a small patch's 3.6 KB of objects).
    Never changed: ``shapes`` hands out copies."""
    return dict(layout)


class StoredPatch(Patch):
    """A :class:`Patch` whose tensors are parsed from its bytes when first used (``load`` parses them now)."""

    def __init__(self, meta: PatchMeta, data: bytes, patch_id: str, shapes: dict[str, tuple[int, ...]]) -> None:
        # not the dataclass's __init__: the tensor fields are the properties below, filled from ``data``
        self.meta = meta
        self._shapes = shapes
        self.__dict__.update(data=data, patch_id=patch_id)  # Patch's cached properties, as the caller checked them

    @classmethod
    def from_stored(cls, data: bytes, patch_id: str, *, max_bytes: int = DEFAULT_MAX_PATCH_BYTES) -> StoredPatch:
        """The patch of ``data``, whose ``content_id`` the caller checked is ``patch_id``: its metadata and tensor
        keys checked as ``Patch.from_bytes`` checks them, its tensors left unread."""
        meta, header = read_meta(data, max_bytes)
        layout = tuple((key, tuple(entry["shape"])) for key, entry in header.items() if key != "__metadata__")
        return cls(meta, data, patch_id, _shared_shapes(layout))

    @cached_property
    def _tensors(self) -> Patch:
        return Patch.with_tensors(self.meta, self.data, self.patch_id)  # its metadata read once, in from_stored

    def load(self) -> StoredPatch:
        """Parse (and check) the tensors now, if not yet done."""
        _ = self._tensors
        return self

    @property
    def loaded(self) -> bool:
        """Whether the tensors were parsed."""
        return "_tensors" in self.__dict__

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    @property
    def biases(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._tensors.biases

    @property
    def head_weight(self) -> torch.Tensor:  # type: ignore[override]
        return self._tensors.head_weight

    @property
    def head_bias(self) -> torch.Tensor:  # type: ignore[override]
        return self._tensors.head_bias

    @property
    def scales(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._tensors.scales

    @property
    def lora(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._tensors.lora
