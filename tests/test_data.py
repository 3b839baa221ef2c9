"""The data readers: JSONL/CSV/TSV files of every task kind, and errors that name the file, line and problem."""

from __future__ import annotations

import json

import pytest
import torch

from patchserve.patches.data import DataError, load_dataset, split_dev
from patchserve.trainer.features import Features, collate
from tests.helpers import synthetic_rows, write_jsonl


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "good", "label": "positive"}\n{"text": "bad"\n', ":2: not valid JSON"),
        ('{"text": "good", "label": "positive"}\n{"text": "bad"}\n', ':2: missing "label"'),
        ('{"text": "", "label": "x"}\n', ':1: missing or empty "text"'),
        ('{"tokens": ["a", "b"], "tags": ["X"]}\n', ':1: "tokens" has 2 items but "tags" has 1'),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ('{"text": "a", "label": "x"}\n{"text": "b", "text_pair": "c", "label": "y"}\n', "all pairs or none"),
        ('{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n', "at least 2 distinct labels"),
    ],
)
def test_malformed_data_names_file_line_and_problem(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as exc:
        load_dataset(f)
    assert str(f) in str(exc.value) and message in str(exc.value)


def test_readers_csv_unicode_separators_and_inference(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('text,text_pair,label\n"a, quoted",b,1.5\nc,d,2\n')
    ds = load_dataset(f)
    assert ds.kind == "regression" and ds.is_pair and [e.label for e in ds.examples] == [1.5, 2.0]
    j = tmp_path / "u.jsonl"
    j.write_text(json.dumps({"text": "line\u2028separator", "label": 1}) + "\n" + json.dumps({"text": "x", "label": 0}))
    ds = load_dataset(j)
    assert ds.kind == "classification" and ds.labels == [0, 1] and len(ds) == 2  # JSON numbers stay numbers
    train, dev = split_dev(load_dataset(write_jsonl(tmp_path / "s.jsonl", synthetic_rows("classification", 50))))
    assert (len(train), len(dev)) == (45, 5)
    with pytest.raises(DataError, match="not among the task's labels"):
        load_dataset(f, kind="classification", labels=["x"])


@pytest.mark.parametrize("kind", ["classification", "regression", "token-classification"])
def test_collate_pads_rows_on_the_right_and_keeps_their_lengths_on_the_host(kind):
    rows = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    label: dict[str, list] = {
        "classification": [0, 2, 1],
        "regression": [0.5, 1.5, -2.0],
        "token-classification": [[-100, 3, -100], [1], [-100, 0, 2, 1, -100]],
    }
    feats = [Features(ids, [i % 2] * len(ids), lab) for i, (ids, lab) in enumerate(zip(rows, label[kind], strict=True))]
    b = collate(feats, 99, kind, torch.device("cpu"))
    assert b["input_ids"].tolist() == [[5, 6, 7, 99, 99], [8, 99, 99, 99, 99], [9, 10, 11, 12, 13]]
    assert b["token_type_ids"].tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert b["lengths"].tolist() == [3, 1, 5] and b["lengths"].device.type == "cpu"
    assert all(b[k].dtype == torch.long for k in ("input_ids", "token_type_ids", "attention_mask"))
    if kind == "token-classification":
        assert b["labels"].tolist() == [[-100, 3, -100, -100, -100], [1, -100, -100, -100, -100], label[kind][2]]
    else:
        assert b["labels"].tolist() == label[kind]
        assert b["labels"].dtype == (torch.float32 if kind == "regression" else torch.long)
