"""A data set as the trainer feeds it: tokenised once (``featurize``), then padded into batches (``collate``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from patchserve.patches.data import Dataset
from patchserve.patches.packed_layout import to_device
from patchserve.patches.validation import Label

IGNORE = -100  # the label of a token that is not scored (a word's later sub-words, special tokens, padding)


@dataclass
class Features:
    input_ids: list[int]
    token_type_ids: list[int]
    label: int | float | list[int]


def featurize(tokenizer: Any, ds: Dataset, labels: Sequence[Label], max_len: int) -> list[Features]:
    """Tokenise a data set once. Tagging: the first sub-word of each word carries its tag, the rest are ignored.
    Labels are matched by their text, so a patch's "1" (as older patches stored every label) takes a file's 1."""
    index = {str(label): i for i, label in enumerate(labels)}
    if ds.kind == "token-classification":
        enc = tokenizer([e.tokens for e in ds.examples], is_split_into_words=True, truncation=True, max_length=max_len)
        feats = []
        for i, e in enumerate(ds.examples):
            tags, seen = [], set()
            for w in enc.word_ids(i):
                tags.append(IGNORE if w is None or w in seen else index[e.tags[w]])
                if w is not None:
                    seen.add(w)
            types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(tags)
            feats.append(Features(enc["input_ids"][i], types, tags))
        return feats
    pairs = [e.text_pair for e in ds.examples] if ds.is_pair else None
    enc = tokenizer([e.text for e in ds.examples], pairs, truncation=True, max_length=max_len)
    out = []
    for i, e in enumerate(ds.examples):
        label: int | float = float(e.label) if ds.kind == "regression" else index[str(e.label)]  # type: ignore[arg-type]
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(enc["input_ids"][i])
        out.append(Features(enc["input_ids"][i], types, label))
    return out


def collate(feats: list[Features], pad_id: int, kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``token_type_ids``, ``attention_mask`` ``[B, T]`` and ``labels`` (``[B]``, or
    ``[B, T]`` for tagging) on ``device``, copied without waiting for it (``to_device``); and each row's token count
    ``lengths`` ``[B]`` on the host. Filled in a few array operations, not a few per row: on a GPU the host's time
    is the update's."""
    n = len(feats)
    lengths = np.fromiter((len(f.input_ids) for f in feats), dtype=np.int64, count=n)
    t = int(lengths.max())
    real = np.arange(t) < lengths[:, None]  # [B, T]: the row's own tokens, filled in row order

    def padded(values: Any, fill: int | float, dtype: Any, where: np.ndarray = real) -> np.ndarray:
        out = np.full((n, t), fill, dtype=dtype)
        out[where] = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=int(where.sum()))
        return out

    ids = padded((f.input_ids for f in feats), pad_id, np.int64)
    types = padded((f.token_type_ids for f in feats), 0, np.int64)
    if kind == "token-classification":
        tagged = np.arange(t) < np.array([len(f.label) for f in feats])[:, None]  # type: ignore[arg-type]
        labels = torch.from_numpy(padded((f.label for f in feats), IGNORE, np.int64, tagged))
    elif kind == "regression":
        labels = torch.tensor([float(f.label) for f in feats])  # type: ignore[arg-type]
    else:
        labels = torch.tensor([int(f.label) for f in feats])  # type: ignore[arg-type]
    return {
        "input_ids": to_device(torch.from_numpy(ids), device),
        "token_type_ids": to_device(torch.from_numpy(types), device),
        "attention_mask": to_device(torch.from_numpy(real.astype(np.int64)), device),
        "labels": to_device(labels, device),
        "lengths": torch.from_numpy(lengths),  # on the host: the packed model's layout
    }
