"""The patch file format: one ``.safetensors`` file per patch version.

This module is the ONLY place that knows tensor key names and the header layout. A file holds

* ``bias.<encoder parameter name>``  float32 ``[dim]``  -- the trained value of each targeted bias
  (e.g. ``bias.encoder.layer.0.attention.self.query.bias``); untargeted biases keep the base value;
* ``head.weight`` float32 ``[n_out, hidden]`` and ``head.bias`` float32 ``[n_out]`` -- the task head;
* one metadata entry ``"patchserve"`` in the safetensors header: canonical JSON of :class:`PatchMeta`.

A single metadata key keeps serialisation byte-deterministic (safetensors writes several keys in hash order),
so the patch id -- sha256 of the canonical bytes -- is a true content hash. New patch kinds (adapters, LoRA, per
the unified PETL view) can add key prefixes and a ``patch_type`` without changing how existing files read.
Nothing here unpickles: safetensors holds raw tensors only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from patches.errors import (
    FingerprintMismatchError,
    InvalidTaskNameError,
    PatchCorruptError,
    PatchError,
    PatchKeysError,
    PatchMetadataError,
    PatchShapeError,
    PatchTooLargeError,
    PatchValueError,
    PatchVersionError,
)

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = frozenset({1})
METADATA_KEY = "patchserve"
PATCH_TYPE = "bitfit"
FILE_SUFFIX = ".safetensors"
BIAS_PREFIX = "bias."
HEAD_WEIGHT = "head.weight"
HEAD_BIAS = "head.bias"
DEFAULT_MAX_PATCH_BYTES = 64 * 1024 * 1024
_MAX_HEADER_BYTES = 8 * 1024 * 1024

KINDS = ("classification", "regression", "token-classification")
POOLINGS = ("mean", "cls", "pooler")
TASK_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_task_name(name: str) -> str:
    """Return ``name`` if it is a legal task name, else raise :class:`InvalidTaskNameError`.

    Task names become file names and Redis keys, so: 1-64 characters of letters, digits, ``_ . -``,
    starting with a letter or digit, and no ``..`` (no path traversal).
    """
    if not isinstance(name, str) or not TASK_NAME_RE.match(name) or ".." in name:
        raise InvalidTaskNameError(
            f"invalid task name {name!r}: use 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


@dataclass(frozen=True)
class BaseRef:
    """Which frozen encoder a patch was trained on."""

    name: str
    fingerprint: str


@dataclass(frozen=True)
class BaseSpec:
    """What a loaded encoder accepts: its identity and the shape of every bias it has."""

    name: str
    fingerprint: str
    hidden_size: int
    bias_shapes: Mapping[str, tuple[int, ...]]


@dataclass
class PatchMeta:
    """Everything about a patch that is not a tensor. Stored as canonical JSON in the file header."""

    task: str
    kind: str
    labels: list[str]
    base: BaseRef
    bias_subset: str
    pooling: str
    max_seq_length: int
    metrics: dict[str, float] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    format_version: int = FORMAT_VERSION
    patch_type: str = PATCH_TYPE

    @property
    def n_outputs(self) -> int:
        """Width of the head: one score per label, or 1 for regression."""
        return 1 if self.kind == "regression" else len(self.labels)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> PatchMeta:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PatchMetadataError(f"patch metadata is not valid JSON ({exc}); re-export the patch") from exc
        if not isinstance(raw, dict):
            raise PatchMetadataError("patch metadata must be a JSON object; re-export the patch")
        version = raw.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise PatchVersionError(
                f"patch format version {version!r} is not supported by this build (reads "
                f"{sorted(SUPPORTED_FORMAT_VERSIONS)}); upgrade patchserve or re-export the patch"
            )
        if raw.get("patch_type") != PATCH_TYPE:
            raise PatchMetadataError(
                f"patch type {raw.get('patch_type')!r} is not supported (only {PATCH_TYPE!r}); upgrade patchserve"
            )
        names = {f for f in cls.__dataclass_fields__}
        unknown, missing = (
            set(raw) - names,
            {"task", "kind", "labels", "base", "bias_subset", "pooling", "max_seq_length"} - set(raw),
        )
        if unknown or missing:
            raise PatchMetadataError(
                f"patch metadata has unknown fields {sorted(unknown)} / lacks fields {sorted(missing)}; "
                "re-export the patch with this version of patchserve"
            )
        base = raw.get("base")
        if not isinstance(base, dict) or set(base) != {"name", "fingerprint"}:
            raise PatchMetadataError('patch metadata "base" must be {"name": ..., "fingerprint": ...}')
        meta = cls(**{**raw, "base": BaseRef(**base)})
        meta.validate()
        return meta

    def validate(self) -> None:
        """Check field types and cross-field rules; raise :class:`PatchMetadataError` naming the field."""

        def bad(msg: str) -> PatchMetadataError:
            return PatchMetadataError(f"patch metadata: {msg}")

        try:
            validate_task_name(self.task)
        except InvalidTaskNameError as exc:
            raise bad(str(exc)) from exc
        if self.kind not in KINDS:
            raise bad(f"kind {self.kind!r} is not one of {list(KINDS)}")
        if not isinstance(self.labels, list) or not all(isinstance(x, str) and x for x in self.labels):
            raise bad("labels must be a list of non-empty strings")
        if len(set(self.labels)) != len(self.labels):
            raise bad(f"labels must be unique, got {self.labels}")
        if self.kind == "classification" and len(self.labels) < 2:
            raise bad("a classification patch needs at least 2 labels")
        if self.kind == "token-classification" and len(self.labels) < 1:
            raise bad("a token-classification patch needs at least 1 label")
        if self.kind == "regression" and len(self.labels) > 1:
            raise bad("a regression patch has at most one label (the name of its score)")
        if self.pooling not in POOLINGS:
            raise bad(f"pooling {self.pooling!r} is not one of {list(POOLINGS)}")
        if not isinstance(self.max_seq_length, int) or not 1 <= self.max_seq_length <= 65536:
            raise bad(f"max_seq_length must be an integer in 1..65536, got {self.max_seq_length!r}")
        if not isinstance(self.bias_subset, str) or not self.bias_subset:
            raise bad("bias_subset must be a non-empty string")
        if not (
            isinstance(self.base.name, str)
            and isinstance(self.base.fingerprint, str)
            and self.base.fingerprint.startswith("sha256:")
        ):
            raise bad('base must name the encoder and carry its "sha256:..." fingerprint')
        if not isinstance(self.metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v) for k, v in self.metrics.items()
        ):
            raise bad("metrics must map names to finite numbers")
        if not isinstance(self.training, dict):
            raise bad("training must be an object")
        if not isinstance(self.created_at, str):
            raise bad("created_at must be an ISO-8601 string")


@dataclass
class Patch:
    """A task's BitFit patch: trained bias values, a linear head and metadata.

    ``biases`` maps encoder parameter names (``encoder.layer.0.attention.self.query.bias``) to ``[dim]`` float32;
    ``head_weight`` is ``[n_out, hidden]`` and ``head_bias`` ``[n_out]``.
    """

    meta: PatchMeta
    biases: dict[str, torch.Tensor]
    head_weight: torch.Tensor
    head_bias: torch.Tensor

    def __post_init__(self) -> None:
        self.meta.validate()
        self._check_tensors()

    # --- identity & size ----------------------------------------------------------------------------------
    @cached_property
    def data(self) -> bytes:
        """Canonical bytes of this patch (what is written to disk / Redis)."""
        tensors = {
            BIAS_PREFIX + name: t.detach().to("cpu", torch.float32).contiguous() for name, t in self.biases.items()
        }
        tensors[HEAD_WEIGHT] = self.head_weight.detach().to("cpu", torch.float32).contiguous()
        tensors[HEAD_BIAS] = self.head_bias.detach().to("cpu", torch.float32).contiguous()
        return st_save(tensors, metadata={METADATA_KEY: self.meta.to_json()})

    @cached_property
    def patch_id(self) -> str:
        """Content hash: sha256 of the canonical bytes. Caches and slots are keyed by it."""
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    @property
    def n_params(self) -> int:
        """Number of values the patch carries (biases + head)."""
        return sum(t.numel() for t in self.biases.values()) + self.head_weight.numel() + self.head_bias.numel()

    # --- (de)serialisation -------------------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = DEFAULT_MAX_PATCH_BYTES) -> Patch:
        """Parse and strictly validate patch bytes. Never unpickles; raises a specific :class:`PatchError`."""
        if len(data) > max_bytes:
            raise PatchTooLargeError(
                f"patch is {len(data)} bytes, over the {max_bytes}-byte limit; a BitFit patch is normally well "
                "under 1 MB -- check that you are sending a patch file, not model weights"
            )
        header = _read_header(data)
        meta_text = (header.get("__metadata__") or {}).get(METADATA_KEY)
        if not isinstance(meta_text, str):
            raise PatchMetadataError(
                f"the safetensors header has no {METADATA_KEY!r} metadata: this is not a patchserve patch "
                "(export patches with `patchserve train` or patches.bitfit.extract_patch)"
            )
        meta = PatchMeta.from_json(meta_text)
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise PatchCorruptError(f"patch tensors cannot be read ({exc}); the file is damaged, re-export it") from exc
        for key in (HEAD_WEIGHT, HEAD_BIAS):
            if key not in tensors:
                raise PatchKeysError(f"patch lacks the tensor {key!r}; re-export the patch")
        unknown = sorted(k for k in tensors if k not in (HEAD_WEIGHT, HEAD_BIAS) and not k.startswith(BIAS_PREFIX))
        if unknown:
            raise PatchKeysError(
                f"patch has unknown tensor keys {unknown[:5]}; a patch holds only '{BIAS_PREFIX}<param>', "
                f"{HEAD_WEIGHT!r} and {HEAD_BIAS!r}"
            )
        biases = {k[len(BIAS_PREFIX) :]: v for k, v in tensors.items() if k.startswith(BIAS_PREFIX)}
        return cls(meta=meta, biases=biases, head_weight=tensors[HEAD_WEIGHT], head_bias=tensors[HEAD_BIAS])

    @classmethod
    def read(cls, path: str | Path, *, max_bytes: int = DEFAULT_MAX_PATCH_BYTES) -> Patch:
        """``from_bytes`` of a file; a :class:`PatchError` that names the file when it cannot be read or used."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise PatchError(f"cannot read {path}: {exc.strerror}") from exc
        try:
            return cls.from_bytes(data, max_bytes=max_bytes)
        except PatchError as exc:
            raise PatchError(f"{path} is not a valid patch: {exc}") from exc

    # --- validation --------------------------------------------------------------------------------------
    def _check_tensors(self) -> None:
        if not self.biases:
            raise PatchKeysError("patch has no bias tensors; it would not change the encoder")
        named = {BIAS_PREFIX + k: v for k, v in self.biases.items()}
        named.update({HEAD_WEIGHT: self.head_weight, HEAD_BIAS: self.head_bias})
        for key, t in named.items():
            if t.dtype != torch.float32:
                raise PatchShapeError(f"tensor {key!r} has dtype {t.dtype}; patches store float32")
            if key.startswith(BIAS_PREFIX) and t.dim() != 1:
                raise PatchShapeError(f"bias {key!r} has shape {tuple(t.shape)}; biases are 1-D")
            if not bool(torch.isfinite(t).all()):
                raise PatchValueError(
                    f"tensor {key!r} contains NaN or Inf; the training diverged -- lower the learning rate and retrain"
                )
        n_out = self.meta.n_outputs
        if self.head_weight.dim() != 2 or self.head_weight.shape[0] != n_out:
            raise PatchShapeError(
                f"{HEAD_WEIGHT!r} has shape {tuple(self.head_weight.shape)}; a {self.meta.kind} patch with "
                f"{len(self.meta.labels)} labels needs [{n_out}, hidden]"
            )
        if tuple(self.head_bias.shape) != (n_out,):
            raise PatchShapeError(f"{HEAD_BIAS!r} has shape {tuple(self.head_bias.shape)}; expected [{n_out}]")

    def check_compatible(self, base: BaseSpec) -> None:
        """Refuse a patch that does not fit ``base``: other fingerprint, unknown biases or wrong shapes."""
        if self.meta.base.fingerprint != base.fingerprint:
            raise FingerprintMismatchError(
                f"patch {self.meta.task!r} was trained on base {self.meta.base.name!r} "
                f"({self.meta.base.fingerprint}), this server runs {base.name!r} ({base.fingerprint}); "
                "retrain the patch on this base or start the server with that base"
            )
        unknown = sorted(set(self.biases) - set(base.bias_shapes))
        if unknown:
            example = next(iter(base.bias_shapes), "")
            raise PatchKeysError(
                f"patch targets biases this encoder does not have: {unknown[:5]} (this encoder's bias names look "
                f"like {example!r})"
            )
        for name, t in self.biases.items():
            if tuple(t.shape) != tuple(base.bias_shapes[name]):
                raise PatchShapeError(
                    f"bias {name!r} has shape {tuple(t.shape)}, the encoder's has {tuple(base.bias_shapes[name])}"
                )
        if self.head_weight.shape[1] != base.hidden_size:
            raise PatchShapeError(
                f"{HEAD_WEIGHT!r} expects hidden size {self.head_weight.shape[1]}, the encoder has {base.hidden_size}"
            )


def _read_header(data: bytes) -> dict[str, Any]:
    """Parse the safetensors header (8-byte little-endian length + JSON) without touching tensor data."""
    if len(data) < 8:
        raise PatchCorruptError(f"patch is only {len(data)} bytes: truncated or not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(data):
        raise PatchCorruptError(
            "patch header length does not fit the file: the file is truncated or not a safetensors file"
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PatchCorruptError(f"patch header is not valid JSON ({exc}): the file is damaged") from exc
    if not isinstance(header, dict):
        raise PatchCorruptError("patch header is not a JSON object: the file is damaged")
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__"
        and isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
    ]
    if ends and 8 + n + max(ends) > len(data):
        raise PatchCorruptError("patch tensor data is cut short: the file is truncated, copy it again")
    return header
