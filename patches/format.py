"""The patch file format: one ``.safetensors`` file per patch version.

This module (with ``patch_file.py``, which reads the header) is the ONLY place that knows tensor key names and the
header layout. A file holds

* ``bias.<encoder parameter name>``  float32 ``[dim]``  -- the trained value of each targeted bias
  (e.g. ``bias.encoder.layer.0.attention.self.query.bias``); untargeted biases keep the base value;
* ``scale.<encoder module name>`` float32 ``[dim]`` -- only in a ``bitfit-ia3`` patch: an (IA)^3 scale (Liu et al.,
  2022) that multiplies the output of that module elementwise: every layer's key and value projections (after their
  bias) and its feed-forward intermediate (after the activation), e.g. ``scale.encoder.layer.0.attention.self.key``
  and ``scale.encoder.layer.0.intermediate`` (a module name, never a parameter's: it does not end in ``.weight``);
* ``lora.<linear module name>.lora_A`` float32 ``[r, in]`` and ``lora.<linear module name>.lora_B`` ``[out, r]`` --
  only in a ``lora`` patch: the low-rank update of that linear layer, ``W' = W + B A``; B holds the LoRA scaling
  already (alpha / r, or alpha / sqrt(r) with rsLoRA), so serving needs no alpha;
* ``head.weight`` float32 ``[n_out, hidden]`` and ``head.bias`` float32 ``[n_out]`` -- the task head;
* one metadata entry ``"patchserve"`` in the safetensors header: canonical JSON of :class:`PatchMeta`.

A single metadata key keeps serialisation byte-deterministic (safetensors writes several keys in hash order),
so the patch id -- sha256 of the canonical bytes -- is a true content hash. New patch kinds (adapters, LoRA, per
the unified PETL view) can add key prefixes and a ``patch_type`` without changing how existing files read.
Nothing here unpickles: safetensors holds raw tensors only.
"""

from __future__ import annotations

import json
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

from patchserve.patches.errors import (
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
    RetiredPatchTypeError,
)
from patchserve.patches.patch_file import check_fit, content_id, read_header
from patchserve.patches.validation import (
    Label,
    is_finite_number,
    is_label,
    shown,
    strict_json,
    unprintable,
    validate_task_name,
)

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = frozenset({1})
METADATA_KEY = "patchserve"
PATCH_TYPE = "bitfit"  # biases + head (the default)
IA3_PATCH_TYPE = "bitfit-ia3"  # biases + (IA)^3 scales on keys, values, FFN intermediates + head (``--scales ia3``)
LORA_PATCH_TYPE = "lora"  # biases + low-rank (LoRA) factors on chosen linear layers + head (PEFT's bias="all")
PATCH_TYPES = (PATCH_TYPE, IA3_PATCH_TYPE, LORA_PATCH_TYPE)
# Patch types earlier releases wrote and this one no longer serves, with what they held (docs/experiments.md says
# why each was retired). Reading one is a RetiredPatchTypeError that says what to do, never a crash.
RETIRED_PATCH_TYPES = {"bitfit-ln": "biases and every LayerNorm's gain"}
FILE_SUFFIX = ".safetensors"
BIAS_PREFIX = "bias."
SCALE_PREFIX = "scale."
LORA_PREFIX = "lora."
# a LoRA factor's name: its linear module's name and one of these suffixes (PEFT's names, without ".weight")
LORA_A, LORA_B = ".lora_A", ".lora_B"
HEAD_WEIGHT = "head.weight"
HEAD_BIAS = "head.bias"
DEFAULT_MAX_PATCH_BYTES = 64 * 1024 * 1024

KINDS = ("classification", "regression", "token-classification")
POOLINGS = ("mean", "cls", "pooler")


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
    scale_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # (IA)^3 sites
    lora_shapes: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # LoRA sites: module -> (out, in)

    @property
    def patch_types(self) -> list[str]:
        """The patch types this encoder can serve: those whose sites it has."""
        sites = {PATCH_TYPE: self.bias_shapes, IA3_PATCH_TYPE: self.scale_shapes, LORA_PATCH_TYPE: self.lora_shapes}
        return [kind for kind, have in sites.items() if have]


@dataclass
class PatchMeta:
    """Everything about a patch that is not a tensor. Stored as canonical JSON in the file header."""

    task: str
    kind: str
    labels: list[Label]  # head order; strings or integers, as the training data had them
    base: BaseRef
    bias_subset: str
    pooling: str
    max_seq_length: int
    metrics: dict[str, float] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    format_version: int = FORMAT_VERSION
    patch_type: str = PATCH_TYPE
    # True: the task reads sentence pairs (text + text_pair); False: single texts. None: not recorded (patches made
    # before this field existed), and the server takes either. Left out of the JSON when None, so those older
    # files keep their bytes and ids.
    text_pair: bool | None = None

    @property
    def n_outputs(self) -> int:
        """Width of the head: one score per label, or 1 for regression."""
        return 1 if self.kind == "regression" else len(self.labels)

    def to_json(self) -> str:
        values = {k: v for k, v in asdict(self).items() if not (k == "text_pair" and v is None)}
        return json.dumps(values, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> PatchMeta:
        raw = strict_json(text, "patch metadata", PatchMetadataError)
        if not isinstance(raw, dict):
            raise PatchMetadataError("patch metadata must be a JSON object; re-export the patch")
        version = raw.get("format_version")
        if type(version) is not int or version not in SUPPORTED_FORMAT_VERSIONS:
            raise PatchVersionError(
                f"patch format version {version!r} is not supported by this build (reads "
                f"{sorted(SUPPORTED_FORMAT_VERSIONS)}); upgrade patchserve or re-export the patch"
            )
        patch_type = raw.get("patch_type")
        retired = RETIRED_PATCH_TYPES.get(patch_type) if isinstance(patch_type, str) else None
        if retired is not None:
            raise RetiredPatchTypeError(
                f"patch type {raw['patch_type']!r} ({retired}) is no longer served; retrain the task as a "
                f"{PATCH_TYPE!r} or {IA3_PATCH_TYPE!r} patch, or roll back to a version of another type "
                "(`patchserve rollback TASK VERSION`); `patchserve prune --unservable` deletes such versions"
            )
        if raw.get("patch_type") not in PATCH_TYPES:
            raise PatchMetadataError(
                f"patch type {shown(raw.get('patch_type'))} is not supported (this build reads {list(PATCH_TYPES)}); "
                "upgrade patchserve"
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
        if not isinstance(self.labels, list) or not all(is_label(x) for x in self.labels):
            raise bad(
                f"labels must be a list of non-empty strings or integers within +-(2**53 - 1), got {shown(self.labels)}"
            )
        if self.kind == "token-classification" and not all(isinstance(x, str) for x in self.labels):
            raise bad("tags (the labels of a token-classification patch) must be strings")
        for label in self.labels:
            if (ch := unprintable(str(label))) is not None:
                raise bad(f"label {shown(label)} contains the control character {ch}")
        if len({str(x) for x in self.labels}) != len(self.labels):  # 1 and "1" would be one key in all_scores
            raise bad(f'labels must be unique (1 and "1" count as the same), got {shown(self.labels)}')
        if self.kind == "classification" and len(self.labels) < 2:
            raise bad("a classification patch needs at least 2 labels")
        if self.kind == "token-classification" and len(self.labels) < 1:
            raise bad("a token-classification patch needs at least 1 label")
        if self.kind == "regression" and len(self.labels) > 1:
            raise bad("a regression patch has at most one label (the name of its score)")
        if self.pooling not in POOLINGS:
            raise bad(f"pooling {self.pooling!r} is not one of {list(POOLINGS)}")
        if type(self.max_seq_length) is not int or not 1 <= self.max_seq_length <= 65536:
            raise bad(f"max_seq_length must be an integer in 1..65536, got {self.max_seq_length!r}")
        if not isinstance(self.bias_subset, str) or not self.bias_subset or unprintable(self.bias_subset):
            raise bad("bias_subset must be a non-empty string without control characters")
        if not (
            isinstance(self.base.name, str)
            and isinstance(self.base.fingerprint, str)
            and self.base.fingerprint.startswith("sha256:")
            and not unprintable(self.base.name + self.base.fingerprint)
        ):
            raise bad('base must name the encoder and carry its "sha256:..." fingerprint')
        if not isinstance(self.metrics, dict) or not all(
            isinstance(k, str) and is_finite_number(v) for k, v in self.metrics.items()
        ):
            raise bad("metrics must map names to finite numbers")
        if not isinstance(self.training, dict):
            raise bad("training must be an object")
        if not isinstance(self.created_at, str):
            raise bad("created_at must be an ISO-8601 string")
        if not (self.text_pair is None or type(self.text_pair) is bool) or (
            self.text_pair and self.kind == "token-classification"
        ):
            raise bad("text_pair must be true or false (and false for token-classification)")


@dataclass
class Patch:
    """A task's BitFit patch: trained bias values, a linear head and metadata.

    ``biases`` maps encoder parameter names (``encoder.layer.0.attention.self.query.bias``) to ``[dim]`` float32;
    ``head_weight`` is ``[n_out, hidden]`` and ``head_bias`` ``[n_out]``. ``scales`` (empty in a ``bitfit`` patch)
    maps the names of the modules whose outputs its (IA)^3 scales multiply (``encoder.layer.0.intermediate``, a
    ``bitfit-ia3`` patch) to their trained ``[dim]`` values. ``lora`` (a ``lora`` patch) maps
    ``<linear module name>.lora_A`` to ``[r, in]`` and ``.lora_B`` to ``[out, r]`` (scaled: ``W' = W + B A``).
    """

    meta: PatchMeta
    biases: dict[str, torch.Tensor]
    head_weight: torch.Tensor
    head_bias: torch.Tensor
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    lora: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meta.validate()
        self._check_tensors()

    # --- identity & size ----------------------------------------------------------------------------------
    def _keyed(self) -> dict[str, torch.Tensor]:
        """Every tensor of the patch under its file key (``bias.<name>``, ``scale.<name>``, the head's two)."""
        keyed = {BIAS_PREFIX + k: v for k, v in self.biases.items()}
        keyed.update({SCALE_PREFIX + k: v for k, v in self.scales.items()})
        keyed.update({LORA_PREFIX + k: v for k, v in self.lora.items()})
        keyed.update({HEAD_WEIGHT: self.head_weight, HEAD_BIAS: self.head_bias})
        return keyed

    @cached_property
    def data(self) -> bytes:
        """Canonical bytes of this patch (what is written to disk / Redis)."""
        tensors = {key: t.detach().to("cpu", torch.float32).contiguous() for key, t in self._keyed().items()}
        return st_save(tensors, metadata={METADATA_KEY: self.meta.to_json()})

    @cached_property
    def patch_id(self) -> str:
        """Content hash: sha256 of the canonical bytes. Caches and slots are keyed by it."""
        return content_id(self.data)

    @property
    def n_params(self) -> int:
        """Number of values the patch carries (biases + scales + LoRA factors + head)."""
        vectors = sum(t.numel() for t in [*self.biases.values(), *self.scales.values(), *self.lora.values()])
        return vectors + self.head_weight.numel() + self.head_bias.numel()

    @property
    def values(self) -> dict[str, torch.Tensor]:
        """Everything the patch sets in the encoder (its biases, scales and LoRA factors), by parameter, module or
        factor name."""
        return self.biases | self.scales | self.lora

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, under its file key."""
        return {key: tuple(t.shape) for key, t in self._keyed().items()}

    @property
    def lora_rank(self) -> int:
        """The largest rank of the patch's LoRA factors (0: none)."""
        return max((int(t.shape[0]) for k, t in self.lora.items() if k.endswith(LORA_A)), default=0)

    # --- (de)serialisation -------------------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = DEFAULT_MAX_PATCH_BYTES, patch_id: str | None = None) -> Patch:
        """Parse and strictly validate patch bytes. Never unpickles; raises a specific :class:`PatchError`.

        ``patch_id``: the bytes' ``content_id``, which the caller has checked against a recorded one (a registry's
        record, the id a front end names): they are a patch's canonical bytes as ``data`` wrote them, so they are
        kept as its ``data`` instead of being written again (a patch read to be served is parsed, not re-encoded)."""
        meta, _ = read_meta(data, max_bytes)
        return cls.with_tensors(meta, data, patch_id)

    @classmethod
    def with_tensors(cls, meta: PatchMeta, data: bytes, patch_id: str | None = None) -> Patch:
        """The patch of ``data`` whose metadata ``read_meta`` read (its keys checked), its tensors parsed and checked
        (``patch_id`` as ``from_bytes`` takes it)."""
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise PatchCorruptError(f"patch tensors cannot be read ({exc}); the file is damaged, re-export it") from exc

        def under(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

        patch = cls(
            meta=meta,
            biases=under(BIAS_PREFIX),
            head_weight=tensors[HEAD_WEIGHT],
            head_bias=tensors[HEAD_BIAS],
            scales=under(SCALE_PREFIX),
            lora=under(LORA_PREFIX),
        )
        if patch_id is not None:  # the cached properties, filled with what the caller checked
            patch.__dict__.update(data=data, patch_id=patch_id)
        return patch

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
        if not self.biases and self.meta.patch_type == PATCH_TYPE:
            raise PatchKeysError("patch has no bias tensors; it would not change the encoder")
        self._check_lora()
        scaled = self.meta.patch_type == IA3_PATCH_TYPE
        if scaled != bool(self.scales):
            raise PatchKeysError(
                f"a {self.meta.patch_type!r} patch "
                + ("needs" if scaled else "has no")
                + f" '{SCALE_PREFIX}<name>' tensors ((IA)^3 scales), this one has {len(self.scales)}; re-export it"
            )
        misplaced = sorted(n for n in self.scales if n.endswith(".weight"))
        if misplaced:
            raise PatchKeysError(
                f"a {self.meta.patch_type!r} patch holds (IA)^3 scales (module names), not parameters such as "
                f"{misplaced[:3]}; re-export it"
            )
        keyed = self._keyed()
        for key, t in keyed.items():
            if t.dtype != torch.float32:
                raise PatchShapeError(f"tensor {key!r} has dtype {t.dtype}; patches store float32")
            if key.startswith((BIAS_PREFIX, SCALE_PREFIX)) and t.dim() != 1:
                what = "bias" if key.startswith(BIAS_PREFIX) else "scale"
                raise PatchShapeError(f"{what} {key!r} has shape {tuple(t.shape)}; {what}s are 1-D")
        # one check over every value (a patch is a few dozen small tensors: one call each cost more than the
        # values); the tensor to name is looked for only when it fails
        if not bool(torch.isfinite(torch.cat([t.detach().reshape(-1).cpu() for t in keyed.values()])).all()):
            key = next(k for k, t in keyed.items() if not bool(torch.isfinite(t).all()))
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

    def _check_lora(self) -> None:
        """A ``lora`` patch holds, for each of its modules, an A ``[r, in]`` and a B ``[out, r]`` of one rank; no other
        patch holds any."""
        lora = self.meta.patch_type == LORA_PATCH_TYPE
        if lora != bool(self.lora):
            raise PatchKeysError(
                f"a {self.meta.patch_type!r} patch "
                + ("needs" if lora else "has no")
                + f" '{LORA_PREFIX}<module>{LORA_A}' tensors (LoRA factors), this one has {len(self.lora)}; "
                "re-export it"
            )
        for name, t in self.lora.items():
            module, suffix = name[: -len(LORA_A)], name[-len(LORA_A) :]
            if suffix not in (LORA_A, LORA_B):
                raise PatchKeysError(f"LoRA factor {name!r} must end in {LORA_A!r} or {LORA_B!r}; re-export the patch")
            other = self.lora.get(module + (LORA_B if suffix == LORA_A else LORA_A))
            if other is None:
                raise PatchKeysError(f"LoRA factor {name!r} has no {LORA_B if suffix == LORA_A else LORA_A} pair")
            a, b = (t, other) if suffix == LORA_A else (other, t)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
                raise PatchShapeError(
                    f"LoRA factors of {module!r} have shapes A {tuple(a.shape)} and B {tuple(b.shape)}; they must be "
                    "A [r, in] and B [out, r] of one rank r >= 1"
                )

    def check_compatible(self, base: BaseSpec) -> None:
        """Refuse a patch that does not fit ``base``: other fingerprint, unknown biases or wrong shapes."""
        if self.meta.base.fingerprint != base.fingerprint:
            raise FingerprintMismatchError(
                f"patch {self.meta.task!r} was trained on base {self.meta.base.name!r} "
                f"({self.meta.base.fingerprint}), this server runs {base.name!r} ({base.fingerprint}); "
                "retrain the patch on this base or start the server with that base"
            )
        shapes = self.shapes

        def under(prefix: str) -> dict[str, tuple[int, ...]]:
            return {k[len(prefix) :]: shape for k, shape in shapes.items() if k.startswith(prefix)}

        check_fit("bias", under(BIAS_PREFIX), base.bias_shapes, "targets biases this encoder does not have")
        check_fit("scale", under(SCALE_PREFIX), base.scale_shapes, "scales what is not an (IA)^3 site of this encoder")
        for name, shape in under(LORA_PREFIX).items():
            module = name[: -len(LORA_A)]
            if module not in base.lora_shapes:
                example = next(iter(base.lora_shapes), "(none)")
                raise PatchKeysError(
                    f"patch has LoRA factors for {module!r}, which is not a linear layer this encoder serves LoRA on "
                    f"(they look like {example!r})"
                )
            out_f, in_f = base.lora_shapes[module]
            want = (shape[0], in_f) if name.endswith(LORA_A) else (out_f, shape[-1])
            if shape != want:
                raise PatchShapeError(f"LoRA factor {name!r} has shape {shape}, this encoder needs {want}")
        head = shapes[HEAD_WEIGHT]
        if len(head) != 2 or head[1] != base.hidden_size:
            raise PatchShapeError(
                f"{HEAD_WEIGHT!r} expects hidden size {head[-1] if head else '?'}, the encoder has {base.hidden_size}"
            )


def read_meta(data: bytes, max_bytes: int = DEFAULT_MAX_PATCH_BYTES) -> tuple[PatchMeta, dict[str, Any]]:
    """A patch file's metadata and safetensors header, its tensor keys checked, without reading its tensors."""
    if len(data) > max_bytes:
        raise PatchTooLargeError(
            f"patch is {len(data)} bytes, over the {max_bytes}-byte limit; a BitFit patch is normally well "
            "under 1 MB -- check that you are sending a patch file, not model weights"
        )
    header = read_header(data)
    meta_text = (header.get("__metadata__") or {}).get(METADATA_KEY)
    if not isinstance(meta_text, str):
        raise PatchMetadataError(
            f"the safetensors header has no {METADATA_KEY!r} metadata: this is not a patchserve patch "
            "(export patches with `patchserve train` or patches.bitfit.extract_patch)"
        )
    meta = PatchMeta.from_json(meta_text)
    keys = [k for k in header if k != "__metadata__"]
    for key in (HEAD_WEIGHT, HEAD_BIAS):
        if key not in keys:
            raise PatchKeysError(f"patch lacks the tensor {key!r}; re-export the patch")
    prefixes = (BIAS_PREFIX, SCALE_PREFIX, LORA_PREFIX)
    unknown = sorted(k for k in keys if k not in (HEAD_WEIGHT, HEAD_BIAS) and not k.startswith(prefixes))
    if unknown:
        raise PatchKeysError(
            f"patch has unknown tensor keys {unknown[:5]}; a patch holds only '{BIAS_PREFIX}<param>', "
            f"'{SCALE_PREFIX}<name>', '{LORA_PREFIX}<module>{LORA_A}|{LORA_B}', {HEAD_WEIGHT!r} and {HEAD_BIAS!r}"
        )
    return meta, header
