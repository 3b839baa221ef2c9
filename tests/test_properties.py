"""Property-based tests (hypothesis): whatever a client sends, the parsers answer with their own error type (a
4xx in the server, one line from the CLI), never with an exception that would be a 500 or a traceback."""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from patchserve.patches.api import PredictRequest
from patchserve.patches.data import DataError, DataFile, job_splits, parse_dataset
from patchserve.patches.errors import PatchError
from patchserve.patches.format import METADATA_KEY, Patch, PatchMeta
from patchserve.patches.jobs import Gate, JobError
from patchserve.patches.train_config import TrainConfig
from patchserve.server.predict import InputError, normalise_inputs
from tests.helpers import make_patch

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# JSON values with what breaks naive code: NaN, infinities, huge integers, lone surrogates, control characters
_text = st.text(st.characters(codec=None, categories=None), max_size=20) | st.sampled_from(
    ["\ud800", "a\udfffb", "x\n", "\x00", "", "sentiment", "classification", "mean", "sha256:00"]
)
_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**400, -(10**400), 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | _text
)
json_values = st.recursive(
    _scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4), max_leaves=20
)


def _dumps(value: Any) -> str:
    """JSON text as a hostile client writes it: NaN and Infinity literals allowed, surrogates escaped."""
    return json.dumps(value, allow_nan=True)


@pytest.fixture(scope="module")
def valid_patch(tiny_encoder) -> Patch:
    return make_patch(tiny_encoder)


# --- the patch parser ---------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.binary(max_size=512))
def test_any_bytes_are_a_patch_or_a_patch_error(data):
    with contextlib.suppress(PatchError):
        Patch.from_bytes(data)


@SETTINGS
@given(
    edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8), cut=st.integers(0)
)
def test_damaged_patch_files_are_refused_with_a_patch_error(valid_patch, edits, cut):
    data = bytearray(valid_patch.data)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    data = data[: len(data) - cut % 64]
    try:
        parsed = Patch.from_bytes(bytes(data))
    except PatchError:
        return
    assert parsed.data  # whatever parses must serialise again (it is what the registry stores)


@SETTINGS
@given(header=st.dictionaries(_text, json_values, max_size=6))
def test_any_header_json_is_refused_with_a_patch_error(header):
    raw = _dumps(header).encode("utf-8", "surrogatepass")
    with contextlib.suppress(PatchError):
        Patch.from_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 32)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from([*sorted(PatchMeta.__dataclass_fields__), "extra"]), json_values))
@example(changes={"metrics": {"a": 10**400}})  # an integer beyond a float once raised OverflowError, not a PatchError
def test_any_metadata_is_a_patch_or_a_patch_error(valid_patch, changes):
    from safetensors.torch import save

    meta = json.loads(valid_patch.meta.to_json()) | changes
    tensors = {"bias." + k: v for k, v in valid_patch.biases.items()}
    tensors |= {"head.weight": valid_patch.head_weight, "head.bias": valid_patch.head_bias}
    try:
        data = save(tensors, metadata={METADATA_KEY: _dumps(meta)})
    except Exception:  # safetensors cannot write this text at all (a lone surrogate): no file to test
        return
    try:
        parsed = Patch.from_bytes(data)
    except PatchError:
        return
    assert Patch.from_bytes(parsed.data).patch_id == parsed.patch_id  # accepted metadata round-trips


# --- the predict schema -------------------------------------------------------------------------------------------
@SETTINGS
@given(body=json_values | st.fixed_dictionaries({"inputs": json_values}, optional={"top_k": json_values}))
def test_any_predict_body_validates_or_is_a_validation_error(body):
    try:
        request = PredictRequest.model_validate(body)
    except ValidationError:
        return
    try:
        texts, pairs = normalise_inputs(request.inputs)
    except InputError:
        return
    for text in texts + (pairs or []):
        text.encode("utf-8")  # every accepted text can reach the tokenizer


# --- training data and configs ------------------------------------------------------------------------------------
_suffixes = st.sampled_from(["train.jsonl", "train.csv", "train.tsv"])


@SETTINGS
@given(name=_suffixes, data=st.binary(max_size=300))
@example(name="train.csv", data=b"text,label\n" + b"x" * 200_000 + b",a\nb,c\n")  # past csv's field size limit
@example(name="train.csv", data=b"text,label\na\0b,x\nc,y\n")
@example(name="train.jsonl", data=b"[" * 100_000)
@example(name="train.jsonl", data=b'{"text": "a", "label": ' + b"9" * 5000 + b"}")
def test_any_data_file_bytes_are_a_dataset_or_a_data_error(name, data):
    with contextlib.suppress(DataError):
        parse_dataset(DataFile(name, data, name))


@SETTINGS
@example(rows=[{"text": "a\ud800", "label": "x"}, {"text": "b", "label": "y"}, {"text": "c", "label": "x"}])
@example(rows=[{"text": "a", "label": 10**400}, {"text": "b", "label": 1.5}])
@example(rows=[{"tokens": ["a", "\udfff"], "tags": ["x", "y"]}, {"tokens": ["b"], "tags": ["y"]}])
@example(rows=[{"text": "a", "text_pair": "\ud800", "label": 1}, {"text": "b", "text_pair": "c", "label": 2}])
@given(rows=st.lists(json_values | st.fixed_dictionaries({"text": json_values, "label": json_values}), max_size=6))
def test_any_jsonl_rows_are_a_dataset_or_a_data_error(rows):
    data = "\n".join(_dumps(r) for r in rows).encode("utf-8", "surrogatepass")
    try:
        splits = job_splits({"train": ("train.jsonl", data)})
    except DataError:
        return
    for row in splits.train.examples + splits.dev.examples:
        (row.text + (row.text_pair or "") + "".join(row.tokens)).encode("utf-8")  # tokenizable


@SETTINGS
@given(
    config=st.dictionaries(
        st.sampled_from(["task", "epochs", "min_steps", "lr", "restarts", "lr_search", "device", "x"]), json_values
    ),
    gate=json_values,
)
def test_any_job_config_is_a_config_or_a_job_error(config, gate):
    with contextlib.suppress(JobError):
        TrainConfig.from_dict(config)
    with contextlib.suppress(JobError):
        Gate.from_dict(gate)
