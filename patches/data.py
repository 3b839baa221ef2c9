"""Labelled data: JSONL and CSV readers for single sentences, sentence pairs, regression and token tagging.

Layouts (one object per JSONL line, or CSV columns of the same names):

* classification / regression: ``{"text", "label"}``, pairs add ``"text_pair"``;
* token tagging: ``{"tokens": [...], "tags": [...]}`` (JSONL only).

The kind is inferred unless given: tokens+tags -> token-classification; labels that are all numbers with at least
one non-integer -> regression; anything else -> classification. A malformed row is an error that names the file,
the line and the problem; no row is ever dropped silently.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from patchserve.patches.errors import PatchServeError
from patchserve.patches.validation import Label, is_label, shown, strict_json, unprintable

KINDS = ("classification", "regression", "token-classification")
_MAX_REPORTED = 10


class DataError(PatchServeError):
    """A data file cannot be used; the message lists the offending lines."""


@dataclass
class Example:
    text: str = ""
    text_pair: str | None = None
    label: str | int | float | None = None  # classification: str or int, as the file has it; regression: float
    tokens: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)


@dataclass
class Dataset:
    kind: str
    examples: list[Example]
    source: str
    # classification labels (strings or integers, as the file has them) / tag set, in a fixed order
    labels: list[Label] = field(default_factory=list)

    @property
    def is_pair(self) -> bool:
        return any(e.text_pair is not None for e in self.examples)

    def __len__(self) -> int:
        return len(self.examples)


def _rows(where: str, suffix: str, data: bytes) -> list[tuple[int, dict[str, Any]]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 text ({exc})") from exc
    if suffix in (".csv", ".tsv"):
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ",")
        try:
            return [(i + 2, dict(row)) for i, row in enumerate(reader)]  # line 1 is the header
        except csv.Error as exc:  # e.g. a field over csv's size limit
            raise DataError(f"{where}:{reader.line_num}: not valid {suffix[1:].upper()} ({exc})") from None
    rows, errors = [], []
    for i, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may sit inside a string
        if not line.strip():
            continue
        try:  # strict: NaN, lone surrogates (which no tokenizer takes) and deep nesting are errors of the line
            obj = strict_json(line, f"{where}:{i}", DataError)
        except DataError as exc:
            errors.append(str(exc))
            continue
        if not isinstance(obj, dict):
            errors.append(f"{where}:{i}: expected a JSON object, got {type(obj).__name__}")
            continue
        rows.append((i, obj))
    _raise(errors)
    return rows


def _raise(errors: list[str]) -> None:
    if errors:
        more = f"\n... and {len(errors) - _MAX_REPORTED} more" if len(errors) > _MAX_REPORTED else ""
        raise DataError("\n".join(errors[:_MAX_REPORTED]) + more)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    try:
        return isinstance(v, int | float | str) and math.isfinite(float(v))
    except (ValueError, OverflowError):  # not a number, or an integer beyond a float
        return False


def infer_kind(rows: list[tuple[int, dict[str, Any]]]) -> str:
    if rows and all("tokens" in r for _, r in rows):
        return "token-classification"
    labels = [r.get("label") for _, r in rows]
    if labels and all(_is_number(v) for v in labels) and any(float(v) != int(float(v)) for v in labels):  # type: ignore[arg-type]
        return "regression"
    return "classification"


@dataclass(frozen=True)
class DataFile:
    """A data file's bytes; its name's suffix picks the reader (.csv, .tsv, else JSONL), and errors call it
    ``where``: its path, or e.g. "train file 'reviews.csv'" for an upload."""

    name: str
    data: bytes
    where: str

    @classmethod
    def read(cls, path: str | Path) -> DataFile:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
        return cls(str(path), data, str(path))


def load_dataset(path: str | Path, kind: str | None = None, labels: list[Label] | None = None) -> Dataset:
    """Read and validate a data file. ``labels`` fixes the label order (else sorted labels of the file)."""
    return parse_dataset(DataFile.read(path), kind, labels)


def parse_dataset(file: DataFile, kind: str | None = None, labels: list[Label] | None = None) -> Dataset:
    """Validate a data file's rows (see ``load_dataset``)."""
    where = file.where
    rows = _rows(where, Path(file.name).suffix.lower(), file.data)
    if not rows:
        raise DataError(f"{where}: no examples")
    if kind is not None and kind not in KINDS:
        raise DataError(f"unknown kind {kind!r}; choose one of {list(KINDS)}")
    kind = kind or infer_kind(rows)
    examples, errors = [], []
    for line, row in rows:
        try:
            examples.append(_example(row, kind))
        except ValueError as exc:
            errors.append(f"{where}:{line}: {exc}")
    _raise(errors)
    pairs = {e.text_pair is not None for e in examples}
    if len(pairs) > 1:
        first = next(line for (line, _), e in zip(rows, examples, strict=True) if e.text_pair is None)
        raise DataError(f"{where}:{first}: some rows have text_pair and some do not; a file is all pairs or none")
    found: list[Label] = (
        sorted({t for e in examples for t in e.tags})
        if kind == "token-classification"
        else _label_set(examples, where)
        if kind == "classification"
        else []
    )
    if labels is not None and kind != "regression":  # matched by text: a patch's "1" takes a file's 1 (older patches)
        unknown = sorted({str(x) for x in found} - {str(x) for x in labels})
        if unknown:
            raise DataError(f"{where}: labels {unknown[:10]} are not among the task's labels {labels[:20]}")
        found = list(labels)
    if kind == "classification" and len(found) < 2:
        raise DataError(f"{where}: a classification task needs at least 2 distinct labels, found {found}")
    return Dataset(kind=kind, examples=examples, source=where, labels=found)


def _label_set(examples: list[Example], where: str) -> list[Label]:
    """The distinct labels, each with its JSON type (integers first, in numeric order, then strings). A number and
    a string of the same text (1 and "1") are refused: the task could answer only one of them."""
    by_text: dict[str, Label] = {}
    for e in examples:
        label = e.label
        assert isinstance(label, str | int)
        seen = by_text.setdefault(str(label), label)
        if type(seen) is not type(label):
            raise DataError(
                f"{where}: the label {shown(label)} appears both as a JSON number and as a string; write every "
                "label the same way (all numbers or all strings)"
            )
    return sorted(by_text.values(), key=lambda x: (isinstance(x, str), x))


@dataclass
class Splits:
    train: Dataset
    dev: Dataset
    test: Dataset | None
    dev_carved: bool  # no dev file: dev is 10% of train (split_dev)
    # tagging: tags of the dev or test file that no training sentence carries (the task's tag set takes them in)
    untrained_tags: list[Label] = field(default_factory=list)

    def untrained_warning(self) -> str | None:
        """One line for the user when dev or test carries tags the training data never has, else None."""
        if not self.untrained_tags:
            return None
        return (
            f"warning: the dev/test files carry {len(self.untrained_tags)} tag(s) that no training sentence has "
            f"({', '.join(map(str, self.untrained_tags[:10]))}): the patch gets outputs for them but cannot learn "
            "them, so their tokens count as errors"
        )


def load_splits(
    train: DataFile, dev: DataFile | None = None, test: DataFile | None = None, kind: str | None = None, seed: int = 0
) -> Splits:
    """Train, dev and test of one task, as ``patchserve train``, ``submit``, ``POST /jobs`` and the worker read
    them: dev and test must have train's kind and labels; without a dev file, dev is carved from train.

    Tagging is the exception: a tag set is every tag the files name, since a large one (Brown's part-of-speech tags,
    with their contractions such as ``pn+bez``) has rare tags that a training sample can miss. Those tags are listed
    in ``untrained_tags``; a classification label missing from train is still an error."""
    train_ds = parse_dataset(train, kind=kind)
    labels = train_ds.labels or None
    untrained: list[Label] = []
    if train_ds.kind == "token-classification":
        named = {str(t) for f in (dev, test) if f is not None for t in parse_dataset(f, kind=train_ds.kind).labels}
        untrained = sorted(named - {str(t) for t in train_ds.labels})
        labels = sorted([*map(str, train_ds.labels), *untrained])
        train_ds = replace(train_ds, labels=labels)
    if dev is not None:
        dev_ds = parse_dataset(dev, kind=train_ds.kind, labels=labels)
    else:
        train_ds, dev_ds = split_dev(train_ds, seed=seed)
    test_ds = parse_dataset(test, kind=train_ds.kind, labels=labels) if test is not None else None
    return Splits(train_ds, dev_ds, test_ds, dev is None, untrained)


def job_splits(files: Mapping[str, tuple[str, bytes]], kind: str | None = None, seed: int = 0) -> Splits:
    """``load_splits`` for a training job's uploads (role -> (file name, bytes)); errors name the role and the
    uploaded file, e.g. "train file 'reviews.jsonl':7: missing \"label\"". Checked when a job is submitted, so
    bad data is refused at once instead of failing later in a worker, and again by the worker."""
    named = {role: DataFile(name, data, f"{role} file {name!r}") for role, (name, data) in files.items()}
    if "train" not in named:
        raise DataError("a training job needs a 'train' data file")
    return load_splits(named["train"], named.get("dev"), named.get("test"), kind=kind, seed=seed)


def _example(row: dict[str, Any], kind: str) -> Example:
    if kind == "token-classification":
        tokens, tags = row.get("tokens"), row.get("tags")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise ValueError('"tokens" must be a non-empty list of non-empty strings')
        if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
            raise ValueError('"tags" must be a list of non-empty strings')
        if len(tags) != len(tokens):
            raise ValueError(f'"tokens" has {len(tokens)} items but "tags" has {len(tags)}')
        for tag in tags:
            _check_label(tag)
        return Example(tokens=tokens, tags=tags)
    text = row.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError('missing or empty "text"')
    pair = row.get("text_pair")
    if pair is not None and (not isinstance(pair, str) or not pair.strip()):
        pair = None if pair == "" else pair
        if pair is not None:
            raise ValueError('"text_pair" must be a non-empty string')
    if "label" not in row or row["label"] in (None, ""):
        raise ValueError('missing "label"')
    label = row["label"]
    if kind == "regression":
        if not _is_number(label):
            raise ValueError(f'"label" {label!r} is not a number (this is a regression task)')
        return Example(text=text, text_pair=pair, label=float(label))
    if isinstance(label, float) and label.is_integer():
        label = int(label)
    if not is_label(label):
        raise ValueError(f'"label" must be a non-empty string or an integer (within +-(2**53 - 1)), got {shown(label)}')
    _check_label(str(label))
    return Example(text=text, text_pair=pair, label=label)


def _check_label(label: str) -> str:
    """Labels and tags are names (they end up in patch metadata and responses): no control characters."""
    if (ch := unprintable(label)) is not None:
        raise ValueError(f"label {shown(label)} contains the control character {ch}")
    return label


def split_dev(ds: Dataset, fraction: float = 0.1, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Carve a dev split from ``ds`` (seeded shuffle; at least one row each side)."""
    if len(ds) < 2:
        raise DataError(f"{ds.source}: {len(ds)} example(s) cannot be split into train and dev; pass --dev")
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    n_dev = min(len(ds) - 1, max(1, round(fraction * len(ds))))
    dev = [ds.examples[i] for i in order[:n_dev]]
    train = [ds.examples[i] for i in order[n_dev:]]
    return replace(ds, examples=train, source=f"{ds.source} (train part)"), replace(
        ds, examples=dev, source=f"{ds.source} (dev part carved from train)"
    )
