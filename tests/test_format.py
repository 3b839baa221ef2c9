"""The patch file format: lossless round trip and strict refusal of every kind of bad input."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save as st_save

from patchserve.patches.errors import (
    FingerprintMismatchError,
    PatchCorruptError,
    PatchError,
    PatchKeysError,
    PatchMetadataError,
    PatchShapeError,
    PatchTooLargeError,
    PatchValueError,
    PatchVersionError,
)
from patchserve.patches.format import METADATA_KEY, BaseSpec, Patch
from patchserve.patches.stored_patch import StoredPatch
from patchserve.patches.validation import validate_task_name
from tests.helpers import make_patch


def _tensors(patch: Patch) -> dict[str, torch.Tensor]:
    out = {"bias." + k: v for k, v in patch.biases.items()} | {"scale." + k: v for k, v in patch.scales.items()}
    out["head.weight"], out["head.bias"] = patch.head_weight, patch.head_bias
    return out


def _raw(patch: Patch, tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> bytes:
    """Bytes written around the Patch class, so the reader's own checks are what refuses them."""
    m = json.loads(patch.meta.to_json()) if meta is None else meta
    return st_save(tensors if tensors is not None else _tensors(patch), metadata={METADATA_KEY: json.dumps(m)})


def test_round_trip_is_lossless_and_deterministic(tiny_encoder):
    patch = make_patch(tiny_encoder)
    loaded = Patch.from_bytes(patch.data)
    assert loaded.meta == patch.meta
    assert loaded.biases.keys() == patch.biases.keys()
    for name in patch.biases:
        assert torch.equal(loaded.biases[name], patch.biases[name])
    assert torch.equal(loaded.head_weight, patch.head_weight)
    assert torch.equal(loaded.head_bias, patch.head_bias)
    assert loaded.data == patch.data
    assert loaded.patch_id == patch.patch_id and patch.patch_id.startswith("sha256:")


def test_patch_id_is_a_content_hash(tiny_encoder):
    a, b = make_patch(tiny_encoder, seed=1), make_patch(tiny_encoder, seed=2)
    assert a.patch_id != b.patch_id
    # Same content written by another writer (metadata JSON laid out differently) has the same id.
    pretty = json.dumps(json.loads(a.meta.to_json()), indent=2)
    rewritten = st_save(_tensors(a), metadata={METADATA_KEY: pretty})
    assert rewritten != a.data
    assert Patch.from_bytes(rewritten).patch_id == a.patch_id


@pytest.mark.parametrize("kind", ["classification", "regression", "token-classification"])
def test_every_kind_round_trips(tiny_encoder, kind):
    patch = make_patch(tiny_encoder, kind=kind)
    assert Patch.from_bytes(patch.data).meta.kind == kind
    assert patch.head_weight.shape[0] == patch.meta.n_outputs


def test_oversized_file_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)
    with pytest.raises(PatchTooLargeError, match="limit"):
        Patch.from_bytes(patch.data, max_bytes=len(patch.data) - 1)


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -100])
def test_truncated_bytes_refused(tiny_encoder, cut):
    data = make_patch(tiny_encoder).data
    with pytest.raises(PatchCorruptError):
        Patch.from_bytes(data[:cut])


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage!" * 10, struct.pack("<Q", 5) + b"{{{{{", struct.pack("<Q", 2) + b"[]", b"\xff" * 64],
    ids=["empty", "text", "bad-json", "json-array", "binary"],
)
def test_garbage_refused(data):
    with pytest.raises(PatchCorruptError):
        Patch.from_bytes(data)


def test_plain_safetensors_without_metadata_refused():
    data = st_save({"bias.x": torch.zeros(3)})
    with pytest.raises(PatchMetadataError, match="not a patchserve patch"):
        Patch.from_bytes(data)


def test_unsupported_format_version_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)
    meta = json.loads(patch.meta.to_json()) | {"format_version": 99}
    with pytest.raises(PatchVersionError, match="99"):
        Patch.from_bytes(_raw(patch, meta=meta))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"surprise": 1}, "unknown fields"),
        ({"kind": "clustering"}, "kind"),
        ({"labels": ["a", "a"]}, "unique"),
        ({"labels": ["only"]}, "at least 2"),
        ({"pooling": "max"}, "pooling"),
        ({"max_seq_length": 0}, "max_seq_length"),
        ({"task": "../etc"}, "invalid task name"),
        ({"base": {"name": "x"}}, "base"),
        ({"metrics": {"acc": "high"}}, "metrics"),
        ({"metrics": {"acc": True}}, "metrics"),
        ({"max_seq_length": True}, "max_seq_length"),  # a bool is not an integer (it would truncate to 1 token)
        ({"max_seq_length": 128.0}, "max_seq_length"),
        ({"task": "sentiment\n"}, "invalid task name"),
        ({"labels": ["neg\n", "pos"]}, "control character"),
        ({"base": {"name": "x\x00", "fingerprint": "sha256:0"}}, "base"),
        ({"training": {"lr": float("nan")}}, "NaN is not a JSON number"),
        ({"training": {"lr": float("inf")}}, "Infinity is not a JSON number"),
        ({"training": {"note": "\ud800"}}, "surrogate"),
        ({"training": {"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}, "nested deeper"),
    ],
)
def test_bad_metadata_refused(tiny_encoder, change, match):
    patch = make_patch(tiny_encoder)
    meta = json.loads(patch.meta.to_json()) | change
    with pytest.raises(PatchMetadataError, match=match):
        Patch.from_bytes(_raw(patch, meta=meta))


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"training": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),  # json.loads would recurse to death
        ('{"max_seq_length": ' + "9" * 5000 + "}", "not valid JSON"),  # past Python's int-digits limit
        ('{"training": {"lr": 1e400}}', "out of range"),  # parses as a float infinity
        ('{"format_version": true}', "format version"),
        ('{"format_version": 1.0}', "format version"),
        ("[1, 2]", "JSON object"),
    ],
    ids=["deep", "huge-int", "huge-float", "version-bool", "version-float", "array"],
)
def test_hostile_metadata_json_is_refused_not_crashed_on(tiny_encoder, text, match):
    patch = make_patch(tiny_encoder)
    data = st_save(_tensors(patch), metadata={METADATA_KEY: text})
    with pytest.raises(PatchError, match=match):
        Patch.from_bytes(data)


def test_hostile_headers_are_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)

    def with_header(header: dict) -> bytes:
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + b"\0" * 64

    many = {f"bias.x{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(80_000)}
    with pytest.raises(PatchCorruptError, match="over the"):
        Patch.from_bytes(with_header(many))
    with pytest.raises(PatchCorruptError, match="malformed data offsets"):
        Patch.from_bytes(with_header({"head.bias": {"dtype": "F32", "shape": [1], "data_offsets": ["a", "b"]}}))
    with pytest.raises(PatchCorruptError, match="malformed data offsets"):
        Patch.from_bytes(with_header({"head.bias": {"dtype": "F32", "shape": [1], "data_offsets": [True, 4]}}))
    assert Patch.from_bytes(patch.data).patch_id == patch.patch_id


def test_missing_metadata_field_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)
    meta = json.loads(patch.meta.to_json())
    del meta["labels"]
    with pytest.raises(PatchMetadataError, match="lacks fields"):
        Patch.from_bytes(_raw(patch, meta=meta))


def test_unknown_and_missing_keys_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)
    with pytest.raises(PatchKeysError, match="unknown tensor keys"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"adapter.up": torch.zeros(2)}))
    tensors = _tensors(patch)
    del tensors["head.bias"]
    with pytest.raises(PatchKeysError, match=r"head\.bias"):
        Patch.from_bytes(_raw(patch, tensors=tensors))
    only_head = {"head.weight": patch.head_weight, "head.bias": patch.head_bias}
    with pytest.raises(PatchKeysError, match="no bias tensors"):
        Patch.from_bytes(_raw(patch, tensors=only_head))


def test_wrong_shape_and_dtype_refused(tiny_encoder):
    patch = make_patch(tiny_encoder)
    name = next(iter(patch.biases))
    with pytest.raises(PatchShapeError, match="float32"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"bias." + name: patch.biases[name].half()}))
    with pytest.raises(PatchShapeError, match="1-D"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"bias." + name: torch.zeros(2, 2)}))
    with pytest.raises(PatchShapeError, match=r"head\.weight"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"head.weight": torch.zeros(3, 32)}))
    with pytest.raises(PatchShapeError, match=r"head\.bias"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"head.bias": torch.zeros(5)}))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_refused(tiny_encoder, bad):
    patch = make_patch(tiny_encoder)
    name = next(iter(patch.biases))
    poisoned = patch.biases[name].clone()
    poisoned[3] = bad
    with pytest.raises(PatchValueError, match="NaN or Inf"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"bias." + name: poisoned}))


@pytest.mark.parametrize("form", ["parsed", "stored"])
def test_compatibility_with_the_encoder(tiny_encoder, form):
    made = make_patch(tiny_encoder)
    # as a registry's read gives it: its tensors unparsed
    patch = made if form == "parsed" else StoredPatch.from_stored(made.data, made.patch_id)
    patch.check_compatible(tiny_encoder.spec)  # fits
    other = replace(tiny_encoder.spec, name="other-base", fingerprint="sha256:" + "0" * 64)
    with pytest.raises(FingerprintMismatchError) as exc:
        patch.check_compatible(other)
    assert tiny_encoder.fingerprint in str(exc.value) and "sha256:000" in str(exc.value)
    assert "retrain" in str(exc.value)
    shapes = dict(tiny_encoder.spec.bias_shapes)
    first = next(iter(made.biases))
    del shapes[first]
    with pytest.raises(PatchKeysError, match="does not have"):
        patch.check_compatible(replace(tiny_encoder.spec, bias_shapes=shapes))
    shapes = dict(tiny_encoder.spec.bias_shapes) | {first: (7,)}
    with pytest.raises(PatchShapeError, match="encoder's has"):
        patch.check_compatible(replace(tiny_encoder.spec, bias_shapes=shapes))
    with pytest.raises(PatchShapeError, match="hidden size"):
        patch.check_compatible(BaseSpec(tiny_encoder.name, tiny_encoder.fingerprint, 64, tiny_encoder.spec.bias_shapes))
    assert form == "parsed" or not patch.loaded  # a stored patch is checked from its header alone


def test_a_patch_with_ia3_scales_round_trips_and_keeps_to_its_kind(tiny_encoder):
    patch = make_patch(tiny_encoder, ia3_scale=0.2)
    layers = tiny_encoder.model.config.num_hidden_layers
    assert patch.meta.patch_type == "bitfit-ia3" and len(patch.scales) == 3 * layers
    assert "encoder.layer.0.attention.self.key" in patch.scales and "encoder.layer.1.intermediate" in patch.scales
    loaded = Patch.from_bytes(patch.data)
    assert loaded.patch_id == patch.patch_id and all(
        torch.equal(loaded.scales[n], patch.scales[n]) for n in patch.scales
    )
    loaded.check_compatible(tiny_encoder.spec)
    gains = _tensors(patch) | {"scale.encoder.layer.0.output.LayerNorm.weight": torch.ones(32)}
    with pytest.raises(PatchKeysError, match=r"'bitfit-ia3' patch holds \(IA\)\^3 scales .*LayerNorm\.weight"):
        Patch.from_bytes(_raw(patch, tensors=gains))  # a LayerNorm gain is a parameter, not an (IA)^3 site
    wrong = dict(tiny_encoder.spec.scale_shapes) | {"encoder.layer.0.intermediate": (3,)}
    with pytest.raises(PatchShapeError, match="encoder's has"):
        patch.check_compatible(replace(tiny_encoder.spec, scale_shapes=wrong))
    renamed = _tensors(patch)
    renamed["scale.encoder.layer.0.attention.self.query"] = renamed.pop("scale.encoder.layer.0.attention.self.key")
    with pytest.raises(PatchKeysError, match="scales what is not an"):
        Patch.from_bytes(_raw(patch, tensors=renamed)).check_compatible(tiny_encoder.spec)


def test_scales_need_their_patch_type_and_fit_the_encoder(tiny_encoder):
    patch = make_patch(tiny_encoder, ia3_scale=0.2)
    plain_meta = json.loads(patch.meta.to_json()) | {"patch_type": "bitfit"}
    with pytest.raises(PatchKeysError, match=r"'bitfit' patch has no 'scale\.<name>' tensors"):
        Patch.from_bytes(_raw(patch, meta=plain_meta))  # a BitFit patch may not carry scales
    without = {k: v for k, v in _tensors(patch).items() if not k.startswith("scale.")}
    with pytest.raises(PatchKeysError, match="'bitfit-ia3' patch needs"):
        Patch.from_bytes(_raw(patch, tensors=without))
    with pytest.raises(PatchMetadataError, match=r"patch type 'ia3' is not supported .*upgrade"):
        Patch.from_bytes(_raw(patch, meta=plain_meta | {"patch_type": "ia3"}))
    name = next(iter(patch.scales))
    with pytest.raises(PatchShapeError, match="scales are 1-D"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"scale." + name: torch.ones(2, 2)}))
    poisoned = patch.scales[name].clone()
    poisoned[0] = float("nan")
    with pytest.raises(PatchValueError, match="NaN or Inf"):
        Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"scale." + name: poisoned}))
    extra = Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"scale.pooler.dense": torch.ones(32)}))
    with pytest.raises(PatchKeysError, match="scales what is not an"):
        extra.check_compatible(tiny_encoder.spec)
    short = Patch.from_bytes(_raw(patch, tensors=_tensors(patch) | {"scale." + name: torch.ones(7)}))
    with pytest.raises(PatchShapeError, match=r"scale .* has shape \(7,\), the encoder's has"):
        short.check_compatible(tiny_encoder.spec)


def test_a_retired_patch_type_is_refused_with_what_to_do(tiny_encoder):
    """bitfit-ln (biases and LayerNorm gains), written by earlier releases, is no longer served: reading one says
    so and what to do, instead of asking for an upgrade."""
    from patchserve.patches.errors import RetiredPatchTypeError
    from tests.helpers import retired_patch

    with pytest.raises(RetiredPatchTypeError, match=r"'bitfit-ln' \(biases and every LayerNorm's gain\) is no longer"):
        Patch.from_bytes(retired_patch(tiny_encoder).data)


@pytest.mark.parametrize("name", ["sentiment", "a", "Task_1.v2-x", "9lives"])
def test_valid_task_names(name):
    assert validate_task_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "../x", "a/b", "..", ".hidden", "-dash", "a..b", "x" * 65, "sp ace", "é", "sent\n", "a\x00b", "x\r", "\tx"],
)
def test_invalid_task_names(name):
    from patchserve.patches.errors import InvalidTaskNameError

    with pytest.raises(InvalidTaskNameError):
        validate_task_name(name)
