"""A patch file's bytes below their meaning (``format.py`` gives them that): the safetensors header read without
touching the tensor data, the content id of the bytes, and whether tensor shapes fit an encoder's."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

from patchserve.patches.errors import PatchCorruptError, PatchKeysError, PatchShapeError
from patchserve.patches.validation import shown, strict_json

_MAX_HEADER_BYTES = 1024 * 1024
_MAX_TENSORS = 4096  # BERT-large with every bias is ~400


def check_fit(
    what: str, got: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]], unknown: str
) -> None:
    """Refuse a patch's biases or scales (``got``: their shapes by name) where the encoder has no such parameter or
    another shape."""
    extra = sorted(set(got) - set(shapes))
    if extra:
        example = next(iter(shapes), "(none)")
        raise PatchKeysError(f"patch {unknown}: {extra[:5]} (this encoder's {what} names look like {example!r})")
    for name, shape in got.items():
        if tuple(shape) != tuple(shapes[name]):
            raise PatchShapeError(f"{what} {name!r} has shape {tuple(shape)}, the encoder's has {tuple(shapes[name])}")


def content_id(data: bytes) -> str:
    """The id of a patch's canonical bytes (``Patch.patch_id``): ``sha256:`` and their hex digest."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_header(data: bytes) -> dict[str, Any]:
    """Parse the safetensors header (8-byte little-endian length + JSON) without touching tensor data."""
    if len(data) < 8:
        raise PatchCorruptError(f"patch is only {len(data)} bytes: truncated or not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER_BYTES:
        raise PatchCorruptError(
            f"patch header is {n} bytes, over the {_MAX_HEADER_BYTES}-byte limit: not a patch file (a patch's "
            "header is a few kilobytes)"
        )
    if 8 + n > len(data):
        raise PatchCorruptError(
            "patch header length does not fit the file: the file is truncated or not a safetensors file"
        )
    header = strict_json(data[8 : 8 + n], "patch header (the file is damaged)", PatchCorruptError)
    if not isinstance(header, dict):
        raise PatchCorruptError("patch header is not a JSON object: the file is damaged")
    if len(header) > _MAX_TENSORS + 1:
        raise PatchCorruptError(
            f"patch has {len(header) - 1} tensors, over the limit of {_MAX_TENSORS}: not a BitFit patch"
        )
    ends = []
    for key, v in header.items():
        offsets = v.get("data_offsets") if isinstance(v, dict) and key != "__metadata__" else None
        if offsets is None:
            continue
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            raise PatchCorruptError(f"tensor {shown(key)} has malformed data offsets: the file is damaged")
        ends.append(offsets[1])
    if ends and 8 + n + max(ends) > len(data):
        raise PatchCorruptError("patch tensor data is cut short: the file is truncated, copy it again")
    return header
